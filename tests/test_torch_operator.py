"""The torch backend's per-solve operator and reducer (slasolve/krylov/torch_operator.py).

The Krylov operator skips DSparseTensor.matvec's checks and, with a halo, exchanges
through persistent requests; it must give SciPy's product on every layout: no halo,
recompute mode (banded), zero-slot mode (random), ranks that only send, empty rows,
permuted partitions, float32/float64. Runs at any number of ranks.
"""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

from slasolve import solve
from slasolve.krylov.torch_operator import krylov_matvec, krylov_reducer
from slasolve.testing import case_matrix, distribute

COMM = MPI.COMM_WORLD


def _bidiagonal(n: int, lower: bool):
    # rows reference their own and the previous (next) column only: with a contiguous
    # partition some ranks have no ghost columns but must still send
    return sp.diags([1.0, 4.0], [-1, 0] if lower else [1, 0], shape=(n, n)).tocsr()


CASES = [("grid2d", "contiguous"), ("grid2d", "random"), ("spd", "contiguous"), ("nonsym", "random"),
         ("emptyrows_ns", "contiguous"), ("lower", "contiguous"), ("upper", "contiguous")]


def _matrix(kind: str):
    if kind in ("lower", "upper"):
        return _bidiagonal(37, kind == "lower")
    return case_matrix(kind, 150, seed=3)[0].tocsr()


@pytest.mark.mpi
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind,partition", CASES)
def test_krylov_matvec_matches_scipy(kind, partition, dtype):
    S = _matrix(kind)
    dA = distribute(S, COMM, partition=partition, seed=5)
    if dtype != torch.float64:
        dA = dA.to(dtype)
    xg = np.sin(0.7 * np.arange(S.shape[0])) + 0.5
    x = dA.scatter(torch.from_numpy(xg).to(dtype), root=None)
    op = krylov_matvec(dA, x)
    for _ in range(3):  # persistent requests: repeated products stay right
        y = op(x)
    ref = S @ xg
    got = dA.gather(y, root=None).to(torch.float64).numpy()
    tol = 1e-13 if dtype == torch.float64 else 1e-5
    assert np.abs(got - ref).max() <= tol * max(1.0, np.abs(ref).max())
    assert torch.equal(x, dA.scatter(torch.from_numpy(xg).to(dtype), root=None))  # input untouched


@pytest.mark.mpi
def test_krylov_reducer_sums_in_place():
    red = krylov_reducer(COMM)
    if COMM.Get_size() == 1:
        assert red is None
        return
    a = np.array([1.0, COMM.Get_rank()])
    red.host_inplace(a)
    size = COMM.Get_size()
    assert a.tolist() == [float(size), float(size * (size - 1) // 2)]
    t = red(torch.tensor([2.0]))
    assert t.tolist() == [2.0 * size]


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["cg", "minres", "gmres", "bicgstab"])
def test_solves_match_scipy_through_fast_operator(method):
    S = case_matrix("grid2d", 400, seed=0)[0].tocsr()
    dA = distribute(S, COMM, partition="random", seed=2)
    xg = np.cos(np.arange(S.shape[0]))
    b = dA.scatter(torch.from_numpy(S @ xg), root=None)
    x, info = solve(dA, b, method, backend="torch", pc="jacobi", rtol=1e-10, return_info=True)
    got = dA.gather(x, root=None).numpy()
    assert info.converged
    assert np.linalg.norm(S @ got - S @ xg) <= 1.01e-10 * np.linalg.norm(S @ xg)
