"""An optimisation loop on the petsc backend: new values every iteration through the cached
PETSc Mat (refilled in place, its snapshot reused), the cached KSP (diagonal check skipped
while the operator is unchanged) and the value gradient; every answer against SciPy on the
whole (small) matrix. Runs at any rank count."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.dsparse import DSparseTensor
from slasolve.testing import poisson_matrix

pytest.importorskip("petsc4py")
COMM = MPI.COMM_WORLD


def _rows(n: int):
    size, rank = COMM.Get_size(), COMM.Get_rank()
    counts = [n // size + (1 if r < n % size else 0) for r in range(size)]
    offs = np.concatenate([[0], np.cumsum(counts)])
    return int(offs[rank]), int(offs[rank + 1])


def _setup(nx: int = 12):
    A = sp.csr_matrix(poisson_matrix((nx, nx)))
    A.sort_indices()
    n = A.shape[0]
    r0, r1 = _rows(n)
    C = A[r0:r1]
    dA = DSparseTensor.from_local_rows(torch.from_numpy(C.indptr.astype(np.int64)),
                                       torch.from_numpy(C.indices.astype(np.int64)),
                                       torch.from_numpy(C.data.copy()), (n, n), COMM)
    rows = np.repeat(np.arange(r0, r1), np.diff(C.indptr))
    return A, C, dA, rows, C.indices.astype(np.int64), r0, r1


def _scaled(A, k: int):
    d = 1.0 + 0.3 * np.sin(0.7 * k + np.arange(A.shape[0]) / 7.0)
    return sp.csr_matrix(sp.diags(d) @ A @ sp.diags(d))


@pytest.mark.mpi
@pytest.mark.parametrize("pc", ["gamg", "jacobi"])
def test_loop_of_new_values_matches_scipy(pc):
    A, C, dA, rows, cols, r0, r1 = _setup()
    n = A.shape[0]
    b = np.sin(0.37 * np.arange(n)) + 1.0
    c = np.cos(0.21 * np.arange(n))
    ok = True
    for k in (0, 1, 2, 1, 1, 0):  # repeats and returns to earlier values
        Ak = _scaled(A, k)
        Ak.sort_indices()
        vals = torch.from_numpy(Ak[r0:r1].data.copy()).requires_grad_()
        x = slasolve.solve(dA.with_values(vals), torch.from_numpy(b[r0:r1].copy()), "cg", pc=pc, rtol=1e-12)
        slasolve.global_sum((x * torch.from_numpy(c[r0:r1].copy())).sum()).backward()
        xs = spla.spsolve(Ak.tocsc(), b)
        lam = spla.spsolve(Ak.T.tocsc(), c)
        ok &= np.allclose(x.detach().numpy(), xs[r0:r1], rtol=1e-8, atol=1e-10)
        ok &= np.allclose(vals.grad.numpy(), -lam[rows] * xs[cols], rtol=1e-7, atol=1e-10)
    assert all(COMM.allgather(bool(ok)))


@pytest.mark.mpi
def test_in_place_writes_without_version_bump_are_seen():
    # writes through a NumPy view do not bump the tensor's _version: the snapshot comparison
    # must still see them (and the snapshot, reused in place, must not alias the values)
    A, C, dA, rows, cols, r0, r1 = _setup()
    n = A.shape[0]
    b = torch.from_numpy(np.ones(n)[r0:r1].copy())
    vals = dA.values.detach().clone()
    Ak = dA.with_values(vals)
    ok = True
    for k in (1, 2, 3):
        As = _scaled(A, k)
        As.sort_indices()
        vals.numpy()[:] = As[r0:r1].data          # same tensor object, same _version
        x = slasolve.solve(Ak, b, "cg", pc="gamg", rtol=1e-12)
        ok &= np.allclose(x.numpy(), spla.spsolve(As.tocsc(), np.ones(n))[r0:r1], rtol=1e-8, atol=1e-10)
    assert all(COMM.allgather(bool(ok)))


@pytest.mark.mpi
def test_zero_diagonal_after_good_solves_raises_everywhere_then_recovers():
    A, C, dA, rows, cols, r0, r1 = _setup()
    n = A.shape[0]
    b = torch.from_numpy(np.ones(n)[r0:r1].copy())
    good = dA.values.detach().clone()
    slasolve.solve(dA.with_values(good), b, "cg", pc="gamg", rtol=1e-10)
    slasolve.solve(dA.with_values(good.clone()), b, "cg", pc="gamg", rtol=1e-10)   # unchanged: check skipped
    bad = good.clone()
    last = COMM.Get_size() - 1
    if COMM.Get_rank() == last:  # a zero diagonal entry on the last rank only
        diag = np.flatnonzero(rows == cols)
        bad[int(diag[-1])] = 0.0
    with pytest.raises(ValueError, match="nonzero diagonal"):
        slasolve.solve(dA.with_values(bad), b, "cg", pc="gamg", rtol=1e-10)
    x = slasolve.solve(dA.with_values(good.clone()), b, "cg", pc="gamg", rtol=1e-10)
    ok = np.allclose(x.numpy(), spla.spsolve(A.tocsc(), np.ones(n))[r0:r1], rtol=1e-7, atol=1e-9)
    assert all(COMM.allgather(bool(ok)))
