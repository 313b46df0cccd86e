"""Placements and the distributed spec, mirroring ``torch.distributed.tensor``.

* ``Replicated()``: every rank holds the whole matrix.
* ``SparseShard(axis)``: the sparse axis ``axis`` (counted in the full
  ``(*batch, M, N, *block)`` shape) is split into contiguous ranges; ``axis ==
  len(batch)`` is a row shard (PETSc MPIAIJ layout), the next one a column shard.
* ``Shard(dim)``: the dense batch dimension ``dim`` is split; each rank holds
  whole matrices of its part of the batch.

Each placement carries its own split, as ``torch.distributed.tensor``'s ``Shard`` carries
``_split_tensor``: :meth:`Placement.check_global` says whether a global matrix can take it
and :meth:`Placement.local_part` cuts this rank's part out of it; ``SparseShard`` also
splits a row-renumbered matrix into every rank's rows (:meth:`SparseShard.split_rows`) for
a scatter from one rank. :meth:`Placement.to_torch` is the matching ``DTensor`` placement of
the dense vectors.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import numpy as np

__all__ = ["Placement", "Replicated", "SparseShard", "Shard", "DSparseSpec", "row_shard", "col_shard",
           "split_offsets"]

Offsets = Optional[Tuple[Tuple[int, ...], ...]]


def split_offsets(n: int, size: int) -> np.ndarray:
    """Local. PETSc's PETSC_DECIDE split: the first n % size ranks get one more."""
    counts = np.full(size, n // size, dtype=np.int64)
    counts[: n % size] += 1
    return np.concatenate([[0], np.cumsum(counts)])


class Placement:
    """Local. Base class of placements."""

    def is_row_shard(self, nbatch: int) -> bool:
        """Local. Whether this placement splits the rows of a tensor with ``nbatch`` batch dims."""
        return False

    def is_col_shard(self, nbatch: int) -> bool:
        """Local. Whether this placement splits the columns of a tensor with ``nbatch`` batch dims."""
        return False

    def check_global(self, nbatch: Optional[int]) -> None:
        """Local. Raise ``ValueError`` if a global matrix with ``nbatch`` batch dims cannot be
        distributed this way (``nbatch=None``: only the checks that need no matrix)."""

    def local_part(self, S, rank: int, size: int) -> Tuple[Any, Offsets]:
        """Local. ``(this rank's part, ownership offsets)`` of the global ``SparseTensor`` ``S``
        that every rank holds (the offsets as ``DSparseSpec.offsets``)."""
        raise NotImplementedError(f"{self} has no local part of a global matrix")

    def to_torch(self, nbatch: int):
        """Local. The ``torch.distributed.tensor`` placement of a dense ``(*batch, n)`` vector that
        goes with this placement of a ``(*batch, M, N)`` operator with ``nbatch`` batch dims."""
        raise NotImplementedError(f"{self} has no DTensor placement")


@dataclass(frozen=True)
class Replicated(Placement):
    """Every rank holds the full matrix."""

    def local_part(self, S, rank: int, size: int) -> Tuple[Any, Offsets]:
        """Local. The whole matrix; no offsets."""
        return S, None

    def to_torch(self, nbatch: int):
        """Local. ``Replicate()``."""
        from torch.distributed.tensor import Replicate
        return Replicate()


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

    def check_global(self, nbatch: Optional[int]) -> None:
        """Local. Rows (axis 0) or columns (axis 1) of an unbatched matrix only."""
        if nbatch is None and self.axis not in (0, 1):
            raise ValueError(f"SparseShard axis must be 0 (rows) or 1 (columns) for an unbatched "
                             f"matrix, got {self.axis}")
        if nbatch:
            raise ValueError("row/column shards need an unbatched matrix; use Shard(dim) for batches")

    def local_part(self, S, rank: int, size: int) -> Tuple[Any, Offsets]:
        """Local. A column shard's owned columns ``[a, b)`` of every row, renumbered from 0;
        offsets ``(row split, column split)``. (A row shard is scattered: :meth:`split_rows`.)"""
        if not self.is_col_shard(0):
            raise NotImplementedError("a row shard of a global matrix is scattered from one rank: split_rows")
        offsets = split_offsets(S.N, size)
        a, b = int(offsets[rank]), int(offsets[rank + 1])
        cols = S.indices
        keep = (cols >= a) & (cols < b)
        local = type(S).from_coo(S.row_indices()[keep], cols[keep] - a, S.values[keep],
                                 (S.M, b - a) + S.block_shape, block_shape=S.block_shape)
        return local, (tuple(split_offsets(S.M, size).tolist()), tuple(offsets.tolist()))

    @staticmethod
    def split_rows(S, offsets: np.ndarray) -> List[Tuple[Any, Any, Any]]:
        """Local. Every rank's rows ``[offsets[r], offsets[r+1])`` of the CSR ``SparseTensor`` ``S``
        as ``(indptr, global column indices, values)``: the pieces a root scatters."""
        ip = S.indptr
        out = []
        for r in range(len(offsets) - 1):  # loop over ranks, not rows
            a, b = int(offsets[r]), int(offsets[r + 1])
            lo, hi = int(ip[a]), int(ip[b])
            out.append(((ip[a:b + 1] - lo).clone(), S.indices[lo:hi].clone(), S.values[lo:hi].clone()))
        return out

    def to_torch(self, nbatch: int):
        """Local. A row shard's vectors are ``Shard(nbatch)``; a column shard has none (its
        products are replicated): ValueError."""
        from torch.distributed.tensor import Shard as TorchShard
        if self.is_row_shard(nbatch):
            return TorchShard(nbatch)
        raise ValueError(f"{self} (a column shard) has no DTensor placement: dense vectors of its "
                         f"products are replicated (Replicate()) or row-sharded (Shard({nbatch}))")


@dataclass(frozen=True)
class Shard(Placement):
    """Split dense batch dimension ``dim``; each rank holds whole matrices."""
    dim: int

    def check_global(self, nbatch: Optional[int]) -> None:
        """Local. ``dim`` must be a batch dimension of the matrix."""
        if nbatch is not None and not 0 <= self.dim < nbatch:
            raise ValueError(f"Shard(dim={self.dim}) needs a batch dimension; the matrix has {nbatch}")

    def local_part(self, S, rank: int, size: int) -> Tuple[Any, Offsets]:
        """Local. The matrices ``[a, b)`` of batch dimension ``dim``; offsets ``(batch split,)``."""
        offsets = split_offsets(S.batch_shape[self.dim], size)
        a, b = int(offsets[rank]), int(offsets[rank + 1])
        return S.with_values(S.values.narrow(self.dim, a, b - a).clone()), (tuple(offsets.tolist()),)

    def to_torch(self, nbatch: int):
        """Local. ``Shard(dim)`` of the batch dimension."""
        from torch.distributed.tensor import Shard as TorchShard
        if not 0 <= self.dim < nbatch:
            raise ValueError(f"{self} is not a batch dimension of {nbatch} batch dims")
        return TorchShard(self.dim)


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
