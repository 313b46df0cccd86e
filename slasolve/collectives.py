"""Differentiable collectives: the autograd Functions that cross ranks.

``AllreduceSum`` (a sum whose result is replicated: backward the identity),
``ReplicatedInput`` (a replicated input consumed by sharded outputs: backward sums the
ranks' gradients), ``AllgatherRows`` (every rank's rows, concatenated: backward keeps the
own rows), ``LinearExchange`` (any linear exchange given with its adjoint: the halo
exchanges of :class:`slasolve.HaloPlan`, the row moves of :mod:`slasolve.dtensor`) and
:func:`global_sum`.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ._comm import get_comm

__all__ = ["AllreduceSum", "ReplicatedInput", "AllgatherRows", "LinearExchange", "global_sum"]


class AllreduceSum(torch.autograd.Function):
    """Collective. Sum over ranks; the result is replicated, so the backward is the identity."""

    @staticmethod
    def forward(ctx, t, comm):
        if comm.Get_size() == 1:
            return t.clone()
        buf = np.ascontiguousarray(t.detach().cpu().numpy()).copy()
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return torch.from_numpy(buf).to(t.device)

    @staticmethod
    def backward(ctx, g):
        return g, None


class ReplicatedInput(torch.autograd.Function):
    """Collective (backward). Identity on a replicated input consumed by sharded outputs: the backward
    sums every rank's gradient (the adjoint of "copy to every rank")."""

    @staticmethod
    def forward(ctx, t, comm):
        ctx.comm = comm
        return t.view_as(t)

    @staticmethod
    def backward(ctx, g):
        return AllreduceSum.forward(None, g, ctx.comm), None


class AllgatherRows(torch.autograd.Function):
    """Collective. Every rank's rows concatenated in rank order (a replicated result), so the
    backward is this rank's rows of the (replicated) gradient."""

    @staticmethod
    def forward(ctx, t, comm):
        parts = comm.allgather(t.detach().cpu())
        sizes = [p.shape[0] for p in parts]
        ctx.rows = (int(np.sum(sizes[: comm.Get_rank()])), t.shape[0])
        return torch.cat(parts, 0).to(t.device)

    @staticmethod
    def backward(ctx, g):
        start, n = ctx.rows
        return g[start:start + n].clone(), None


class LinearExchange(torch.autograd.Function):
    """Collective. ``op(t)`` for a linear exchange ``op`` between ranks (no autograd of its own)
    whose adjoint is ``adjoint``: the backward applies ``adjoint`` to the (contiguous) gradient."""

    @staticmethod
    def forward(ctx, t, op, adjoint):
        ctx.adjoint = adjoint
        return op(t)

    @staticmethod
    def backward(ctx, g):
        return ctx.adjoint(g.contiguous()), None, None


def global_sum(t: torch.Tensor, comm=None) -> torch.Tensor:
    """Collective. Sum ``t`` over the ranks of ``comm``; differentiable.

    Every rank gets the total (a replicated value, e.g. a global loss). The backward
    passes the gradient through unchanged: with ``loss = global_sum(local_loss)`` on
    every rank, ``d loss / d local_loss = 1`` on each rank, as it should be.
    """
    comm = get_comm(comm)
    if comm.Get_size() == 1:   # the sum is t: torch's own clone (its backward the identity, in C++)
        return t.clone()
    return AllreduceSum.apply(t, comm)
