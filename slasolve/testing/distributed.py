"""Replicated <-> sharded tensors with autograd (``torch.autograd.gradcheck`` of distributed
code: every rank perturbs the same inputs), and random numbers keyed by global id (synthetic data
that is the same at every rank count)."""
from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch

from .._hashing import mix64
from ..collectives import AllgatherRows, ReplicatedInput

__all__ = ["local_slice", "replicate", "global_offsets", "normal_by_id"]

#: SplitMix64's increment (its generator adds it before mixing)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


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


def normal_by_id(ids: Union[np.ndarray, torch.Tensor, Sequence[int]], seed: int = 0, stream: int = 0
                 ) -> torch.Tensor:
    """Local. Standard normal numbers that depend only on ``(seed, stream, id)``.

    Synthetic data (measurement noise, random initial guesses) drawn per global node, dof or
    cell id with this function is the same whichever rank owns the id, so a script gives the
    same data at 1 rank and under ``mpirun``; a random generator's state would not.

    Parameters
    ----------
    ids : array_like of int
        Non-negative global ids (any shape).
    seed, stream : int
        Independent sequences: another seed or stream gives other numbers for the same ids.

    Returns
    -------
    torch.Tensor
        float64, the shape of ``ids``: two uniforms per id from SplitMix64 of a key mixing
        ``(seed, stream, id)``, turned into one normal by the Box-Muller transform.
    """
    ids = ids.cpu().numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
    if ids.size and (not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0):
        raise ValueError(f"normal_by_id: ids must be non-negative integers, got dtype {ids.dtype}"
                         + (f" with minimum {ids.min()}" if np.issubdtype(ids.dtype, np.integer) else ""))
    with np.errstate(over="ignore"):
        key = (ids.astype(np.uint64) * np.uint64(8) + np.uint64(2 * int(stream))) \
            ^ (np.uint64(int(seed)) * np.uint64(0xD1B54A32D192ED03))
        u1 = (mix64(key + _GOLDEN) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
        u2 = (mix64(key + np.uint64(1) + _GOLDEN) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return torch.from_numpy(np.sqrt(-2.0 * np.log1p(-u1)) * np.cos(2.0 * math.pi * u2))
