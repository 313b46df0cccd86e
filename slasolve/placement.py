"""Placements and the distributed spec, mirroring ``torch.distributed.tensor``.

* ``Replicated()``: every rank holds the whole matrix.
* ``SparseShard(axis)``: the sparse axis ``axis`` (counted in the full
  ``(*batch, M, N, *block)`` shape) is split into contiguous ranges; ``axis ==
  len(batch)`` is a row shard (PETSc MPIAIJ layout), the next one a column shard.
* ``Shard(dim)``: the dense batch dimension ``dim`` is split; each rank holds
  whole matrices of its part of the batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Tuple

__all__ = ["Placement", "Replicated", "SparseShard", "Shard", "DSparseSpec", "row_shard", "col_shard"]


class Placement:
    """Local. Base class of placements."""

    def is_row_shard(self, nbatch: int) -> bool:
        """Local. Whether this placement splits the rows of a tensor with ``nbatch`` batch dims."""
        return False

    def is_col_shard(self, nbatch: int) -> bool:
        """Local. Whether this placement splits the columns of a tensor with ``nbatch`` batch dims."""
        return False


@dataclass(frozen=True)
class Replicated(Placement):
    """Every rank holds the full matrix."""


@dataclass(frozen=True)
class SparseShard(Placement):
    """Split the sparse axis ``axis`` of ``(*batch, M, N, *block)`` into contiguous ranges."""
    axis: int

    def is_row_shard(self, nbatch: int) -> bool:
        """Local. Whether ``axis`` is the row axis of a tensor with ``nbatch`` batch dims."""
        return self.axis == nbatch

    def is_col_shard(self, nbatch: int) -> bool:
        """Local. Whether ``axis`` is the column axis of a tensor with ``nbatch`` batch dims."""
        return self.axis == nbatch + 1


@dataclass(frozen=True)
class Shard(Placement):
    """Split dense batch dimension ``dim``; each rank holds whole matrices."""
    dim: int


def row_shard(nbatch: int = 0) -> SparseShard:
    """Local. ``SparseShard(axis=nbatch)``: the row axis of ``(*batch, M, N, *block)``."""
    return SparseShard(nbatch)


def col_shard(nbatch: int = 0) -> SparseShard:
    """Local. ``SparseShard(axis=nbatch + 1)``: the column axis."""
    return SparseShard(nbatch + 1)


@dataclass(frozen=True)
class DSparseSpec:
    """Metadata of a distributed sparse tensor.

    Attributes
    ----------
    placement : Placement
    comm : mpi4py.MPI.Comm
    global_shape : tuple
        ``(*batch, M, N, *block)`` of the whole (global) tensor.
    partition : slasolve.partition.Partition or None
        The renumbering applied by ``from_global`` (``perm``: new -> user index);
        ``None`` when the rows are in the user's numbering.
    offsets : tuple of int or None
        Ownership offsets (``size+1``) of the sharded axis, in block rows/cols.
    """
    placement: Placement
    comm: Any
    global_shape: Tuple[int, ...]
    partition: Optional[Any] = None
    offsets: Optional[Tuple[int, ...]] = field(default=None, repr=False)
