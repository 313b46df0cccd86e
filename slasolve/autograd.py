"""Adjoint pieces shared by the solvers: value gradients of distributed products.

For a row-sharded ``A`` and vectors ``g`` (owned rows) and ``x`` (owned columns),
``matvec_value_grad(A, g, x)`` is ``d <g, A x> / d values`` on the stored nonzeros
only: ``g[row_k] * x[col_k]``, with ghost entries of ``x`` fetched by the halo
exchange. The adjoint of ``x = A^{-1} b`` is then
``dL/dvalues = matvec_value_grad(A, -lam, x)`` with ``A^T lam = dL/dx``.
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from ._comm import check_collective, raise_collected
from .collectives import global_sum
from .symmetry import looks_symmetric, symmetry_defect  # noqa: F401  (public here since 0.1)

__all__ = ["matvec_value_grad", "global_sum", "saved_tensors", "saved_tensors_and_flag", "saved_tensors_and_sums",
           "symmetry_defect", "AdjointFunction"]


def saved_tensors(ctx, comm, what: str) -> tuple:
    """Collective. ``ctx.saved_tensors`` of an autograd Function, checked on every rank.

    PyTorch raises ``RuntimeError`` when a tensor saved for the backward (an operator's
    values, a solution, a right-hand side) was modified in place after the forward; on
    one rank alone that would leave the others waiting in the adjoint's collectives. The
    outcome is combined (one small Allreduce) and every rank raises the same error.
    """
    return saved_tensors_and_flag(ctx, comm, what)[0]


def saved_tensors_and_flag(ctx, comm, what: str, flag: bool = False) -> tuple:
    """Collective. ``(saved tensors, flag on any rank)``: :func:`saved_tensors` with a local fact
    of the caller's combined on the same Allreduce."""
    out, err = _saved(ctx, what)
    return out, check_collective(comm, err, flag=flag)


def _saved(ctx, what: str) -> tuple:
    """Local. ``(ctx.saved_tensors, None)``, or ``(None, the error to raise on every rank)``."""
    try:
        return ctx.saved_tensors, None
    except RuntimeError as e:
        return None, RuntimeError(f"{what}: a tensor the backward needs (the operator's values or the forward's "
                                  f"inputs/outputs) was modified by an inplace operation after the forward; the "
                                  f"gradient would mix the old and new values. Clone it before changing it, or "
                                  f"call backward first. PyTorch: {e}")


def saved_tensors_and_sums(ctx, comm, what: str, sums: np.ndarray) -> tuple:
    """Collective. ``(saved tensors, sums summed over the ranks)``: :func:`saved_tensors` with
    the caller's local float64 numbers ``sums`` (the same count on every rank) added up on the
    same Allreduce."""
    out, err = _saved(ctx, what)
    buf = np.empty(len(sums) + 1)
    buf[0] = err is not None
    buf[1:] = sums
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    if buf[0]:
        raise_collected(comm, err, int(buf[0]))
    return out, buf[1:]


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
    lc = _local_cols(L)
    if br == 1 and bc == 1 and K == 1:  # 1-D gathers: the fastest torch has (cached row ids)
        gv = g.reshape(-1).index_select(0, _rows(L)) * xfull.reshape(-1).index_select(0, lc)
        return gv if gv.dtype == values.dtype else gv.to(values.dtype)
    counts = ip[1:] - ip[:-1]
    G = torch.repeat_interleave(g.reshape(n_rows, br * K), counts, dim=0, output_size=nnz)
    X = xfull.index_select(0, lc)                             # (nnz, bc * K)
    if K == 1:  # one product per block row: a broadcast over tiny trailing dims is 3x slower
        gv = G.new_empty((nnz, br, bc))
        for i in range(br):
            torch.mul(G[:, i:i + 1], X, out=gv[:, i, :])
    else:
        gv = (G.reshape(nnz, br, 1, K) * X.reshape(nnz, 1, bc, K)).sum(-1)
    return gv.reshape(values.shape).to(values.dtype)


