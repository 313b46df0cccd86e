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

    One pass over the stored entries in their own order: ``g`` at each entry's row times
    ``[x_owned; x_ghost]`` at each entry's local column (owned columns first, then the
    halo's ghosts). The local column ids (and, for scalar tensors, the row ids) are made on
    the first call and kept on the layout as int32 where they fit (4 bytes per stored entry
    each; the pattern never changes). Block rows use ``repeat_interleave`` over the row counts.
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
    # 1-D / 2-D operands: torch's gathers and repeats over 3-D views are several times slower
    xb = x.reshape(n_cols, bc * K)
    xg = L.halo.forward_raw(xb.contiguous())
    xfull = torch.cat([xb, xg.reshape(-1, bc * K)]) if xg.numel() else xb
    ip = L._pattern.indptr
    nnz = int(values.shape[0])
    counts = ip[1:] - ip[:-1]
    lc = _local_cols(L)
    if br == 1 and bc == 1 and K == 1:  # 1-D gathers: the fastest torch has (cached row ids)
        gv = g.reshape(-1).index_select(0, _rows(L, counts)) * xfull.reshape(-1).index_select(0, lc)
        return gv.reshape(values.shape).to(values.dtype)
    G = torch.repeat_interleave(g.reshape(n_rows, br * K), counts, dim=0, output_size=nnz)
    X = xfull.index_select(0, lc)                             # (nnz, bc * K)
    if K == 1:  # one product per block row: a broadcast over tiny trailing dims is 3x slower
        gv = G.new_empty((nnz, br, bc))
        for i in range(br):
            torch.mul(G[:, i:i + 1], X, out=gv[:, i, :])
    else:
        gv = (G.reshape(nnz, br, 1, K) * X.reshape(nnz, 1, bc, K)).sum(-1)
    return gv.reshape(values.shape).to(values.dtype)


def _rows(L, counts: torch.Tensor) -> torch.Tensor:
    """Local. Each stored entry's local row (int32 where it fits; cached on the layout)."""
    rows = L.__dict__.get("value_grad_rows")
    if rows is None:
        n = int(counts.numel())
        dt = torch.int32 if n < 2 ** 31 else torch.int64
        rows = torch.repeat_interleave(torch.arange(n, dtype=dt, device=counts.device), counts)
        L.__dict__["value_grad_rows"] = rows
    return rows


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
