"""Helpers for testing distributed code: replicated <-> sharded tensors with autograd.

``torch.autograd.gradcheck`` perturbs inputs one entry at a time, so every rank
must see the same inputs in the same order. Wrap a distributed function as
``global input (same on all ranks) -> local_slice -> op -> replicate -> global
output`` and gradcheck that on every rank at once.
"""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["local_slice", "replicate", "global_offsets", "poisson_matrix", "grid_coords", "random_matrix",
           "block_spd_matrix"]


class _LocalSlice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_global, start, end, comm):
        ctx.meta = (start, end, comm, x_global.shape)
        return x_global[start:end].clone()

    @staticmethod
    def backward(ctx, g):
        start, end, comm, shape = ctx.meta
        full = g.new_zeros(shape)
        full[start:end] = g
        if comm.Get_size() > 1:
            buf = full.detach().cpu().numpy().copy()
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
            full = torch.from_numpy(buf).to(g.device)
        return full, None, None, None


class _Replicate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, comm):
        parts = comm.allgather(x_local.detach().cpu())
        sizes = [p.shape[0] for p in parts]
        ctx.meta = (comm, int(np.sum(sizes[: comm.Get_rank()])), x_local.shape[0])
        return torch.cat(parts, 0).to(x_local.device)

    @staticmethod
    def backward(ctx, g):
        comm, start, n = ctx.meta
        return g[start:start + n].clone(), None


def local_slice(x_global: torch.Tensor, start: int, end: int, comm) -> torch.Tensor:
    """Collective in backward. Rows ``[start, end)`` of a replicated tensor; the
    backward sums every rank's gradient, so the global gradient is replicated."""
    return _LocalSlice.apply(x_global, int(start), int(end), comm)


def replicate(x_local: torch.Tensor, comm) -> torch.Tensor:
    """Collective. Concatenate every rank's rows (rank order), differentiably."""
    return _Replicate.apply(x_local, comm)


def global_offsets(comm, n_local: int) -> Sequence[int]:
    """Collective. Ownership offsets from the local sizes."""
    counts = comm.allgather(int(n_local))
    return np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()


# -- small test matrices (global, SciPy CSR; every rank builds the same one) ----

def poisson_matrix(shape: Sequence[int]):
    """Local. Finite-difference Laplacian (5-point in 2-D, 7-point in 3-D) on a grid, CSR."""
    import scipy.sparse as sp
    terms = []
    for axis, m in enumerate(shape):
        t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
        mats = [sp.identity(k, format="csr") for k in shape]
        mats[axis] = t
        k = mats[0]
        for mat in mats[1:]:
            k = sp.kron(k, mat, format="csr")
        terms.append(k)
    return sum(terms).tocsr()


def grid_coords(shape: Sequence[int]) -> np.ndarray:
    """Local. Coordinates ``(prod(shape), d)`` of the grid points of :func:`poisson_matrix`."""
    axes = [np.arange(m, dtype=float) for m in shape]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(shape))


def random_matrix(n: int, m: Optional[int] = None, density: float = 0.05, seed: int = 0,
                  empty_rows: Sequence[int] = ()):
    """Local. A random nonsymmetric sparse matrix (CSR, float64) with a nonzero
    diagonal; the rows ``empty_rows`` are left without any stored entry."""
    import scipy.sparse as sp
    m = n if m is None else m
    rng = np.random.default_rng(seed)
    A = sp.random(n, m, density=density, random_state=rng, format="csr")
    A = (A + sp.eye(n, m, format="csr") * 4.0).tocsr()
    if len(empty_rows):
        keep = np.ones(n)
        keep[list(empty_rows)] = 0.0
        A = (sp.diags(keep) @ A).tocsr()
        A.eliminate_zeros()
    A.sort_indices()
    return A


def block_spd_matrix(shape: Sequence[int], b: int, seed: int = 0):
    """Local. An elasticity-like SPD block matrix (BSR, ``b x b`` blocks) on a grid:
    the scalar Laplacian pattern with every entry replaced by a ``b x b`` block
    (diagonal blocks SPD and dominant, off-diagonal blocks symmetric pairs)."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    L = poisson_matrix(shape).tocoo()
    n = L.shape[0]
    off = L.row != L.col
    r, c = L.row[off], L.col[off]
    upper = r < c
    ru, cu = r[upper], c[upper]
    Bu = rng.uniform(-0.5, 0.5, size=(ru.size, b, b)) - np.eye(b)
    rows = np.concatenate([ru, cu, np.arange(n)])
    cols = np.concatenate([cu, ru, np.arange(n)])
    G = rng.uniform(-0.5, 0.5, size=(n, b, b))
    D = np.einsum("kij,klj->kil", G, G) + np.eye(b) * (2.0 * b * 8)
    data = np.concatenate([Bu, np.transpose(Bu, (0, 2, 1)), D])
    order = np.lexsort((cols, rows))
    rows, cols, data = rows[order], cols[order], data[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
    return sp.bsr_matrix((data, cols, indptr), shape=(n * b, n * b))
