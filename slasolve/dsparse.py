"""DSparseTensor: one rank's SparseTensor plus a DSparseSpec.

Row-sharded tensors are laid out as PETSc's MPIAIJ: each rank owns the block rows
``[rstart, rend)`` and keeps its rows split into a *diagonal block* (owned
columns, local ids) and an *off-diagonal block* (ghost columns, compressed ids),
plus the global id of each ghost. The user-facing ``values`` are the local rows'
values in CSR order with sorted global columns. The two blocks are index sets
into them (patterns only): every product reads ``values`` as they are at call
time (no cached copy of the values that a ``.data`` write could leave stale),
and gradients reach ``values`` directly.
"""
from __future__ import annotations

import operator
import warnings
from typing import Any, Optional, Sequence, Tuple

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI

from ._comm import allreduce_int, check_collective, get_comm
from .collectives import AllreduceSum, ReplicatedInput
from .halo import HaloPlan
from .placement import DSparseSpec, Placement, SparseShard, row_shard, split_offsets
from .layout import RowLayout, RowShardMatVec, RowShardRMatVec
from .sparse import Pattern, SparseTensor
from .dtensor import dtensor_entry

__all__ = ["DSparseTensor", "split_offsets", "from_petsc"]

# torch's CPU BSR kernel (used for block products, no value gather) works; its "beta" notice is noise
warnings.filterwarnings("ignore", message="Sparse BSR tensor support is in beta state")


def _to_sparse_tensor(A) -> SparseTensor:
    if isinstance(A, SparseTensor):
        return A
    if sp.issparse(A):
        return SparseTensor.from_scipy(A)
    if isinstance(A, torch.Tensor) and A.layout in (torch.sparse_coo, torch.sparse_csr, torch.sparse_bsr):
        return SparseTensor.from_torch(A)
    raise TypeError(f"A must be a SparseTensor, a scipy.sparse matrix or a torch sparse tensor, "
                    f"got {type(A).__name__}")


def _sorted_csr(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape, block_shape):
    """Local. The rows as a SparseTensor sharing the caller's arrays when every row's columns
    are strictly increasing and in range and the values are finite (what ``from_coo`` would
    build, without its O(nnz) sort and copies); ``None`` otherwise."""
    if not (values.dtype.is_floating_point or values.dtype.is_complex):
        return None
    dev = values.device
    idx = indices.to(device=dev, dtype=torch.int64).contiguous()
    nnz, N = idx.numel(), shape[1]
    if nnz:
        if int(idx.min()) < 0 or int(idx.max()) >= N:
            return None
        if nnz > 1:
            ok = idx[1:] > idx[:-1]
            starts = indptr[1:-1].to(dev)
            ok[starts[(starts > 0) & (starts < nnz)] - 1] = True  # no order across rows
            if not bool(ok.all()):
                return None
        if not bool(torch.isfinite(values).all()):
            return None
    pattern = Pattern(indptr.to(dev).contiguous(), idx, shape[0], N)
    return SparseTensor._make(pattern, values, shape, len(block_shape))