def _rows(L) -> torch.Tensor:
    """Local. Each stored entry's local row (int32 where it fits; cached on the layout)."""
    def build():
        ip = L._pattern.indptr
        counts = ip[1:] - ip[:-1]
        n = int(counts.numel())
        dt = torch.int32 if n < 2 ** 31 else torch.int64
        return torch.repeat_interleave(torch.arange(n, dtype=dt, device=counts.device), counts)
    return L.cached("value_grad", "rows", build)


def _local_cols(L) -> torch.Tensor:
    """Local. Each stored entry's column in ``[owned columns; ghosts]`` numbering (cached on
    the layout: the pattern is fixed)."""
    def build():
        n_cols = L.cend - L.cstart
        lc = L._pattern.indices - L.cstart
        if L.n_offd:
            lc[L.offd_pos] = n_cols + L.off_col
        return lc.to(torch.int32) if n_cols + int(L.ghost_ids.numel()) < 2 ** 31 else lc
    return L.cached("value_grad", "cols", build)


class AdjointFunction(torch.autograd.Function):
    """Collective (backward). Base of the solvers' adjoint Functions (:func:`slasolve.solve`,
    :func:`slasolve.spsolve`, :func:`slasolve.eigsh`, :func:`slasolve.nonlinear_solve`):
    differentiable once, the guards and their messages in one place.

    ``backward`` raises ``RuntimeError`` (on every rank: ``create_graph`` is the same
    everywhere) when a second derivative is asked (``create_graph=True``): the adjoint solves
    are not recorded, so it would silently miss their terms, and torch's
    ``once_differentiable`` is not enough (its error node is not reached by
    ``torch.autograd.grad(..., inputs)``). It then checks the saved tensors against in-place
    changes on every rank (:func:`saved_tensors`) and calls the subclass's
    ``adjoint(ctx, saved, *grads)``. Subclasses set ``name`` (the public function, for the
    messages) and, when the forward keeps no operator in ``ctx.dA``, ``comm(ctx)``.
    """

    name = ""

    @staticmethod
    def comm(ctx):
        """Local. The communicator of the forward: its operator's (``ctx.dA``), unless a
        subclass keeps it elsewhere."""
        return ctx.dA.comm

    @staticmethod
    def adjoint(ctx, saved, *grads):
        """Collective. The gradients of the forward's inputs from those of its outputs
        (subclasses), ``saved`` the checked saved tensors."""
        raise NotImplementedError

    @classmethod
    def backward(cls, ctx, *grads):
        """Collective. The guards, then :meth:`adjoint`."""
        if torch.is_grad_enabled():
            raise RuntimeError(f"{cls.name} is differentiable once: second derivatives (backward with "
                               "create_graph=True) through it are not implemented; they would silently "
                               "miss the terms of its adjoint")
        sums = cls.early_sums(ctx, *grads)
        if sums is None:
            saved, ctx.early_flag = saved_tensors_and_flag(ctx, cls.comm(ctx), f"backward of {cls.name}",
                                                           bool(cls.early_flag(ctx, *grads)))
        else:
            saved, ctx.early_sums = saved_tensors_and_sums(ctx, cls.comm(ctx), f"backward of {cls.name}", sums)
        return cls.adjoint(ctx, saved, *grads)

    @staticmethod
    def early_flag(ctx, *grads) -> bool:
        """Local. A fact the subclass's :meth:`adjoint` needs combined over the ranks (True on any
        rank), read there as ``ctx.early_flag``: it rides on the saved-tensor check's Allreduce."""
        return False

    @staticmethod
    def early_sums(ctx, *grads) -> Optional[np.ndarray]:
        """Local. Numbers (float64, the same count on every rank) the subclass's :meth:`adjoint`
        needs summed over the ranks, read there as ``ctx.early_sums``: they ride on the
        saved-tensor check's Allreduce instead of :meth:`early_flag`'s. None (the default):
        :meth:`early_flag` is used."""
        return None
