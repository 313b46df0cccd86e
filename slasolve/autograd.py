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

    One pass over the stored entries in their own order: ``g`` repeated per row
    (``repeat_interleave`` over the row counts) times ``[x_owned; x_ghost]`` gathered at
    each entry's local column (owned columns first, then the halo's ghosts). The local
    column ids are made on the first call and kept on the layout (one int32/int64 per
    stored block, the pattern's own size; the pattern never changes).
    """
    L = dA._need_row_shard("matvec_value_grad")
    values = dA.values
    g = g.detach()
    x = x.detach()
    trailing = tuple(x.shape[1:])
    br, bc = L.br, L.bc
    n_rows, n_cols = L.rend - L.rstart, L.cend - L.cstart
    K = 1
    for t in trailing:
        K *= int(t)
    xb = x.reshape(n_cols, bc, K)
    xg = L.halo.forward_raw(xb.contiguous())
    xfull = torch.cat([xb, xg.reshape(-1, bc, K)]) if xg.numel() else xb
    ip = L._pattern.indptr
    nnz = int(values.shape[0])
    G = torch.repeat_interleave(g.reshape(n_rows, br, K), ip[1:] - ip[:-1], dim=0, output_size=nnz)
    X = xfull.index_select(0, _local_cols(L))                 # (nnz, bc, K)
    if K == 1 and br == 1:
        gv = G.reshape(nnz, 1, 1) * X.reshape(nnz, 1, bc)
    elif K == 1:  # one product per block row: a broadcast over tiny trailing dims is 3x slower
        gv = G.new_empty((nnz, br, bc))
        G, X = G.reshape(nnz, br), X.reshape(nnz, bc)
        for i in range(br):
            torch.mul(G[:, i:i + 1], X, out=gv[:, i, :])
    else:
        gv = (G.reshape(nnz, br, 1, K) * X.reshape(nnz, 1, bc, K)).sum(-1)
    return gv.reshape(values.shape).to(values.dtype)


def _local_cols(L) -> torch.Tensor:
    """Local. Each stored entry's column in ``[owned columns; ghosts]`` numbering (cached on
    the layout: the pattern is fixed)."""
    lc = L.__dict__.get("value_grad_cols")
    if lc is None:
        cols = L._pattern.indices
        n_cols = L.cend - L.cstart
        lc = cols - L.cstart
        if L.n_offd:
            lc[L.offd_pos] = n_cols + L.off_col
        if n_cols + int(L.ghost_ids.numel()) < 2 ** 31:
            lc = lc.to(torch.int32)
        L.__dict__["value_grad_cols"] = lc
    return lc


def global_sum(t: torch.Tensor, comm=None) -> torch.Tensor:
    """Collective. Sum ``t`` over the ranks of ``comm``; differentiable.

    Every rank gets the total (a replicated value, e.g. a global loss). The backward
    passes the gradient through unchanged: with ``loss = global_sum(local_loss)`` on
    every rank, ``d loss / d local_loss = 1`` on each rank, as it should be.
    """
    from ._comm import get_comm
    from .dsparse import _AllreduceSum
    return _AllreduceSum.apply(t, get_comm(comm))