class DSparseTensor:
    """A distributed sparse tensor: this rank's :class:`SparseTensor` plus a :class:`DSparseSpec`.

    Build with :meth:`from_local_rows` (scalable: each rank passes its own rows),
    :meth:`from_global` (small problems: one global matrix, distributed by a
    partitioner) or :func:`slasolve.from_petsc`. All constructors are collective.

    For a row shard, ``local`` holds the owned block rows ``[rstart, rend)``
    with *global* block-column indices; vectors are plain tensors holding the
    rank's owned rows, shape ``(n_local,)`` or ``(n_local, k)``.

    Examples
    --------
    Distribute a matrix given on rank 0 (``None`` elsewhere), then map global vectors
    to owned rows and back with :meth:`scatter` / :meth:`gather` (they apply the
    partition's renumbering; never slice a global vector by :attr:`row_range` when a
    partitioner was used). Runs unchanged under ``mpirun -n N``:

    >>> import scipy.sparse as sp, torch
    >>> from mpi4py import MPI
    >>> from slasolve import DSparseTensor
    >>> comm = MPI.COMM_WORLD
    >>> A_global = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(6, 6), format="csr")
    >>> A = DSparseTensor.from_global(A_global if comm.rank == 0 else None, comm)
    >>> A.global_shape
    (6, 6)
    >>> x_global = torch.arange(6.0, dtype=torch.float64) if comm.rank == 0 else None
    >>> x = A.scatter(x_global)             # this rank's owned rows
    >>> x.shape == (A.n_local,)
    True
    >>> A.gather(A @ x, root=None)          # the global product, on every rank
    tensor([-1.,  0.,  0.,  0.,  0.,  6.], dtype=torch.float64)
    """

    def __init__(self, local: SparseTensor, spec: DSparseSpec, *, _layout: Optional[RowLayout] = None):
        self._local = local
        self._spec = spec
        self._layout = _layout
        nbatch = len(local.batch_shape)
        if spec.placement.is_row_shard(nbatch) and _layout is None:
            offs = spec.offsets
            self._layout = RowLayout(spec.comm, local.pattern, offs[0], offs[1], local.block_shape)

    # -- metadata -------------------------------------------------------------
    @property
    def local(self) -> SparseTensor:
        """This rank's data (owned rows with global column ids, for a row shard)."""
        return self._local

    @property
    def spec(self) -> DSparseSpec:
        return self._spec

    @property
    def comm(self) -> MPI.Comm:
        return self._spec.comm

    @property
    def placement(self) -> Placement:
        return self._spec.placement

    @property
    def global_shape(self) -> Tuple[int, ...]:
        return self._spec.global_shape

    @property
    def values(self) -> torch.Tensor:
        return self._local.values

    @property
    def dtype(self) -> torch.dtype:
        return self._local.dtype

    @property
    def device(self) -> torch.device:
        return self._local.device

    @property
    def block_shape(self) -> Tuple[int, ...]:
        return self._local.block_shape

    @property
    def requires_grad(self) -> bool:
        return self._local.requires_grad

    @property
    def is_row_shard(self) -> bool:
        return self._layout is not None

    def _need_row_shard(self, what: str) -> RowLayout:
        if self._layout is None:
            raise TypeError(f"{what} needs a row-sharded DSparseTensor, this one is {self.placement}")
        return self._layout

    @property
    def row_range(self) -> Tuple[int, int]:
        """Owned scalar rows ``[start, end)`` (block rows times the block size)."""
        L = self._need_row_shard("row_range")
        return L.rstart * L.br, L.rend * L.br

    @property
    def col_range(self) -> Tuple[int, int]:
        """Owned scalar columns ``[start, end)``: the rows of ``x`` this rank holds."""
        L = self._need_row_shard("col_range")
        return L.cstart * L.bc, L.cend * L.bc

    @property
    def n_local(self) -> int:
        """Owned scalar rows."""
        a, b = self.row_range
        return b - a

    @property
    def diag(self) -> SparseTensor:
        """Diagonal block (owned columns, local ids), differentiable in ``values``."""
        L = self._need_row_shard("diag")
        return self._sub(L.diag, L.diag_pos)

    @property
    def offd(self) -> SparseTensor:
        """Off-diagonal block (ghost columns, compressed ids)."""
        L = self._need_row_shard("offd")
        return self._sub(L.offd, L.offd_pos)

    def _sub(self, pattern: Pattern, pos: torch.Tensor) -> SparseTensor:
        v = self._local.values[pos]
        return SparseTensor._make(pattern, v, (pattern.M, pattern.N) + self.block_shape, len(self.block_shape))

    @property
    def ghost_ids(self) -> torch.Tensor:
        """Global block-column ids of the ghost columns (sorted)."""
        return self._need_row_shard("ghost_ids").ghost_ids

    @property
    def halo(self) -> HaloPlan:
        return self._need_row_shard("halo").halo

    def __repr__(self) -> str:
        return (f"DSparseTensor(global_shape={self.global_shape}, placement={self.placement}, "
                f"local={self._local!r}, rank={self.comm.Get_rank()}/{self.comm.Get_size()})")

    # -- construction -----------------------------------------------------------
    @classmethod
    def from_local_rows(cls, indptr, indices, values, global_shape: Sequence[int],
                        comm: Optional[MPI.Comm] = None, *, block_shape: Tuple[int, ...] = (),
                        n_local_cols: Optional[int] = None, partition: Any = None) -> "DSparseTensor":
        """Collective. Build a row shard from the rows this rank owns (the scalable path).

        Parameters
        ----------
        indptr, indices, values
            CSR of this rank's owned (block) rows with *global* (block) column
            indices; duplicates are summed. ``values``: ``(nnz, *block)``.
        global_shape : (M, N[, br, bc])
            Identical on every rank. Ranks own consecutive row ranges in rank order.
        comm : MPI.Comm, optional
        n_local_cols : int, optional
            Owned columns (the rows of ``x`` this rank holds); default: the same
            as the owned rows for a square matrix, PETSc's split otherwise.

        Notes
        -----
        Memory per rank is O(local rows + ghosts + local nonzeros). When every row's
        columns are already strictly increasing, the arrays are kept as given (int64
        ``indptr``/``indices`` and ``values`` on their device are not copied, as
        ``scipy.sparse.csr_matrix`` keeps its arrays): do not modify them in place
        afterwards. Otherwise the rows are sorted and duplicates summed into new arrays.

        Examples
        --------
        Every rank builds only its own rows of the ``N x N`` tridiagonal matrix
        ``tridiag(-1, 2, -1)`` (rows ``lo..hi`` of the user's numbering, here an even
        split); vectors are then plain tensors of those rows:

        >>> import numpy as np, torch
        >>> from mpi4py import MPI
        >>> from slasolve import DSparseTensor
        >>> comm, N = MPI.COMM_WORLD, 8
        >>> lo, hi = N * comm.rank // comm.size, N * (comm.rank + 1) // comm.size
        >>> i = np.arange(lo, hi)
        >>> cols = np.stack([i - 1, i, i + 1], axis=1)           # sorted per row
        >>> keep = (cols >= 0) & (cols < N)
        >>> vals = np.broadcast_to([-1.0, 2.0, -1.0], cols.shape)[keep]
        >>> indptr = np.concatenate([[0], np.cumsum(keep.sum(1))])
        >>> A = DSparseTensor.from_local_rows(indptr, cols[keep], torch.tensor(vals), (N, N), comm)
        >>> A.row_range == (lo, hi)
        True
        >>> y = A @ torch.ones(hi - lo, dtype=torch.float64)    # owned rows of A @ 1
        >>> A.gather(y, root=None)
        tensor([1., 0., 0., 0., 0., 0., 0., 1.], dtype=torch.float64)
        """
        comm = get_comm(comm)
        err = None
        local = None
        info = None
        try:
            global_shape = tuple(int(s) for s in global_shape)
            block_shape = tuple(int(b) for b in block_shape)
            if len(global_shape) != 2 + len(block_shape) or (block_shape and global_shape[2:] != block_shape):
                raise ValueError(f"global_shape must be (M, N) + block_shape, got {global_shape}")
            if min(global_shape) < 0:
                raise ValueError(f"global_shape must not be negative, got {global_shape}")
            M, N = global_shape[:2]
            vals = values if isinstance(values, torch.Tensor) else torch.as_tensor(np.asarray(values))
            if not (vals.dtype.is_floating_point or vals.dtype.is_complex):
                raise TypeError(f"values must be a floating point (or complex) tensor, got dtype {vals.dtype}")
            ip = indptr if isinstance(indptr, torch.Tensor) else torch.as_tensor(np.asarray(indptr))
            idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(np.asarray(indices))
            for name, t in (("indptr", ip), ("indices", idx)):
                if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                    raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
            if ip.dim() != 1 or ip.numel() < 1:
                raise ValueError("indptr must be a non-empty 1-D array of n_local+1 row pointers")
            if idx.dim() != 1:
                raise ValueError(f"indices must be one-dimensional, got shape {tuple(idx.shape)}")
            n_loc = ip.numel() - 1
            ip64 = ip.to(torch.int64).cpu()
            if (n_loc and bool((ip64[1:] < ip64[:-1]).any())) or int(ip64[0]) != 0 \
                    or int(ip64[-1]) != idx.numel():
                raise ValueError("indptr must start at 0, be non-decreasing and end at len(indices)")
            if vals.dim() != 1 + len(block_shape) or tuple(vals.shape[1:]) != block_shape \
                    or vals.shape[0] != idx.numel():
                raise ValueError(f"values must have shape (nnz, *block_shape) = "
                                 f"{(idx.numel(),) + block_shape}, got {tuple(vals.shape)}")
            if n_local_cols is not None:
                n_local_cols = operator.index(n_local_cols)
                if n_local_cols < 0:
                    raise ValueError(f"n_local_cols must be >= 0, got {n_local_cols}")
            local = _sorted_csr(ip64, idx, vals, (n_loc, N) + block_shape, block_shape)
            if local is None:  # unsorted or duplicate columns (or an error to report): the COO path
                counts = ip64[1:] - ip64[:-1]
                rows = torch.repeat_interleave(torch.arange(n_loc), counts)
                local = SparseTensor.from_coo(rows, idx, vals, (n_loc, N) + block_shape, block_shape=block_shape)
            info = (global_shape, str(local.dtype), local.M, n_local_cols, local.device.type)
        except Exception as e:  # any failure must reach every rank, never leave one behind
            err = e
        check_collective(comm, err)
        # one Allgather settles everything the ranks must agree on
        allinfo = comm.allgather(info) if comm.Get_size() > 1 else [info]
        err = None
        shapes = {a[0] for a in allinfo}
        dtypes = {a[1] for a in allinfo}
        nrows = [a[2] for a in allinfo]
        ncols = [a[3] for a in allinfo]
        if len(shapes) > 1:
            err = ValueError(f"global_shape differs across ranks: {sorted(shapes)}")
        elif len(dtypes) > 1:
            err = TypeError(f"values dtype differs across ranks: {sorted(dtypes)}")
        elif sum(nrows) != global_shape[0]:
            err = ValueError(f"the ranks' local rows add up to {sum(nrows)}, but global_shape has "
                             f"M = {global_shape[0]} rows")
        elif len({a[4] for a in allinfo}) > 1:
            err = TypeError(f"values device type differs across ranks: {sorted({a[4] for a in allinfo})}")
        elif any(c is None for c in ncols) and any(c is not None for c in ncols):
            err = ValueError("n_local_cols must be given on every rank or on none")
        elif ncols[0] is not None and sum(ncols) != global_shape[1]:
            err = ValueError(f"n_local_cols add up to {sum(ncols)}, expected N = {global_shape[1]}")
        check_collective(comm, err)
        row_offsets = np.concatenate([[0], np.cumsum(nrows)]).astype(np.int64)
        if ncols[0] is None:
            col_offsets = row_offsets if global_shape[0] == global_shape[1] else \
                split_offsets(global_shape[1], comm.Get_size())
        else:
            col_offsets = np.concatenate([[0], np.cumsum(ncols)]).astype(np.int64)
        spec = DSparseSpec(row_shard(), comm, global_shape, partition,
                           (tuple(row_offsets.tolist()), tuple(col_offsets.tolist())))
        return cls(local, spec)

    @classmethod
    def from_global(cls, A, comm: Optional[MPI.Comm] = None, *, partition: Any = "contiguous",
                    coords=None, placement: Optional[Placement] = None, root: int = 0) -> "DSparseTensor":
        """Collective. Distribute a global matrix given on ``root`` (others may pass ``None``)
        or on every rank. For small and medium problems: ``root`` holds the whole matrix.

        Parameters
        ----------
        A : SparseTensor, scipy.sparse matrix or torch sparse tensor
        partition : str or Partition
            ``"contiguous"``, ``"metis"``, ``"rcb"``, ``"hilbert"`` (the last two need
            ``coords``), or a :class:`slasolve.partition.Partition`. Rows are renumbered
            so each rank owns a contiguous block; ``spec.partition`` keeps the permutation
            and :meth:`scatter` / :meth:`gather` apply it.
        coords : array (n, d), optional
            Coordinates of the (block) rows, for geometric partitioners.
        placement : Placement, optional
            ``row_shard()`` (default), ``col_shard()``, ``Replicated()`` or ``Shard(dim)``.
        """
        comm = get_comm(comm)
        rank, size = comm.Get_rank(), comm.Get_size()
        placement = row_shard() if placement is None else placement
        have = A is not None
        everywhere = (allreduce_int(comm, 1 if have else 0) == size) if size > 1 else have
        err = None
        S = None
        try:
            # arguments every rank can check (they must agree: combined below)
            if not isinstance(placement, Placement):
                raise TypeError(f"placement must be a Placement, got {placement!r}")
            placement.check_global(None)
            if not isinstance(root, int) or not 0 <= root < size:
                raise ValueError(f"root must be a rank of the communicator, got {root!r}")
            if rank == root or everywhere:
                if not have:
                    raise ValueError(f"A is None on the root rank {root}")
                S = _to_sparse_tensor(A).detach().to("cpu")
                placement.check_global(len(S.batch_shape))
        except Exception as e:
            err = e
        part_name = partition if isinstance(partition, str) else type(partition).__name__
        check_collective(comm, err, agree={"root": root, "placement": repr(placement), "partition": part_name,
                                           "coords given": coords is not None})
        if not placement.is_row_shard(0):  # every rank cuts its part out of the whole matrix
            if not everywhere:
                S = comm.bcast(S, root=root)
            local, offsets = placement.local_part(S, rank, size)
            return cls(local, DSparseSpec(placement, comm, S.shape, None, offsets))

        pieces = part = None
        if rank == root:
            try:
                part = cls._make_partition(S, size, partition, coords)
                pieces = cls._split_rows(S, part, size)
            except Exception as e:  # the partitioner may raise anything: never leave the others waiting
                err = e
        check_collective(comm, err if rank == root else None)
        if size > 1:
            part = comm.bcast(part, root=root)
            indptr, indices, values = comm.scatter(pieces, root=root)
            shape = comm.bcast(S.shape if rank == root else None, root=root)
        else:
            (indptr, indices, values), shape = pieces[0], S.shape
        return cls.from_local_rows(indptr, indices, values, shape, comm,
                                   block_shape=part["block"], partition=part["partition"])

    @staticmethod
    def _make_partition(S: SparseTensor, size: int, partition, coords):
        from . import partition as _partition
        M, N = S.M, S.N
        if isinstance(partition, str) and partition == "contiguous" and coords is None:
            p = None
        elif isinstance(partition, str):
            if M != N:
                raise ValueError("partition other than 'contiguous' needs a square matrix")
            graph = sp.csr_matrix((np.ones(S.nnz), S.indices.numpy(), S.indptr.numpy()), shape=(M, N))
            p = _partition.partition(graph, size, method=partition, coords=coords)
        elif isinstance(partition, _partition.Partition):
            p = partition
            if p.nparts != size or p.parts.shape[0] != M:
                raise ValueError(f"partition has {p.nparts} parts for {p.parts.shape[0]} rows; "
                                 f"expected {size} parts for {M} rows")
        else:
            raise TypeError(f"partition must be a method name or a Partition, got {type(partition).__name__}")
        return {"partition": p, "block": S.block_shape}

    @staticmethod
    def _split_rows(S: SparseTensor, part, size: int):
        p = part["partition"]
        if p is None:
            offsets = split_offsets(S.M, size)  # ranks beyond the rows own none (as PETSc)
            P = S
        else:
            offsets = np.asarray(p.offsets)
            iperm = torch.as_tensor(np.asarray(p.iperm), dtype=torch.int64)
            rows = iperm[S.row_indices()]
            cols = iperm[S.indices]
            P = SparseTensor.from_coo(rows, cols, S.values, S.shape, block_shape=S.block_shape)
        return SparseShard.split_rows(P, offsets)

    def with_values(self, values: torch.Tensor) -> "DSparseTensor":
        """Collective. Same pattern, layout, halo plan and PETSc Mat; new local values.

        ``values`` has the shape of :attr:`values` (``(nnz, *block)`` for a row
        shard). The check (shape, dtype, finite) and the agreement of dtype, device
        type and trailing shape across ranks ride on one small Allreduce, so a bad
        ``values`` on one rank, or float32 here and float64 there, raises on all.
        """
        err = None
        new = None
        agree = {"values": None}  # every rank passes a mapping: one code path in check_collective
        try:
            if not isinstance(values, torch.Tensor):
                values = torch.as_tensor(np.asarray(values))
            agree = {"values dtype": str(values.dtype), "values device": values.device.type,
                     "values dims": values.dim(),
                     "values trailing shape": tuple(values.shape[1:]) if self._layout is not None else None}
            if not (values.dtype.is_floating_point or values.dtype.is_complex):
                raise TypeError(f"values must be a floating point tensor, got dtype {values.dtype}")
            if self._layout is not None and tuple(values.shape) != tuple(self.values.shape):
                raise ValueError(f"values must have shape {tuple(self.values.shape)} "
                                 f"(this rank's nnz, *block), got {tuple(values.shape)}")
            new = self._local.with_values(values)
        except Exception as e:
            err = e
        check_collective(self.comm, err, agree=agree)
        return DSparseTensor(new, self._spec, _layout=self._layout)

    def _with_checked_values(self, values: torch.Tensor) -> "DSparseTensor":
        """Local. :meth:`with_values` without its checks or its Allreduce, for values the caller
        made in this row shard's shape and dtype and has checked (finite) in a collective check
        of its own: one reduction per assembly instead of two."""
        loc = self._local
        return DSparseTensor(SparseTensor._make(loc._pattern.to(values.device), values, loc._shape, loc._nblock),
                             self._spec, _layout=self._layout)

    def detach(self) -> "DSparseTensor":
        """Local. The same tensor with values detached from the autograd graph."""
        return DSparseTensor(self._local.detach(), self._spec, _layout=self._layout)

    def to(self, *args, **kwargs) -> "DSparseTensor":
        """Local. Cast / move the local values (like ``torch.Tensor.to``)."""
        return DSparseTensor(self._local.to(*args, **kwargs), self._spec, _layout=self._layout)

    # -- products -------------------------------------------------------------
    def _check_vec(self, x: torch.Tensor, n: int, what: str, check_dtype: bool = True) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{what} must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() not in (1, 2) or x.shape[0] != n:
            raise ValueError(f"{what} must hold this rank's {n} owned rows, shape ({n},) or ({n}, k); "
                             f"got {tuple(x.shape)}")
        if check_dtype and x.dtype != self.dtype:
            raise TypeError(f"dtype mismatch: matrix is {self.dtype}, {what} is {x.dtype}")

    def _checked(self, v, n: int, what: str, forward: bool) -> None:
        """Check a row-shard product's vector; a bad one still takes part in the halo
        exchange (poison messages), so the neighbours raise too instead of waiting."""
        try:
            self._check_vec(v, n, what)
        except (TypeError, ValueError) as e:
            halo = self._layout.halo
            if halo.n_ghost or halo.n_send:
                halo.finish(halo.start_forward(None, error=e) if forward else halo.start_reverse(None, error=e))
            raise

    @dtensor_entry("matvec")
    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Collective. ``dA @ x`` dispatched by placement; differentiable in values and ``x``.

        Row shard: ``x`` holds the owned columns' entries (``(n,)`` or ``(n, k)``),
        the result the owned rows. Column shard: ``x`` owned columns, result
        replicated (Allreduce). Replicated / batch shard: local products.

        Every product uses the values ``dA.values`` holds at call time (in-place
        and ``.data`` changes included). The check of ``x`` costs no extra
        communication: a rank whose ``x`` has the wrong shape or dtype still takes
        part in the halo exchange, sending poison messages, and raises; its
        neighbours find the poison (or a message whose dtype or number of columns
        differs from theirs, e.g. ``(n, 1)`` here and ``(n, 2)`` there, or a matrix
        cast with :meth:`to` on one rank) and raise ``ValueError`` naming it.
        Ranks that exchange nothing with it cannot know and return; the unhandled
        exception on the others then aborts the job under ``mpirun``
        (:func:`slasolve.abort_on_unhandled_exception`). Column shard: the check
        rides on one small Allreduce.
        """
        pl = self.placement
        if self._layout is not None:
            L = self._layout
            self._checked(x, (L.cend - L.cstart) * L.bc, "x", True)
            return RowShardMatVec.apply(self.values, x, L)
        if isinstance(pl, SparseShard):  # column shard
            err = None
            try:
                self._check_vec(x, self._local.matrix_shape[1], "x")
            except (TypeError, ValueError) as e:
                err = e
            agree = {"x columns": tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else None,
                     "dtype": str(self.dtype)}
            check_collective(self.comm, err, agree=agree)
            return AllreduceSum.apply(self._local.matvec(x), self.comm)
        return self._local.matvec(x)

    @dtensor_entry("matvec")
    def rmatvec(self, y: torch.Tensor) -> torch.Tensor:
        """Collective. ``dA.T @ y``; differentiable in values and ``y``.

        Row shard: ``y`` holds the owned rows, the result the owned columns
        (reverse halo exchange of the off-diagonal products). Column shard: ``y``
        replicated, result the owned columns. ``y`` is checked as ``x`` is in
        :meth:`matvec` (a bad ``y`` poisons the reverse exchange).
        """
        pl = self.placement
        if self._layout is not None:
            L = self._layout
            self._checked(y, (L.rend - L.rstart) * L.br, "y", False)
            return RowShardRMatVec.apply(self.values, y, L)
        if isinstance(pl, SparseShard):  # column shard: y replicated, result owned columns
            return self._local.T.matvec(ReplicatedInput.apply(y, self.comm))
        return self._local.T.matvec(y)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matvec(x)

    @property
    def T(self) -> "_Transposed":
        """Collective view: ``dA.T @ y`` computes the transposed product."""
        return _Transposed(self)

    def diagonal(self) -> torch.Tensor:
        """Local. The owned rows' scalar diagonal (square row shard)."""
        return self._need_row_shard("diagonal").diagonal(self.values)

    def diagonal_nonzero(self) -> bool:
        """Local. Whether every owned row's scalar main-diagonal entry is stored and nonzero
        (NaN counts as nonzero, as in ``diagonal() != 0``); square row shard. For scalar CPU
        tensors one gather of the stored diagonal entries (their positions found once per
        layout), else ``diagonal()``."""
        L = self._need_row_shard("diagonal")
        v = self.values
        if L.block or v.device.type != "cpu" or v.dtype not in (torch.float64, torch.float32):
            return bool((self.diagonal() != 0).all())

        def build():
            rows, pos = L._diagonal_entries()
            return pos.cpu().numpy(), int(rows.numel()) == L.rend - L.rstart
        pos, complete = L.cached("diagonal", "numpy", build)
        return complete and bool(v.detach().numpy().take(pos).all())

    # -- global vectors ---------------------------------------------------------
    def _row_perm(self):
        p = self._spec.partition
        if p is None:
            return None
        perm = torch.as_tensor(np.asarray(p.perm), dtype=torch.int64)
        br = self._layout.br if self._layout is not None else 1
        if br > 1:
            perm = (perm.view(-1, 1) * br + torch.arange(br)).reshape(-1)
        return perm

    def scatter(self, x_global: Optional[torch.Tensor], root: Optional[int] = 0) -> torch.Tensor:
        """Collective. This rank's owned rows of a global vector in the user's numbering.

        ``x_global`` (``(n,)`` or ``(n, k)``) is needed on ``root`` only, or on every
        rank with ``root=None``. Convenience for small problems and tests.
        """
        L = self._need_row_shard("scatter")
        comm = self.comm
        rank, size = comm.Get_rank(), comm.Get_size()
        offs = L.row_offsets * L.br
        have = x_global is not None
        err = None
        agree = {"root": root}
        if root is not None and not (isinstance(root, int) and 0 <= root < size):
            err = ValueError(f"root must be None or a rank of the communicator, got {root!r}")
        elif root is None or rank == root:
            if not have or not isinstance(x_global, torch.Tensor):
                err = TypeError("x_global must be a torch.Tensor" + ("" if root is None else f" on rank {root}"))
            elif x_global.dim() not in (1, 2) or x_global.shape[0] != offs[-1]:
                err = ValueError(f"x_global must have shape ({offs[-1]},) or ({offs[-1]}, k), "
                                 f"got {tuple(x_global.shape)}")
            elif root is None:  # every rank's piece must belong to one distributed vector
                agree.update(dtype=str(x_global.dtype), shape=tuple(x_global.shape))
        check_collective(comm, err, agree=agree)
        perm = self._row_perm()
        if root is None:
            xp = x_global if perm is None else x_global[perm]
            return xp[offs[rank]:offs[rank + 1]].clone()
        pieces = None
        if rank == root:
            xp = x_global if perm is None else x_global[perm]
            pieces = [xp[offs[r]:offs[r + 1]].clone() for r in range(size)]
        return comm.scatter(pieces, root=root)

    def gather(self, x_local: torch.Tensor, root: Optional[int] = 0) -> Optional[torch.Tensor]:
        """Collective. Assemble the global vector (user numbering) on ``root``
        (``None`` elsewhere), or on every rank with ``root=None``."""
        self._need_row_shard("gather")
        comm = self.comm
        err = None
        size = comm.Get_size()
        try:
            if root is not None and not (isinstance(root, int) and 0 <= root < size):
                raise ValueError(f"root must be None or a rank of the communicator, got {root!r}")
            self._check_vec(x_local, self.n_local, "x_local", check_dtype=False)
        except (TypeError, ValueError) as e:
            err = e
        ok = err is None
        check_collective(comm, err, agree={"root": root, "dtype": str(x_local.dtype) if ok else None,
                                           "columns": tuple(x_local.shape[1:]) if ok else None})
        parts = comm.allgather(x_local.detach().cpu()) if root is None else \
            comm.gather(x_local.detach().cpu(), root=root)
        if parts is None:
            return None
        xp = torch.cat(parts, 0)
        perm = self._row_perm()
        if perm is None:
            return xp
        out = torch.empty_like(xp)
        out[perm] = xp
        return out

    # -- PETSc -----------------------------------------------------------------
    def to_petsc(self, *, refill: bool = True, mat_type: Optional[str] = None):
        """Collective. A ``PETSc.Mat`` (MPIAIJ, MPIBAIJ for blocks) with the same ownership.

        The Mat is created once per pattern (and ``mat_type``) and cached; a tensor
        made by :meth:`with_values` gets the *same* Mat back, refilled in place with
        its values (no rebuild). ``mat_type="aij"`` gives block tensors as AIJ with
        the block size set (what GAMG needs).
        """
        from .petsc import to_petsc_mat
        return to_petsc_mat(self, refill=refill, mat_type=mat_type)

    def local_rows_csr(self) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local. ``(indptr, global column indices, values)`` of the owned rows."""
        return self._local.indptr, self._local.indices, self._local.values


class _Transposed:
    def __init__(self, A: DSparseTensor):
        self._A = A

    def __matmul__(self, y: torch.Tensor) -> torch.Tensor:
        return self._A.rmatvec(y)

    def matvec(self, y: torch.Tensor) -> torch.Tensor:
        return self._A.rmatvec(y)


def from_petsc(mat, *, dtype: torch.dtype = torch.float64):
    """Collective. A row-sharded DSparseTensor with ``mat``'s ownership and values.

    AIJ matrices give scalar tensors; BAIJ (block size > 1) give block tensors. Reads the
    Mat through its own methods (needs no import of PETSc here).
    """
    comm = mat.getComm().tompi4py()
    rstart, rend = mat.getOwnershipRange()
    cstart, cend = mat.getOwnershipRangeColumn()
    Mg, Ng = mat.getSize()
    bs = mat.getBlockSize()
    is_baij = "baij" in mat.getType()
    # convert into a NEW Mat: ``mat.convert("aij")`` without ``out`` converts in place
    # and would turn the caller's (cached) BAIJ Mat into an AIJ one
    src = mat.convert("aij", out=type(mat)()) if is_baij else mat
    indptr, indices, vals = src.getValuesCSR()
    if is_baij and bs > 1:
        m = rend - rstart
        C = sp.csr_matrix((vals, indices, indptr), shape=(m, Ng)).tobsr((bs, bs))
        C.sort_indices()
        out = DSparseTensor.from_local_rows(C.indptr, C.indices, torch.as_tensor(C.data, dtype=dtype),
                                            (Mg // bs, Ng // bs, bs, bs), comm, block_shape=(bs, bs),
                                            n_local_cols=(cend - cstart) // bs)
    else:
        out = DSparseTensor.from_local_rows(indptr, indices, torch.as_tensor(vals, dtype=dtype),
                                            (Mg, Ng), comm, n_local_cols=cend - cstart)
    return out
