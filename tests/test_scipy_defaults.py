"""Defaults succeed wherever SciPy's do (issue 19): solves that SciPy (or PETSc) finishes
with its default settings are not cut short by slasolve's defaults, at any rank count.

Matrices from PyAMG's gallery (tests/data/README.md). References: SciPy's own solvers
with their defaults, run in the test.
"""
import inspect
import os

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch
from mpi4py import MPI

import slasolve
import slasolve.linalg as L
from slasolve.eigen import eigsh
from slasolve.testing import distribute

COMM = MPI.COMM_WORLD
DATA = os.path.join(os.path.dirname(__file__), "data")


def load(name):
    return sp.load_npz(os.path.join(DATA, f"{name}.npz")).tocsr().astype(np.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ("petsc", "torch"))
def test_gmres_recirc_flow_tight_rtol_default_budget(backend):
    """recirc_flow at rtol 1e-12 needs ~2300-3400 GMRES(30) iterations: more than 10 n = 2250.
    SciPy's gmres (10 n restart cycles) finishes it by default; so must slasolve."""
    A = load("recirc_flow")
    b = np.ones(A.shape[0])
    xs, info = ssl.gmres(A, b, tol=1e-12, atol=0)
    assert info == 0
    dA = distribute(A, COMM)
    x, sinfo = slasolve.solve(dA, dA.scatter(torch.from_numpy(b), root=None), "gmres", rtol=1e-12,
                              backend=backend, return_info=True)
    assert sinfo.converged
    xg = dA.gather(x, root=None).numpy()
    assert np.linalg.norm(A @ xg - b) <= 1.01e-12 * np.linalg.norm(b)


@pytest.mark.mpi
def test_linalg_gmres_recirc_flow_defaults():
    A = load("recirc_flow")
    b = np.ones(A.shape[0])
    x, info = L.gmres(A, b, rtol=1e-12, comm=COMM)
    assert info == 0 and np.linalg.norm(A @ x - b) <= 1.01e-12 * np.linalg.norm(b)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ("slepc", "torch"))
def test_eigsh_local_disc_smallest_six_defaults(backend):
    """k=6 smallest eigenvalues of local_disc_galerkin_diffusion: SciPy's ARPACK finds them
    with its defaults (maxiter 10 n); SLEPc's own default (100 restarts) did not."""
    A = load("local_disc_galerkin_diffusion")
    A = ((A + A.T) * 0.5).tocsr()          # symmetric to rounding in the file (1.8e-12)
    ref = np.sort(ssl.eigsh(A, 6, which="SA", return_eigenvectors=False))
    w, V = eigsh(distribute(A, COMM), 6, which="SA", backend=backend)
    assert np.allclose(np.sort(w.numpy()), ref, rtol=1e-7, atol=0)
    wl = L.eigsh(A, 6, which="SA", comm=COMM, return_eigenvectors=False)
    assert np.allclose(np.sort(wl), ref, rtol=1e-9, atol=0)


# PyAMG's symmetric positive definite example matrices (tests/data/README.md)
PYAMG_SPD = ("airfoil", "bar", "knot", "unit_cube")


def scipy_krylov(method, A, b, rtol):
    """SciPy's solver with its defaults but ``rtol`` (named ``tol`` before SciPy 1.12)."""
    f = getattr(ssl, method)
    name = "rtol" if "rtol" in inspect.signature(f).parameters else "tol"
    return f(A, b, **{name: rtol})


@pytest.mark.mpi
@pytest.mark.parametrize("name", PYAMG_SPD)
def test_krylov_defaults_converge_where_scipy_does(name):
    """Every SciPy Krylov method that finishes (``info == 0``) with its defaults on PyAMG's SPD
    examples (b = ones, rtol 1e-5 and 1e-10) finishes with slasolve's defaults too, through
    ``slasolve.linalg`` (SciPy's signature: ``info == 0``) and ``slasolve.solve`` (converged),
    each meeting ``||b - A x|| <= rtol ||b||`` (SciPy's MINRES stops on an estimate and may not).
    Under mpirun only the tighter rtol (GMRES(30) on ``bar`` takes ~10^4 iterations there)."""
    A = load(name)
    b = np.ones(A.shape[0])
    dA = distribute(A, COMM)
    bd = dA.scatter(torch.from_numpy(b), root=None)
    bound = lambda rtol: 1.01 * rtol * np.linalg.norm(b)  # noqa: E731
    for rtol in (1e-5, 1e-10) if COMM.size == 1 else (1e-10,):
        for method in ("cg", "minres", "gmres", "bicgstab"):
            _, info = scipy_krylov(method, A, b, rtol)
            if info != 0:
                continue
            x, linfo = getattr(L, method)(A, b, rtol=rtol, comm=COMM)
            assert linfo == 0 and np.linalg.norm(b - A @ x) <= bound(rtol), (method, rtol)
            xd, sinfo = slasolve.solve(dA, bd, method, rtol=rtol, return_info=True)
            assert sinfo.converged, (method, rtol, sinfo.reason)
            xg = dA.gather(xd, root=None).numpy()
            assert np.linalg.norm(b - A @ xg) <= bound(rtol), (method, rtol)


@pytest.mark.parametrize("name", PYAMG_SPD)
@pytest.mark.parametrize("backend", (pytest.param("slepc", marks=pytest.mark.mpi), "torch"))
def test_eigsh_defaults_converge_where_arpack_does(name, backend):
    """k = 4 eigenvalues at each end (SA, LA, LM, SM) of PyAMG's SPD examples: where SciPy's
    ARPACK finishes with its defaults, slasolve's ``eigsh`` defaults do, with the same values.
    SLEPc at every rank count; the torch backend on one rank (its multi-rank eigensolvers are
    the property tests' job: here they would add minutes of oversubscribed collectives)."""
    A = load(name)
    dA = distribute(A, COMM)
    for which in ("SA", "LA", "LM", "SM"):
        ref = np.sort(ssl.eigsh(A, 4, which=which, return_eigenvectors=False))
        w, _ = eigsh(dA, 4, which=which, backend=backend)
        assert np.allclose(np.sort(w.numpy()), ref, rtol=1e-8, atol=0), which
