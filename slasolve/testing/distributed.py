"""Replicated <-> sharded tensors with autograd (``torch.autograd.gradcheck`` of distributed
code: every rank perturbs the same inputs)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["local_slice", "replicate", "global_offsets"]


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
