"""Differentiable collectives: the autograd Functions that cross ranks.

``AllreduceSum`` (a sum whose result is replicated: backward the identity),
``ReplicatedInput`` (a replicated input consumed by sharded outputs: backward sums the
ranks' gradients) and :func:`global_sum`.
"""
from __future__ import annotations

import numpy as np
import torch
from mpi4py import MPI

from ._comm import get_comm

__all__ = ["AllreduceSum", "ReplicatedInput", "global_sum"]


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


def global_sum(t: torch.Tensor, comm=None) -> torch.Tensor:
    """Collective. Sum ``t`` over the ranks of ``comm``; differentiable.

    Every rank gets the total (a replicated value, e.g. a global loss). The backward
    passes the gradient through unchanged: with ``loss = global_sum(local_loss)`` on
    every rank, ``d loss / d local_loss = 1`` on each rank, as it should be.
    """
    return AllreduceSum.apply(t, get_comm(comm))
