"""Replicated <-> sharded tensors with autograd (``torch.autograd.gradcheck`` of distributed
code: every rank perturbs the same inputs)."""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..collectives import AllgatherRows, ReplicatedInput

__all__ = ["local_slice", "replicate", "global_offsets"]


def local_slice(x_global: torch.Tensor, start: int, end: int, comm) -> torch.Tensor:
    """Collective in backward. Rows ``[start, end)`` of a replicated tensor; the
    backward sums every rank's gradient, so the global gradient is replicated."""
    return ReplicatedInput.apply(x_global, comm)[int(start):int(end)].clone()


def replicate(x_local: torch.Tensor, comm) -> torch.Tensor:
    """Collective. Concatenate every rank's rows (rank order), differentiably."""
    return AllgatherRows.apply(x_local, comm)


def global_offsets(comm, n_local: int) -> Sequence[int]:
    """Collective. Ownership offsets from the local sizes."""
    counts = comm.allgather(int(n_local))
    return np.concatenate([[0], np.cumsum(counts)]).astype(int).tolist()
