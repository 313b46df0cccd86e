"""``slasolve.autograd.matvec_value_grad``: ``d <g, A x> / d values`` on the stored entries,
against the definition ``g[row] * x[col]`` evaluated in NumPy on the global vectors (scalar
and block tensors, one and several right-hand sides, empty ranks), and through a solve's
value gradient against SciPy's adjoint. Runs at any rank count."""
from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.autograd import matvec_value_grad
from slasolve.dsparse import DSparseTensor
from slasolve.testing import random_block_matrix, random_matrix

COMM = MPI.COMM_WORLD


def _split(nb: int, comm=COMM, skew: bool = False):
    size, rank = comm.Get_size(), comm.Get_rank()
    if skew and size > 1:  # rank 0 owns nothing
        counts = [0] + [nb // (size - 1) + (1 if r < nb % (size - 1) else 0) for r in range(size - 1)]
    else:
        counts = [nb // size + (1 if r < nb % size else 0) for r in range(size)]
    offs = np.concatenate([[0], np.cumsum(counts)])
    return int(offs[rank]), int(offs[rank + 1])


def _shard(A, b: int, skew: bool):
    """Rows of ``A`` (scalar CSR, or BSR with ``b x b`` blocks) split contiguously by block rows."""
    nb = A.shape[0] // b
    r0, r1 = _split(nb, skew=skew)
    if b == 1:
        C = A.tocsr()[r0:r1]
        C.sort_indices()
        vals, shape, block = torch.from_numpy(C.data.copy()), A.shape, ()
    else:
        C = sp.csr_matrix(A)[r0 * b:r1 * b].tobsr((b, b))
        C.sort_indices()
        vals, shape, block = torch.from_numpy(C.data.copy()), (nb, nb, b, b), (b, b)
    dA = DSparseTensor.from_local_rows(torch.from_numpy(C.indptr.astype(np.int64)),
                                       torch.from_numpy(C.indices.astype(np.int64)), vals, shape, COMM,
                                       block_shape=block)
    return dA, C, r0 * b, r1 * b


def _expected(C, b: int, r0: int, g: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``g[row] * x[col]`` per stored entry (summed over columns), in C's storage order."""
    nb_loc = C.shape[0] // b
    rows = np.repeat(np.arange(nb_loc), np.diff(C.indptr))
    gi = g.reshape(-1, b, *g.shape[1:])[r0 // b + rows]          # (nnzb, b[, k])
    xj = x.reshape(-1, b, *x.shape[1:])[C.indices]
    out = gi[:, :, None] * xj[:, None, :]
    if out.ndim == 4:
        out = out.sum(-1)
    return out.reshape(-1) if b == 1 else out


@pytest.mark.mpi
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("k", [None, 1, 4])
@pytest.mark.parametrize("skew", [False, True])
def test_matvec_value_grad_matches_definition(b, k, skew):
    nb = 23
    A = random_matrix(nb, density=0.2, seed=3) if b == 1 else random_block_matrix(nb, b, seed=3, symmetric=False)
    A = sp.csr_matrix(A) + sp.eye(nb * b)
    dA, C, r0, r1 = _shard(A, b, skew)
    rng = np.random.default_rng(7)
    shape = (nb * b,) if k is None else (nb * b, k)
    g, x = rng.standard_normal(shape), rng.standard_normal(shape)
    got = matvec_value_grad(dA, torch.from_numpy(g[r0:r1].copy()), torch.from_numpy(x[r0:r1].copy()))
    want = _expected(C, b, r0, g, x)
    assert tuple(got.shape) == tuple(dA.values.shape)
    # with k columns each entry is a k-term sum that may cancel, summed in the kernel's order (SIMD
    # width, torch vs NumPy): the two differ by <= 2 gamma_k sum_k |g x| = k eps sum_k |g x| (exact
    # for one column); bound it relative to that sum, not to the (possibly cancelled) result
    scale = _expected(C, b, r0, np.abs(g), np.abs(x))
    ok = bool(np.all(np.abs(got.numpy() - want) <= 1e-14 * scale))
    assert all(COMM.allgather(ok))


@pytest.mark.mpi
def test_solve_value_gradient_matches_scipy_adjoint():
    # dL/dA_ij = -lam_i x_j with A^T lam = c: SciPy solves on the whole (small) matrix
    nb, b = 30, 2
    A = random_block_matrix(nb, b, seed=5, symmetric=True)
    A = sp.csr_matrix(A) + 4 * nb * sp.eye(nb * b)
    dA, C, r0, r1 = _shard(A, b, skew=False)
    rhs = np.sin(np.arange(nb * b) + 1.0)
    c = np.cos(0.3 * np.arange(nb * b))
    vals = dA.values.detach().clone().requires_grad_()
    Ak = dA.with_values(vals)
    x = slasolve.solve(Ak, torch.from_numpy(rhs[r0:r1].copy()), "cg", rtol=1e-13)
    slasolve.global_sum((x * torch.from_numpy(c[r0:r1].copy())).sum()).backward()
    xs = spla.spsolve(A.tocsc(), rhs)
    lam = spla.spsolve(A.T.tocsc(), c)
    want = _expected(C, b, r0, -lam, xs)
    ok = np.allclose(vals.grad.numpy(), want, rtol=1e-7, atol=1e-10)
    assert all(COMM.allgather(ok))
