"""PyTorch ``DTensor`` interop: distributed solves inside distributed PyTorch models.

* :func:`device_mesh`: a 1-D ``DeviceMesh`` over the processes of an mpi4py communicator,
  initialising ``torch.distributed`` from the MPI rank and size when nothing has (no
  ``torchrun``): gloo on CPU, NCCL (plus gloo for CPU tensors) where CUDA is present.
* :func:`to_dtensor` / :func:`from_dtensor`: a vector ``(n_local,)`` or block
  ``(n_local, k)`` of owned rows to a ``DTensor`` and back.
* The public solvers and products (``DSparseTensor`` ``@`` / ``matvec`` / ``rmatvec``,
  :func:`slasolve.solve`, :func:`slasolve.spsolve`, :func:`slasolve.eigsh`,
  :func:`slasolve.nonlinear_solve`) accept ``DTensor`` vectors and then return
  ``DTensor`` results (:func:`dtensor_entry`); ``solve``, ``spsolve``, ``eigsh`` and
  ``nonlinear_solve`` of this module always return ``DTensor`` results.

Layouts. slasolve's row shards are contiguous ranges of unequal length (PETSc's split, a
mesh partition). ``DTensor``'s ``Shard(0)`` is ``torch.chunk``'s split: every rank
``ceil(n / size)`` rows, the last ones fewer or none, and its collectives
(``full_tensor``, ``redistribute``, FSDP) assume exactly that split -- a ``DTensor`` made
by ``DTensor.from_local(..., shape=...)`` from other row counts gives wrong results there
(torch 2.13). So the conversions move the rows between the two splits (one
``MPI_Alltoallv`` with each neighbouring range, nothing when they coincide) and, when a
partitioner renumbered the rows (``DSparseSpec.partition``), into the user's numbering,
the one :meth:`DSparseTensor.scatter` and :meth:`DSparseTensor.gather` use: entry ``i``
of a ``DTensor`` is global row ``i`` as the user numbers it. The moves are autograd
functions (the backward moves the gradient back), so gradients cross the boundary both
ways; :func:`shard_offsets` gives ``DTensor``'s split, for building operators whose rows
already match it (then nothing moves).

Placements (:func:`to_torch_placement`, :func:`from_torch_placement`): slasolve's row
shard is ``Shard(nbatch)`` (the row dimension of the dense ``(*batch, n)`` vector), its
``Replicated()`` is ``Replicate()``, its batch ``Shard(d)`` is ``Shard(d)``. A column
shard has no dense counterpart, nor has ``Partial`` or ``_StridedShard`` a slasolve one:
they raise ``ValueError``. :func:`from_dtensor` accepts ``Shard(0)``, ``Replicate()``
and ``Partial()`` (reduced first) on a 1-D mesh whose ranks are the communicator's.

Nothing here needs PETSc.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
import torch
from mpi4py import MPI

from ._comm import check_collective, get_comm
from .collectives import LinearExchange

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import Placement as TorchPlacement

    from .placement import Placement

__all__ = ["device_mesh", "to_dtensor", "from_dtensor", "is_dtensor", "shard_offsets", "to_torch_placement",
           "from_torch_placement", "dtensor_entry", "solve", "spsolve", "eigsh", "nonlinear_solve"]

#: row-move plans kept per operator layout (one per mesh size and rows/columns)
PLAN_CACHE_SIZE = 4

#: seconds the ranks wait for each other at the rendezvous of ``torch.distributed`` (the process
#: group's collectives keep torch's own timeout)
RENDEZVOUS_TIMEOUT = 120.0

_MESHES: dict = {}       # (comm handle, device type) -> DeviceMesh
_MESH_COMMS: dict = {}   # id(DeviceMesh) -> (DeviceMesh, mpi4py communicator of the same processes)


# -- process group and mesh ------------------------------------------------------------------

def _dtensor_api():
    """Local. ``torch.distributed.tensor`` (ImportError, saying so, on builds without it)."""
    import torch.distributed as dist
    if not dist.is_available():
        raise ImportError("this torch build has no torch.distributed (DTensor interop needs it)")
    import torch.distributed.tensor as dt
    return dt


def device_mesh(comm: Optional[MPI.Comm] = None, *, device_type: Optional[str] = None,
                backend: Optional[str] = None) -> "DeviceMesh":
    """Collective. A 1-D ``DeviceMesh`` over the processes of ``comm`` (mesh coordinate =
    MPI rank), made once per communicator and device type and then cached.

    When ``torch.distributed`` is not initialised, it is, here, from ``comm``'s rank and size
    (no ``torchrun`` needed; ``comm`` then is torch's world): with ``MASTER_ADDR`` and
    ``MASTER_PORT`` in the environment by ``env://``, else through a ``TCPStore`` on the
    loopback address whose port rank 0 picks and broadcasts over MPI -- which needs every
    rank on one host (ranks on several hosts without ``MASTER_ADDR`` raise ValueError). When
    it is initialised already (``torchrun``, or your own ``init_process_group``), its world
    must have ``comm``'s size, else ValueError on every rank.

    Parameters
    ----------
    comm : mpi4py.MPI.Comm, optional
        Default ``MPI.COMM_WORLD``.
    device_type : {"cpu", "cuda"}, optional
        Default ``"cuda"`` when CUDA is available, else ``"cpu"``. With CUDA each process
        uses device ``node-local rank % device_count``.
    backend : str, optional
        Process-group backend when this call initialises it. Default ``"gloo"`` on CPU,
        ``"cpu:gloo,cuda:nccl"`` with CUDA.
    """
    comm = get_comm(comm)
    import torch.distributed as dist
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    key = (comm.py2f(), comm.Get_size(), device_type)
    mesh = _MESHES.get(key)
    if mesh is not None:
        return mesh
    err = None
    if not dist.is_available():
        err = ImportError("this torch build has no torch.distributed (DTensor interop needs it)")
    elif device_type not in ("cpu", "cuda"):
        err = ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
    elif device_type == "cuda" and not torch.cuda.is_available():
        err = ValueError("device_type='cuda' but torch sees no CUDA device")
    elif dist.is_initialized() and dist.get_world_size() != comm.Get_size():
        err = ValueError(f"torch.distributed is already initialised with a world of {dist.get_world_size()} "
                         f"processes, but the communicator has {comm.Get_size()}: a DeviceMesh must cover the "
                         f"communicator's processes (use a communicator of the same processes, or initialise "
                         f"torch.distributed with world_size={comm.Get_size()})")
    check_collective(comm, err, agree={"device_type": device_type, "backend": backend})
    if not dist.is_initialized():
        if device_type == "cuda":  # (an existing group keeps the device its owner chose)
            local = comm.Split_type(MPI.COMM_TYPE_SHARED)
            torch.cuda.set_device(local.Get_rank() % torch.cuda.device_count())
            local.Free()
        _init_process_group(comm, backend or ("cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"))
    from torch.distributed.device_mesh import DeviceMesh
    torch_ranks = comm.allgather(dist.get_rank())
    mesh = DeviceMesh(device_type, torch_ranks)
    _MESHES[key] = mesh
    _MESH_COMMS[id(mesh)] = (mesh, comm)
    return mesh


def _init_process_group(comm: MPI.Comm, backend: str) -> None:
    """Collective. ``init_process_group`` with ``comm``'s rank and size (see :func:`device_mesh`)."""
    import datetime

    import torch.distributed as dist
    rank, size = comm.Get_rank(), comm.Get_size()
    timeout = datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT)
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=size)
        return
    hosts = comm.allgather(MPI.Get_processor_name())
    err = None
    if len(set(hosts)) > 1:
        err = ValueError(f"the ranks run on {len(set(hosts))} hosts: set MASTER_ADDR and MASTER_PORT (an address "
                         f"and port of rank 0's host that every rank can reach) or initialise torch.distributed "
                         f"yourself before slasolve.dtensor.device_mesh")
    check_collective(comm, err)
    store, port, err = None, None, None
    if rank == 0:
        try:
            store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except Exception as e:  # noqa: BLE001 - re-raised on every rank
            err = RuntimeError(f"torch.distributed rendezvous: cannot open a TCPStore on 127.0.0.1: {e}")
    check_collective(comm, err)
    port = comm.bcast(port, root=0)
    if rank != 0:
        try:
            store = dist.TCPStore("127.0.0.1", port, size, False, timeout=timeout)
        except Exception as e:  # noqa: BLE001 - re-raised on every rank
            err = RuntimeError(f"torch.distributed rendezvous: cannot reach rank 0's TCPStore on 127.0.0.1:{port}: "
                               f"{e}")
    check_collective(comm, err)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size)


