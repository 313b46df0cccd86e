"""Defaults succeed wherever SciPy's do (issue 19): solves that SciPy (or PETSc) finishes
with its default settings are not cut short by slasolve's defaults, at any rank count.

Matrices from PyAMG's gallery (tests/data/README.md). References: SciPy's own solvers
with their defaults, run in the test.
"""
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
