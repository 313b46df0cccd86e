"""Adjoint pieces shared by the solvers: value gradients of distributed products.

For a row-sharded ``A`` and vectors ``g`` (owned rows) and ``x`` (owned columns),
``matvec_value_grad(A, g, x)`` is ``d <g, A x> / d values`` on the stored nonzeros
only: ``g[row_k] * x[col_k]``, with ghost entries of ``x`` fetched by the halo
exchange. The adjoint of ``x = A^{-1} b`` is then
``dL/dvalues = matvec_value_grad(A, -lam, x)`` with ``A^T lam = dL/dx``.
"""
from __future__ import annotations

import torch

__all__ = ["matvec_value_grad", "global_sum"]


def matvec_value_grad(dA, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Collective. ``d <g, A x> / d values`` in ``dA.values``' (local nnz) order.

    ``g``: owned rows ``(n_local[, k])``; ``x``: owned columns, same trailing shape
    (several right-hand sides are summed).
    """
    from .dsparse import _values_grad
    L = dA._need_row_shard("matvec_value_grad")
    g = g.detach().contiguous()
    x = x.detach().contiguous()
    trailing = tuple(x.shape[1:])
    xg = L.halo.forward_raw(x.reshape((L.cend - L.cstart, L.bc) + trailing))
    xg = xg.reshape((L.halo.n_ghost * L.bc,) + trailing)
    return _values_grad(L, dA.values.detach(), g, x, xg)


def global_sum(t: torch.Tensor, comm=None) -> torch.Tensor:
    """Collective. Sum ``t`` over the ranks of ``comm``; differentiable.

    Every rank gets the total (a replicated value, e.g. a global loss). The backward
    passes the gradient through unchanged: with ``loss = global_sum(local_loss)`` on
    every rank, ``d loss / d local_loss = 1`` on each rank, as it should be.
    """
    from ._comm import get_comm
    from .dsparse import _AllreduceSum
    return _AllreduceSum.apply(t, get_comm(comm))
