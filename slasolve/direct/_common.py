"""Helpers shared by the direct-solve backends: value snapshots, collective failure."""
from __future__ import annotations

from typing import Optional

import torch

from .info import FactorizationError, failed_info

__all__ = ["changed_anywhere", "raise_factor_error_collective"]


def changed_anywhere(comm, snapshot: Optional[torch.Tensor], vals: torch.Tensor) -> bool:
    """Collective. True on every rank when any rank's values differ from its snapshot
    (``torch.equal``: an O(nnz) read, never a tensor stamp; see ``slasolve.petsc``)."""
    mine = snapshot is None or not (snapshot.shape == vals.shape and snapshot.dtype == vals.dtype
                                    and snapshot.device == vals.device and torch.equal(snapshot, vals))
    from mpi4py import MPI
    from .._comm import allreduce_int
    return bool(allreduce_int(comm, int(mine), MPI.MAX))


def raise_factor_error_collective(comm, err: Optional[BaseException], backend: str = "",
                                  factorization: str = "") -> None:
    """Collective. Raise on every rank when any rank has ``err`` (one Allreduce when no
    rank failed). Every rank raises the lowest failing rank's exception type
    (:class:`FactorizationError`, ``ValueError``, ``TypeError``; anything else
    ``RuntimeError``) and message."""
    if comm.Get_size() == 1:
        if err is not None:
            raise err
        return
    from mpi4py import MPI
    from .._comm import allreduce_int
    if not allreduce_int(comm, int(err is not None), MPI.MAX):
        return
    msgs = comm.allgather(None if err is None else (type(err).__name__, str(err), getattr(err, "code", None)))
    first = next(r for r, m in enumerate(msgs) if m is not None)
    if err is not None and first == comm.Get_rank():
        raise err
    kind, text, code = msgs[first]
    text = f"{text} (on rank {first})"
    if kind == "FactorizationError":
        raise FactorizationError(failed_info(backend, factorization), text, code)
    raise {"ValueError": ValueError, "TypeError": TypeError, "ImportError": ImportError}.get(
        kind, RuntimeError)(text)