def _mesh_comm(mesh) -> MPI.Comm:
    """Local. The mpi4py communicator of ``mesh``'s processes: the one :func:`device_mesh` made
    it for, else ``COMM_WORLD`` for a 1-D mesh of every torch rank in MPI rank order."""
    entry = _MESH_COMMS.get(id(mesh))
    if entry is not None and entry[0] is mesh:
        return entry[1]
    import torch.distributed as dist
    world = MPI.COMM_WORLD
    ranks = mesh.mesh.flatten().tolist()
    if mesh.ndim == 1 and dist.get_world_size() == world.Get_size() and dist.get_rank() == world.Get_rank() \
            and ranks == list(range(world.Get_size())):
        return world
    raise ValueError("this DeviceMesh is not one slasolve can map to an MPI communicator: use "
                     "slasolve.dtensor.device_mesh(comm), or a 1-D mesh of every torch rank in MPI rank order "
                     "(torch rank = COMM_WORLD rank)")


# -- layouts ----------------------------------------------------------------------------------

def shard_offsets(n: int, size: int) -> np.ndarray:
    """Local. ``(size+1,)`` row offsets of ``DTensor``'s ``Shard(0)`` of ``n`` rows over ``size``
    ranks (``torch.chunk``: ``ceil(n / size)`` rows each, the last ranks fewer or none)."""
    n, size = int(n), int(size)
    chunk = -(-n // size) if size else 0
    return np.minimum(np.arange(size + 1, dtype=np.int64) * chunk, n)


def is_dtensor(x: Any) -> bool:
    """Local. Whether ``x`` is a ``torch.distributed.tensor.DTensor`` (without importing it)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(x, mod.DTensor)


class _Layout:
    """Local. Where the rows of a slasolve vector live: ``comm``, scalar row offsets (``size+1``)
    and, when a partitioner renumbered them, ``perm`` (slasolve row -> user row, global; made on
    first use by ``perm_fn``). ``owner``: the operator's row layout, whose cache keeps the plans."""

    def __init__(self, comm: MPI.Comm, offsets, perm_fn: Optional[Callable[[], np.ndarray]] = None, owner=None):
        self.comm = comm
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.perm_fn = perm_fn
        self.owner = owner
        self._perm = None

    def on(self, comm: MPI.Comm) -> "_Layout":
        """Local. The same layout over ``comm`` (the DTensor mesh's processes)."""
        out = _Layout(comm, self.offsets, self.perm_fn, self.owner)
        out._perm = self._perm
        return out

    @property
    def renumbered(self) -> bool:
        return self.perm_fn is not None

    @property
    def perm(self) -> Optional[np.ndarray]:
        if self._perm is None and self.perm_fn is not None:
            self._perm = self.perm_fn()
        return self._perm

    @property
    def n(self) -> int:
        return int(self.offsets[-1])

    @property
    def size(self) -> int:
        return int(self.offsets.shape[0]) - 1

    @property
    def n_local(self) -> int:
        r = self.comm.Get_rank()
        return int(self.offsets[r + 1] - self.offsets[r])

    def cached(self, key, build: Callable[[], Any]):
        """Collective when ``build`` is. ``build()``, kept in the operator's layout cache."""
        if self.owner is None:
            return build()
        return self.owner.cached("dtensor_plans", key, build, PLAN_CACHE_SIZE)


def _is_dsparse(x) -> bool:
    """Local. Whether ``x`` is a ``DSparseTensor`` (by its interface: this module is imported by
    ``slasolve.dsparse``, so it cannot import it)."""
    return hasattr(x, "spec") and hasattr(x, "placement") and hasattr(x, "is_row_shard")


def _layout_of(like, axis: str = "rows") -> _Layout:
    """Local. The :class:`_Layout` of ``like``'s rows or columns: a row-shard ``DSparseTensor``,
    ownership offsets, or a local operator (one rank)."""
    if isinstance(like, (np.ndarray, list, tuple)):  # ownership offsets over the DTensor's processes
        return _Layout(None, np.asarray(like, dtype=np.int64))
    if _is_dsparse(like):
        L = like._layout
        if L is not None:
            offs, b = (L.row_offsets, L.br) if axis == "rows" else (L.col_offsets, L.bc)
            perm_fn = None
            if like.spec.partition is not None:
                perm_fn = lambda: L.cached("dtensor_plans", ("perm", axis),  # noqa: E731
                                           lambda: like._row_perm().numpy(), PLAN_CACHE_SIZE)
            return _Layout(like.comm, offs * b, perm_fn, L)
        raise ValueError(f"a {like.placement} DSparseTensor has no row layout to map a DTensor onto")
    shape = getattr(like, "shape", None)
    if shape is None or len(shape) < 2:
        raise TypeError(f"like must be a DSparseTensor, ownership offsets or a local sparse operator, "
                        f"got {type(like).__name__}")
    return _Layout(MPI.COMM_SELF, [0, int(shape[0] if axis == "rows" else shape[1])])


class _RowPlan:
    """Collective (constructor). Which rows go where between a slasolve layout and the ``DTensor``
    ``Shard(0)`` split: ``send_counts`` / ``recv_counts`` per rank; ``send_order`` (local rows in
    sending order) and ``recv_pos`` (where received rows land) when rows are renumbered, ``None``
    when the order is kept (contiguous ranges); ``identity`` when nothing moves."""

    def __init__(self, layout: _Layout, dst: np.ndarray):
        comm, src = layout.comm, layout.offsets
        r, size = comm.Get_rank(), comm.Get_size()
        self.n_src = int(src[r + 1] - src[r])
        self.n_dst = int(dst[r + 1] - dst[r])
        self.send_order = self.recv_pos = None
        if not layout.renumbered:
            self.identity = bool(np.array_equal(src, dst))
            lo, hi = src[r], src[r + 1]
            self.send_counts = np.maximum(np.minimum(hi, dst[1:]) - np.maximum(lo, dst[:-1]), 0)
            self.recv_counts = np.maximum(np.minimum(dst[r + 1], src[1:]) - np.maximum(dst[r], src[:-1]), 0)
            return
        self.identity = False
        user = np.asarray(layout.perm[src[r]:src[r + 1]], dtype=np.int64)
        owner = np.searchsorted(dst, user, side="right") - 1
        self.send_order = np.argsort(owner, kind="stable")
        self.send_counts = np.bincount(owner, minlength=size).astype(np.int64)
        self.recv_counts = np.asarray(comm.alltoall(self.send_counts.tolist()), dtype=np.int64)
        pos = (user - dst[owner])[self.send_order]
        recv = np.empty(int(self.recv_counts.sum()), dtype=np.int64)
        _alltoallv(comm, pos.reshape(-1, 1), self.send_counts, recv.reshape(-1, 1), self.recv_counts)
        self.recv_pos = recv


_ROW_TYPES: dict = {}


def _alltoallv(comm, send: np.ndarray, send_counts, recv: np.ndarray, recv_counts) -> None:
    """Collective. ``MPI_Alltoallv`` of whole rows (C-contiguous 2-D arrays, counts in rows)."""
    nbytes = send.dtype.itemsize * int(np.prod(send.shape[1:]))
    if nbytes == 0:
        return
    t = _ROW_TYPES.get(nbytes)
    if t is None:
        t = MPI.BYTE.Create_contiguous(nbytes).Commit()
        _ROW_TYPES[nbytes] = t
    sc = np.asarray(send_counts, dtype=np.int64)
    rc = np.asarray(recv_counts, dtype=np.int64)
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
    sbuf = send.view(np.uint8).reshape(-1)
    rbuf = recv.view(np.uint8).reshape(-1)
    comm.Alltoallv([sbuf, (sc.astype(np.int32), sd.astype(np.int32)), t],
                   [rbuf, (rc.astype(np.int32), rd.astype(np.int32)), t])


def _move(plan: _RowPlan, comm, x: torch.Tensor, reverse: bool) -> torch.Tensor:
    """Collective. ``x`` (local rows) moved by ``plan`` (slasolve -> DTensor split, or back)."""
    if plan.identity:
        return x
    n_out = plan.n_src if reverse else plan.n_dst
    sc, rc = (plan.recv_counts, plan.send_counts) if reverse else (plan.send_counts, plan.recv_counts)
    trail = tuple(x.shape[1:])
    xs = x.detach().to("cpu").contiguous()
    if reverse and plan.recv_pos is not None:
        xs = xs[torch.from_numpy(plan.recv_pos)]
    elif not reverse and plan.send_order is not None:
        xs = xs[torch.from_numpy(plan.send_order)]
    send = xs.reshape(xs.shape[0], -1).numpy()
    recv = np.empty((n_out, send.shape[1]), dtype=send.dtype)
    _alltoallv(comm, send, sc, recv, rc)
    out = torch.from_numpy(recv).reshape((n_out,) + trail)
    if reverse and plan.send_order is not None:
        y = torch.empty_like(out)
        y[torch.from_numpy(plan.send_order)] = out
        out = y
    elif not reverse and plan.recv_pos is not None:
        y = torch.empty_like(out)
        y[torch.from_numpy(plan.recv_pos)] = out
        out = y
    return out.to(x.device)


def _moved(x: torch.Tensor, plan: _RowPlan, comm, reverse: bool) -> torch.Tensor:
    """Collective. :func:`_move`, differentiable: the backward moves the gradient the other way
    (a permutation: its adjoint is its inverse)."""
    return LinearExchange.apply(x, lambda t: _move(plan, comm, t, reverse),
                                lambda g: _move(plan, comm, g, not reverse))


def _plan(layout: _Layout, size: int) -> _RowPlan:
    """Collective (first call per layout). The :class:`_RowPlan` of ``layout`` (cached with the
    operator's layout)."""
    key = (layout.comm.py2f(), size, layout.offsets.tobytes(), layout.renumbered)
    return layout.cached(key, lambda: _RowPlan(layout, shard_offsets(layout.n, size)))


def _vector_layout(x: torch.Tensor, comm: MPI.Comm) -> _Layout:
    """Collective. The layout of a vector whose rows are this rank's ``x.shape[0]`` (rank order)."""
    counts = np.asarray(comm.allgather(int(x.shape[0])), dtype=np.int64)
    return _Layout(comm, np.concatenate([[0], np.cumsum(counts)]))


# -- conversions --------------------------------------------------------------------------------

def to_dtensor(x: torch.Tensor, like: Any = None, *, mesh: Optional["DeviceMesh"] = None,
               placement: Optional["TorchPlacement"] = None, axis: str = "rows") -> "DTensor":
    """Collective. A ``DTensor`` of the distributed vector ``(n_local,)`` or block ``(n_local, k)``
    whose owned rows this rank holds in ``x``; differentiable (gradients flow back to ``x``).

    Parameters
    ----------
    x : torch.Tensor
        This rank's rows.
    like : DSparseTensor, local operator or sequence of int, optional
        The operator whose rows (``axis="rows"``) or columns (``axis="cols"``) ``x`` is laid out
        as; rows renumbered by its partitioner go back to the user's numbering. Or the
        ``(size+1,)`` ownership offsets of ``x``'s rows (e.g. a mesh's cells). ``None``: ``x``'s
        rows follow each other in rank order (one Allgather of the row counts).
    mesh : DeviceMesh, optional
        Default ``device_mesh(comm)`` of ``like``'s (or ``COMM_WORLD``'s) processes.
    placement : torch ``Shard(0)`` (default) or ``Replicate()``
        ``Replicate()`` gathers the whole vector on every rank (small vectors only).
    """
    dtm = _dtensor_api()
    comm = like.comm if hasattr(like, "comm") and hasattr(like, "placement") else None
    if mesh is None:
        mesh = device_mesh(get_comm(comm) if like is not None and comm is not None else MPI.COMM_WORLD)
    mcomm = _mesh_comm(mesh)
    err = None
    if not isinstance(x, torch.Tensor) or is_dtensor(x):
        err = TypeError(f"x must be a local torch.Tensor, got {type(x).__name__}")
    elif x.dim() not in (1, 2):
        err = ValueError(f"x must be a vector (n_local,) or a block (n_local, k), got shape {tuple(x.shape)}")
    placement = dtm.Shard(0) if placement is None else placement
    if not (isinstance(placement, dtm.Replicate) or (type(placement) is dtm.Shard and placement.dim == 0)):
        err = err or ValueError(f"to_dtensor makes Shard(0) or Replicate() DTensors, got {placement}")
    if like is None:
        layout = None
    else:
        try:
            layout = _layout_of(like, axis)
            if layout.size != mcomm.Get_size():
                raise ValueError(f"the mesh has {mcomm.Get_size()} processes but the layout of like "
                                 f"{layout.size}")
            layout = layout.on(mcomm)
            if err is None and x.shape[0] != layout.n_local:
                raise ValueError(f"x has {x.shape[0]} rows, but this rank owns {layout.n_local} {axis} of like")
        except (TypeError, ValueError) as e:
            err = err or e
    check_collective(mcomm, err, agree={"columns": tuple(x.shape[1:]) if err is None else None,
                                        "dtype": str(x.dtype) if err is None else None, "placement": repr(placement)})
    if layout is None:
        layout = _vector_layout(x, mcomm)
    return _wrap(x, layout, mesh, mcomm, placement)


def _wrap(x: torch.Tensor, layout: _Layout, mesh, mcomm: MPI.Comm, placement) -> "DTensor":
    """Collective. :func:`to_dtensor` without the checks, for rows whose layout is known (a solver's
    result): moved to DTensor's split when it differs, wrapped, replicated on request."""
    dtm = _dtensor_api()
    size = mcomm.Get_size()
    plan = _plan(layout, size)
    local = x if plan.identity else _moved(x, plan, mcomm, False)
    n = layout.n
    shape = torch.Size((n,) + tuple(x.shape[1:]))
    stride = (int(np.prod(shape[1:])) if len(shape) > 1 else 1,) + ((1,) if len(shape) > 1 else ())
    out = dtm.DTensor.from_local(local, mesh, [dtm.Shard(0)], shape=shape, stride=stride)
    if isinstance(placement, dtm.Replicate):
        out = out.redistribute(mesh, [dtm.Replicate()])
    return out


def from_dtensor(x: "DTensor", like: Any = None, *, axis: str = "rows") -> torch.Tensor:
    """Collective. This rank's owned rows of the ``DTensor`` ``x`` (a vector or ``(n, k)`` block);
    differentiable (gradients flow back to ``x`` with its placement).

    ``like``: the operator whose rows (``axis="rows"``) or columns (``axis="cols"``) the result
    is laid out as (in its partitioner's numbering when it has one), or ``(size+1,)`` ownership
    offsets; ``None``: ``DTensor``'s own
    ``Shard(0)`` split (:func:`shard_offsets`). ``x`` must live on a 1-D mesh of the operator's
    processes with placement ``Shard(0)``, ``Replicate()`` or ``Partial()`` (reduced to
    ``Shard(0)`` first); anything else raises ValueError.
    """
    dtm = _dtensor_api()
    if not is_dtensor(x):
        raise TypeError(f"x must be a DTensor, got {type(x).__name__}")
    mesh = x.device_mesh
    mcomm = _mesh_comm(mesh)
    err = None
    pl = tuple(x.placements)
    if mesh.ndim != 1:
        err = ValueError(f"slasolve maps DTensors on a 1-D DeviceMesh only, got a {mesh.ndim}-D mesh")
    elif x.dim() not in (1, 2):
        err = ValueError(f"x must be a vector (n,) or a block (n, k), got shape {tuple(x.shape)}")
    elif not (isinstance(pl[0], (dtm.Replicate, dtm.Partial)) or (type(pl[0]) is dtm.Shard and pl[0].dim == 0)):
        err = ValueError(f"placement {pl[0]} has no slasolve counterpart: a vector's rows are sharded (Shard(0)) "
                         f"or replicated (Replicate()); redistribute first, e.g. x.redistribute(mesh, [Shard(0)])")
    layout = None
    if err is None and like is not None:
        try:
            layout = _layout_of(like, axis)
            if layout.size != mcomm.Get_size():
                raise ValueError(f"the DTensor's mesh has {mcomm.Get_size()} processes, the layout of like "
                                 f"{layout.size}")
            layout = layout.on(mcomm)
            if layout.n != x.shape[0]:
                raise ValueError(f"the DTensor has {x.shape[0]} rows, the operator's {axis} are {layout.n}")
        except (TypeError, ValueError) as e:
            err = e
    # x's metadata is the same on every rank (DTensor's contract); the digest of like's layout
    # catches ranks that pass different operators, before any of them enters the row moves
    check_collective(mcomm, err, agree={"like": (type(like).__name__, None if layout is None else
                                                 (layout.n, layout.size, layout.renumbered))})
    if isinstance(pl[0], dtm.Partial):
        x = x.redistribute(mesh, [dtm.Shard(0)])
    size = mcomm.Get_size()
    if layout is None:
        layout = _Layout(mcomm, shard_offsets(x.shape[0], size))
    if isinstance(x.placements[0], dtm.Replicate):
        # each rank keeps its own rows: the gradient is a partial sum over the ranks
        full = x.to_local(grad_placements=[dtm.Partial()])
        r = mcomm.Get_rank()
        rows = slice(int(layout.offsets[r]), int(layout.offsets[r + 1]))
        if not layout.renumbered:
            return full[rows]
        return full[torch.from_numpy(np.ascontiguousarray(layout.perm[rows]))]
    plan = _plan(layout, size)
    return x.to_local() if plan.identity else _moved(x.to_local(), plan, mcomm, True)


# -- placements ---------------------------------------------------------------------------------

def to_torch_placement(placement: "Placement", nbatch: int = 0) -> "TorchPlacement":
    """Local. The ``torch.distributed.tensor`` placement of a dense ``(*batch, n)`` vector that
    goes with a slasolve placement of a ``(*batch, M, N)`` operator with ``nbatch`` batch dims:
    row shard -> ``Shard(nbatch)``, ``Replicated()`` -> ``Replicate()``, batch ``Shard(d)`` ->
    ``Shard(d)``. A column shard has none (its products are replicated): ValueError."""
    from . import placement as sp
    _dtensor_api()
    if not isinstance(placement, sp.Placement):
        raise TypeError(f"not a slasolve placement: {placement!r}")
    return placement.to_torch(nbatch)


def from_torch_placement(placement: "TorchPlacement", nbatch: int = 0) -> "Placement":
    """Local. The slasolve placement of a ``(*batch, M, N)`` operator (``nbatch`` batch dims) that
    goes with a dense ``(*batch, n)`` ``DTensor`` placement: ``Shard(nbatch)`` -> row shard,
    ``Shard(d < nbatch)`` -> batch ``Shard(d)``, ``Replicate()`` -> ``Replicated()``. ``Partial``
    (unreduced sums), ``_StridedShard`` and ``Shard`` of a trailing dim have none: ValueError."""
    from . import placement as sp
    dtm = _dtensor_api()
    if isinstance(placement, dtm.Replicate):
        return sp.Replicated()
    if type(placement) is dtm.Shard:
        if placement.dim == nbatch:
            return sp.row_shard(nbatch)
        if 0 <= placement.dim < nbatch:
            return sp.Shard(placement.dim)
        raise ValueError(f"{placement} shards a dimension after the rows (columns of a block); slasolve shards "
                         f"rows: redistribute to Shard({nbatch}) first")
    if isinstance(placement, dtm.Partial):
        raise ValueError(f"Partial placement {placement} (per-rank partial sums) has no slasolve placement: "
                         f"reduce it first (x.redistribute(mesh, [Shard({nbatch})]))")
    raise ValueError(f"{placement!r} has no slasolve placement")


# -- entry hooks ----------------------------------------------------------------------------------

def _result_placement(inputs):
    """Local. The placement results take: ``Replicate()`` when every DTensor input is replicated,
    else ``Shard(0)``; and the mesh of the first DTensor input."""
    dtm = _dtensor_api()
    dts = [v for v in inputs if is_dtensor(v)]
    rep = all(isinstance(v.placements[0], dtm.Replicate) for v in dts)
    return (dtm.Replicate() if rep else dtm.Shard(0)), (dts[0].device_mesh if dts else None)


def _local(v, like, axis="rows"):
    return from_dtensor(v, like, axis=axis) if is_dtensor(v) else v


def _result(y: torch.Tensor, like, mesh, placement, axis: str = "rows", checked: bool = False) -> "DTensor":
    """Collective. A solver's result ``y`` (rows of ``like``) as a DTensor. The inputs' conversion
    checked ``like`` against the mesh on every rank (one Allreduce), and ``y`` has the layout by
    construction, so no further check; ``checked`` (no DTensor input: nothing was checked) runs
    :func:`to_dtensor`'s."""
    if checked or mesh is None:
        return to_dtensor(y, like, mesh=mesh, placement=placement, axis=axis)
    mcomm = _mesh_comm(mesh)
    return _wrap(y, _layout_of(like, axis).on(mcomm), mesh, mcomm, placement)


def _solve_like(fn, args, kwargs, force):
    """``solve`` / ``spsolve``: ``b``, ``x0``, ``near_nullspace`` in, ``x`` out."""
    A = args[0] if args else kwargs["A"]
    bpos = len(args) > 1
    b = args[1] if bpos else kwargs.get("b")
    inputs = [b, kwargs.get("x0"), kwargs.get("near_nullspace")]
    placement, mesh = _result_placement(inputs)
    args = list(args)
    if bpos:
        args[1] = _local(b, A)
    else:
        kwargs["b"] = _local(b, A)
    for name in ("x0", "near_nullspace"):
        if is_dtensor(kwargs.get(name)):
            kwargs[name] = _local(kwargs[name], A)
    out = fn(*args, **kwargs)
    x, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    x = _result(x, A, mesh, placement, checked=force and not any(is_dtensor(v) for v in inputs))
    return (x,) + tuple(rest) if rest is not None else x


def _eigsh_like(fn, args, kwargs, force):
    """``eigsh``: ``v0`` in; eigenvalues ``Replicate()``, eigenvectors ``Shard(0)`` out."""
    dtm = _dtensor_api()
    A = args[0] if args else kwargs["A"]
    args = list(args)
    mesh = None
    if len(args) > 5 and is_dtensor(args[5]):
        mesh = args[5].device_mesh
        args[5] = _local(args[5], A)
    elif is_dtensor(kwargs.get("v0")):
        mesh = kwargs["v0"].device_mesh
        kwargs["v0"] = _local(kwargs["v0"], A)
    out = fn(*args, **kwargs)
    w, V, rest = out[0], out[1], out[2:]
    checked = mesh is None
    if mesh is None:
        mesh = device_mesh(A.comm if _is_dsparse(A) else MPI.COMM_SELF)
    # every rank holds the eigenvalues: a replicated DTensor of the local copy (no communication)
    w = dtm.DTensor.from_local(w, mesh, [dtm.Replicate()], shape=w.shape, stride=w.stride())
    return (w, _result(V, A, mesh, dtm.Shard(0), checked=checked)) + tuple(rest)


def _nonlinear_like(fn, args, kwargs, force):
    """``nonlinear_solve(residual, u0, *params)``: ``u`` is laid out as ``DTensor``'s ``Shard(0)``;
    ``residual`` / ``jacobian`` get ``u`` (and ``DTensor`` params) as ``DTensor`` s, their
    ``DTensor`` residual comes back to local rows; the Jacobian must own the same rows
    (:func:`shard_offsets`)."""
    dtm = _dtensor_api()
    residual, u0, params = args[0], args[1], list(args[2:])
    if not is_dtensor(u0):
        if not force:
            raise TypeError("nonlinear_solve: give u0 as a DTensor when params are DTensors (the residual is "
                            "called with u as a DTensor)")
        u0 = to_dtensor(u0, kwargs.get("like"))
    kwargs.pop("like", None)
    mesh = u0.device_mesh
    specs = [(p.device_mesh, tuple(p.placements), p.shape, p.stride()) if is_dtensor(p) else None for p in params]
    locals_ = [p.to_local() if is_dtensor(p) else p for p in params]

    shape, stride = u0.shape, u0.stride()

    def wrap_args(u, ps):
        # u is in DTensor's own split (it came from u0's local rows): no move, no check
        ud = dtm.DTensor.from_local(u, mesh, [dtm.Shard(0)], shape=shape, stride=stride)
        pd = [dtm.DTensor.from_local(p, s[0], s[1], shape=s[2], stride=s[3]) if s is not None else p
              for p, s in zip(ps, specs)]
        return ud, pd

    def res(u, *ps):
        ud, pd = wrap_args(u, ps)
        r = residual(ud, *pd)
        if is_dtensor(r) and type(r.placements[0]) is dtm.Shard and r.placements[0].dim == 0 \
                and r.shape == shape:
            return r.to_local()
        return from_dtensor(r) if is_dtensor(r) else r

    jac = kwargs.get("jacobian")
    if jac is not None:
        def jacobian(u, *ps):
            ud, pd = wrap_args(u, ps)
            return jac(ud, *pd)
        kwargs["jacobian"] = jacobian
    kwargs.setdefault("comm", _mesh_comm(mesh))
    out = fn(res, from_dtensor(u0), *locals_, **kwargs)
    u, rest = (out[0], out[1:]) if isinstance(out, tuple) else (out, None)
    mcomm = _mesh_comm(mesh)   # u has DTensor's split by construction: no move, no check
    u = _wrap(u, _Layout(mcomm, shard_offsets(shape[0], mcomm.Get_size())), mesh, mcomm, u0.placements[0])
    return (u,) + tuple(rest) if rest is not None else u


def _product_like(fn, args, kwargs, force):
    """``dA.matvec(x)`` / ``dA.rmatvec(y)`` (bound methods): row shard, ``Shard(0)`` (or
    ``Replicate()``) in and out; replicated operator: any placement in, ``Replicate()`` out;
    column and batch shards raise ValueError."""
    from .placement import Replicated
    dtm = _dtensor_api()
    dA = fn.__self__
    transposed = fn.__name__ == "rmatvec"
    x = args[0] if args else next(iter(kwargs.values()))
    mesh = x.device_mesh if is_dtensor(x) else device_mesh(dA.comm)
    if dA.is_row_shard:
        placement, _ = _result_placement([x])
        inp, outp = ("rows", "cols") if transposed else ("cols", "rows")
        y = fn(_local(x, dA, inp) if is_dtensor(x) else x)
        return _result(y, dA, mesh, placement, axis=outp, checked=not is_dtensor(x))
    if not isinstance(dA.placement, Replicated):
        raise ValueError(f"DTensor products with a {dA.placement} DSparseTensor are not supported: use a row "
                         f"shard (or a replicated operator)")
    xl = x.redistribute(mesh, [dtm.Replicate()]).to_local() if is_dtensor(x) else x
    y = fn(xl)
    return dtm.DTensor.from_local(y, mesh, [dtm.Replicate()], shape=y.shape, stride=y.stride())


_ENTRY_POINTS: dict = {}  # op -> the decorated public function (see dtensor_entry)

_ENTRIES = {"solve": _solve_like, "spsolve": _solve_like, "eigsh": _eigsh_like,
            "nonlinear_solve": _nonlinear_like, "matvec": _product_like}


def _any_dtensor(args, kwargs) -> bool:
    if "torch.distributed.tensor" not in sys.modules:
        return False
    return any(is_dtensor(v) for v in args) or any(is_dtensor(v) for v in kwargs.values())


def dtensor_entry(op: str) -> Callable:
    """Local. Decorator of a public entry point (``op`` in ``"solve"``, ``"spsolve"``, ``"eigsh"``,
    ``"nonlinear_solve"``, ``"matvec"``): a call with a ``DTensor`` argument converts the
    ``DTensor`` inputs to local rows, calls the function, and returns ``DTensor`` results (see the
    module doc); any other call goes straight to the function (one scan of the arguments)."""
    adapter = _ENTRIES[op]

    def decorate(fn):
        @functools.wraps(fn)
        def entry(*args, **kwargs):
            if _any_dtensor(args, kwargs):
                if op == "matvec":  # a method: bind self, so the adapter sees the operator
                    return adapter(fn.__get__(args[0]), args[1:], kwargs, False)
                return adapter(fn, args, kwargs, False)
            return fn(*args, **kwargs)
        entry.dtensor_call = lambda *a, **k: adapter(fn.__get__(a[0]) if op == "matvec" else fn,
                                                     a[1:] if op == "matvec" else a, k, True)
        _ENTRY_POINTS.setdefault(op, entry)
        return entry
    return decorate


# -- DTensor-returning entry points ------------------------------------------------------------

def _entry_point(op: str) -> Callable:
    """Local. The public function decorated with ``dtensor_entry(op)`` (registered on import of its
    module, which ``import slasolve`` does)."""
    fn = _ENTRY_POINTS.get(op)
    if fn is None:
        raise RuntimeError(f"slasolve.{op} is not loaded: import slasolve first")
    return fn


def solve(A: Any, b: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Collective. :func:`slasolve.solve` returning ``x`` as a ``DTensor`` (``Shard(0)``, or
    ``Replicate()`` when ``b`` is a replicated ``DTensor``); ``b``, ``x0`` may be either kind."""
    return _entry_point("solve").dtensor_call(A, b, *args, **kwargs)


def spsolve(A: Any, b: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Collective. :func:`slasolve.spsolve` returning ``x`` as a ``DTensor`` (as ``solve`` here)."""
    return _entry_point("spsolve").dtensor_call(A, b, *args, **kwargs)


def eigsh(A: Any, *args: Any, **kwargs: Any) -> tuple:
    """Collective. :func:`slasolve.eigsh` returning the eigenvalues as a ``Replicate()`` and the
    eigenvectors as a ``Shard(0)`` ``DTensor``."""
    return _entry_point("eigsh").dtensor_call(A, *args, **kwargs)


def nonlinear_solve(residual: Callable, u0: torch.Tensor, *params: Any, like: Any = None, **kwargs: Any) -> Any:
    """Collective. :func:`slasolve.nonlinear_solve` with ``u`` a ``DTensor`` (``Shard(0)``):
    ``residual(u, *params)`` and ``jacobian`` are called with ``u`` (and ``DTensor`` params) as
    ``DTensor`` s and may return a ``DTensor`` residual; the Jacobian's rows must follow
    ``DTensor``'s split (:func:`shard_offsets`). A local ``u0`` is laid out as ``like``'s rows
    (or in rank order) first."""
    return _entry_point("nonlinear_solve").dtensor_call(residual, u0, *params, like=like, **kwargs)
