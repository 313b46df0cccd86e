"""HaloPlan: who sends which owned entries to whom, agreed once, exchanged many times.

The index space is distributed in contiguous ownership ranges that increase with
the rank (PETSc's layout). A rank asks for copies of some global ids it does not
own (its *ghosts*). The plan finds their owners from the ownership offsets, agrees
the send lists with one Alltoall of counts plus point-to-point messages of the
requested ids, and preallocates the buffers. Exchanges are mpi4py ``Isend`` /
``Irecv`` between neighbours only, and move exactly the ghost entries.
"""
from __future__ import annotations

import hashlib
import math
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .. import _log
from .._comm import check_collective, ownership_offsets
from ..collectives import LinearExchange

__all__ = ["HaloPlan", "BoundExchange", "halo_forward", "halo_reverse"]

_TAG_PLAN, _TAG_FWD, _TAG_REV = 71, 72, 73
_TAG_BOUND = 74   # 74 forward, 75 reverse: BoundExchange (no headers; the Krylov operator's is 79)
_HEADER = 2  # int64 words in front of every exchange message: (plan id, kind), signature
_POISON = -1  # signature of a message from a rank whose input was invalid
_EV_START, _EV_FINISH = _log.event("slaHaloStart"), _log.event("slaHaloFinish")


class _Inner:
    """The duplicated communicator that every plan on one parent communicator shares."""

    __slots__ = ("comm", "plans")

    def __init__(self, comm: MPI.Comm):
        self.comm = comm
        self.plans = 0  # plans created so far: the next plan's id (equal on every rank)


def _free_inner(comm, keyval, inner) -> None:
    # MPI calls this when the parent communicator is freed (or its attribute deleted)
    if isinstance(inner, _Inner) and inner.comm != MPI.COMM_NULL and not MPI.Is_finalized():
        inner.comm.Free()


_KEYVAL: Optional[int] = None


def _inner_comm(comm: MPI.Comm) -> _Inner:
    """Collective on first use per ``comm``. The halo communicator of ``comm``.

    As PETSc does with its inner communicator: one ``Dup`` per parent communicator,
    cached as an MPI attribute on the parent and freed with it, so halo messages
    never match the user's and creating plans creates no communicators. The plans
    on one communicator share it; SPMD order (plans are built collectively, and
    MPI never reorders messages between two ranks with the same tag) keeps their
    exchanges matched, and the plan id in each message header catches misuse.
    """
    global _KEYVAL
    if _KEYVAL is None:
        _KEYVAL = MPI.Comm.Create_keyval(delete_fn=_free_inner)
    inner = comm.Get_attr(_KEYVAL)
    if inner is None:
        dup = comm.Dup()
        dup.Set_errhandler(MPI.ERRORS_RETURN)  # a truncated message must raise, not abort
        inner = _Inner(dup)
        comm.Set_attr(_KEYVAL, inner)
    return inner


def _signature(dtype: np.dtype, width: int) -> int:
    """What a message's rows hold: element type and items per row (-1: poison)."""
    return (ord(dtype.char) << 40) | (np.dtype(dtype).itemsize << 32) | int(width)


def _describe(sig: int) -> str:
    if sig == _POISON:
        return "an invalid input"
    return f"dtype {np.dtype(chr(sig >> 40))} with {sig & 0xFFFFFFFF} item(s) per row"


class _Pending:
    """An exchange in flight: requests, receive buffer and how to finish it."""

    __slots__ = ("requests", "recvbuf", "kind", "like", "keep", "layout", "dtype", "trailing", "error")

    def __init__(self, requests, recvbuf, kind, like, keep, layout, dtype, trailing, error):
        self.requests, self.recvbuf, self.kind, self.like, self.keep = requests, recvbuf, kind, like, keep
        self.layout, self.dtype, self.trailing, self.error = layout, dtype, trailing, error


def _cpu_array(t) -> Optional[np.ndarray]:
    """A NumPy view of a CPU tensor, or None (another device, a dtype NumPy lacks, not a tensor:
    the tensor path handles and reports those)."""
    if isinstance(t, torch.Tensor) and t.device.type == "cpu":
        try:
            return t.detach().numpy()
        except (TypeError, RuntimeError):
            return None
    return None


class HaloPlan:
    """Collective (constructor). A reusable ghost-exchange schedule.

    Parameters
    ----------
    comm : MPI.Comm
    owned_range : (int, int)
        This rank owns global ids ``[start, end)`` (possibly none).
    ghost_ids : int tensor or array
        Sorted, unique global ids this rank needs copies of (none of them owned).
    offsets : array, optional
        Ownership offsets ``(size+1,)`` when already known (saves one Allgather).

    Notes
    -----
    ``forward(x_owned)`` returns ghost copies ``(n_ghost, ...)``;
    ``reverse(g_ghost)`` returns the owners' summed contributions ``(n_owned, ...)``.
    Each is the adjoint of the other, and both are differentiable.

    Messages travel on one duplicate of ``comm`` shared by every plan on ``comm``
    (cached on ``comm`` as an MPI attribute and freed with it), so they never match
    anybody else's and building plans creates no communicators. Each message
    carries a 16-byte header (plan id, element type, items per row). A rank whose
    input is invalid still takes part in the exchange and sends a *poison* header;
    every rank that receives a poison, a header that differs from its own (another
    dtype or number of columns) or a message of the wrong length raises
    ``ValueError`` naming the sending rank, after the exchange completed (so no
    message is left behind). Ranks that exchange nothing with the failing rank
    cannot know; they return normally, and the job relies on the unhandled
    exception on the other ranks aborting it
    (:func:`slasolve.abort_on_unhandled_exception`, the default under ``mpirun``).
    """

    def __init__(self, comm: MPI.Comm, owned_range: Tuple[int, int], ghost_ids,
                 offsets: Optional[Sequence[int]] = None):
        start, end = int(owned_range[0]), int(owned_range[1])
        ghosts = (ghost_ids.detach().cpu().numpy() if isinstance(ghost_ids, torch.Tensor)
                  else np.asarray(ghost_ids)).astype(np.int64).ravel()
        size = comm.Get_size()
        if offsets is None:
            offsets = ownership_offsets(comm, end - start)
        offsets = np.asarray(offsets, dtype=np.int64)
        err = None
        if offsets.shape != (size + 1,):
            err = ValueError(f"offsets must have size+1 = {size + 1} entries, got {offsets.shape}")
        elif offsets[comm.Get_rank()] != start or offsets[comm.Get_rank() + 1] != end:
            err = ValueError(f"owned_range {owned_range} is not contiguous with the other ranks' ranges")
        elif ghosts.size and (ghosts.min() < 0 or ghosts.max() >= offsets[-1]):
            err = ValueError(f"ghost_ids out of range [0, {offsets[-1]})")
        elif ghosts.size > 1 and not (ghosts[1:] > ghosts[:-1]).all():
            err = ValueError("ghost_ids must be sorted and unique")
        elif ghosts.size and ((ghosts >= start) & (ghosts < end)).any():
            err = ValueError("ghost_ids contains ids owned by this rank")
        # the ownership offsets must be the same everywhere (a digest: O(1) to compare)
        digest = hashlib.blake2b(np.ascontiguousarray(offsets).tobytes(), digest_size=8).hexdigest()
        check_collective(comm, err, agree={"offsets": digest})

        self.parent = comm
        if size > 1:
            inner = _inner_comm(comm)
            self.comm = inner.comm
            self.plan_id = inner.plans
            inner.plans += 1
        else:
            self.comm, self.plan_id = comm, 0
        self.owned_range = (start, end)
        self.n_owned = end - start
        self.n_ghost = int(ghosts.size)
        self.ghost_ids = torch.from_numpy(ghosts)
        self.offsets = offsets

        owners = np.searchsorted(offsets, ghosts, side="right") - 1
        recv_counts = np.bincount(owners, minlength=size).astype(np.int64)
        if size > 1:
            send_counts = np.empty(size, dtype=np.int64)
            self.comm.Alltoall(recv_counts, send_counts)
        else:
            send_counts = np.zeros(1, dtype=np.int64)
        self.recv_ranks = np.nonzero(recv_counts)[0].tolist()
        self.send_ranks = np.nonzero(send_counts)[0].tolist()
        recv_offsets = np.concatenate([[0], np.cumsum(recv_counts)])
        send_offsets = np.concatenate([[0], np.cumsum(send_counts)])
        self._recv_slices = [(r, int(recv_offsets[r]), int(recv_offsets[r + 1])) for r in self.recv_ranks]
        self._send_slices = [(r, int(send_offsets[r]), int(send_offsets[r + 1])) for r in self.send_ranks]

        send_ids = np.empty(int(send_offsets[-1]), dtype=np.int64)
        reqs = [self.comm.Irecv(send_ids[a:b], source=r, tag=_TAG_PLAN) for r, a, b in self._send_slices]
        reqs += [self.comm.Isend(ghosts[a:b], dest=r, tag=_TAG_PLAN) for r, a, b in self._recv_slices]
        MPI.Request.Waitall(reqs)
        self._layouts: Dict[tuple, tuple] = {}
        self._array_plans: Dict[tuple, tuple] = {}
        self._bound: Dict[tuple, "BoundExchange"] = {}
        self.send_idx = torch.from_numpy(send_ids - start)
        self.n_send = int(send_ids.size)
        self._send_idx_np = self.send_idx.numpy()

    # -- reporting ----------------------------------------------------------
    @property
    def neighbours(self) -> List[int]:
        """Ranks this rank exchanges with (sends to or receives from)."""
        return sorted(set(self.recv_ranks) | set(self.send_ranks))

    def bytes_per_exchange(self, itemsize: int = 8, width: int = 1) -> Dict[str, int]:
        """Local. Bytes of entries this rank sends and receives in one forward exchange
        (reverse is the mirror) of entries of ``width`` items of ``itemsize`` bytes
        (each message also carries a 16-byte header)."""
        return {"send": self.n_send * itemsize * width, "recv": self.n_ghost * itemsize * width,
                "messages_send": len(self.send_ranks), "messages_recv": len(self.recv_ranks)}

    # -- raw exchanges (no autograd) ----------------------------------------
    def _first_dim_error(self, t, n: int, what: str) -> Optional[Exception]:
        if not isinstance(t, torch.Tensor):
            return TypeError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 1 or t.shape[0] != n:
            return ValueError(f"{what} must have {n} rows along dim 0, got shape {tuple(t.shape)}")
        return None

    def _layout_for(self, kind: int, dtype: np.dtype, trailing: tuple, poison: bool):
        """Byte offsets, header and signature of one exchange's messages (cached)."""
        key = (kind, dtype, trailing, poison)
        lay = self._layouts.get(key)
        if lay is None:
            send_slices, recv_slices = ((self._send_slices, self._recv_slices) if kind == 0
                                        else (self._recv_slices, self._send_slices))
            sig = _POISON if poison else _signature(dtype, math.prod(trailing))
            rowbytes = dtype.itemsize * math.prod(trailing)
            recv, o = [], 0
            for r, a, b in recv_slices:
                recv.append((r, o, o + 16 + (b - a) * rowbytes))
                o = recv[-1][2]
            send, s = [], 0
            for r, a, b in send_slices:
                send.append((r, a, b, s, s + 16 + (0 if poison else (b - a) * rowbytes)))
                s = send[-1][4]
            hdr = np.array([self.plan_id * 2 + kind, sig], dtype=np.int64).view(np.uint8)
            lay = self._layouts[key] = (recv, o, send, s, hdr, hdr.tobytes(), sig)
        return lay

    def _start(self, t, n_rows: int, what: str, kind: int, send_idx, error: Optional[Exception]) -> _Pending:
        """Post the receives and sends of one exchange (``kind``: 0 forward, 1 reverse).

        Every message is ``[16-byte header | rows]``. ``send_idx``: rows of ``t`` to
        send (None: the rows in order). With an ``error`` (or an invalid ``t``) the
        sends are bare poison headers; the receives are posted all the same, so
        every message of this exchange is consumed.
        """
        if error is None:
            error = self._first_dim_error(t, n_rows, what)
        tn = None
        if error is None:
            try:
                ts = t.detach()
                tn = ts.numpy() if ts.device.type == "cpu" else ts.to("cpu").numpy()
                trailing, dtype = tuple(ts.shape[1:]), tn.dtype
            except Exception as e:  # never leave the neighbours waiting: poison instead
                error, tn = e, None
        if error is not None:
            ts = t.detach() if isinstance(t, torch.Tensor) else torch.zeros(0)
            trailing, dtype = (), np.dtype(np.float64)
        lay = self._layout_for(kind, dtype, trailing, error is not None)
        recv, nrecv, send, nsend, hdr = lay[:5]
        comm = self.comm
        tag = _TAG_FWD + kind
        recvbuf = np.empty(nrecv, dtype=np.uint8)
        reqs = []
        sendbuf = np.empty(nsend, dtype=np.uint8)
        for r, a, b, o, e in send:
            seg = sendbuf[o:e]
            seg[:16] = hdr
            if tn is not None:
                rows = seg[16:].view(dtype).reshape((b - a,) + trailing)
                if send_idx is None:
                    rows[...] = tn[a:b]
                else:
                    np.take(tn, send_idx[a:b], axis=0, out=rows)
            reqs.append(comm.Isend([seg, MPI.BYTE], dest=r, tag=tag))
        return _Pending(reqs, recvbuf, kind, ts, sendbuf, lay, dtype, trailing, error)

    def start_forward(self, x_owned: torch.Tensor, error: Optional[Exception] = None) -> _Pending:
        """Collective (non-blocking). Start owner -> ghost copies of ``x_owned`` rows.

        A rank with an invalid ``x_owned`` (or passing ``error``) still takes part:
        it sends poison headers, and :meth:`finish` raises there and on its neighbours.
        """
        with _log.phase("halo", _EV_START):
            return self._start(x_owned, self.n_owned, "x_owned", 0,
                               self._send_idx_np if self.n_send else None, error)

    def start_reverse(self, g_ghost: torch.Tensor, error: Optional[Exception] = None) -> _Pending:
        """Collective (non-blocking). Start sending ghost contributions to their owners."""
        with _log.phase("halo", _EV_START):
            return self._start(g_ghost, self.n_ghost, "g_ghost", 1, None, error)

    def _wait(self, pending: _Pending) -> Optional[Exception]:
        """Complete every request; the first problem with a received message, if any.

        Receives are matched by ``Mprobe`` and sized from the probe, so a message
        of another length (another dtype or number of columns on the sender) is
        received whole and reported, never truncated: Open MPI 4.1 can hang
        completing a truncated receive. A header names its plan, direction, element
        type and items per row, which fix the length.
        """
        recv, hdr_bytes = pending.layout[0], pending.layout[5]
        comm, tag = self.comm, _TAG_FWD + pending.kind
        buf = pending.recvbuf
        problem = None
        st = MPI.Status()
        for r, a, b in recv:
            msg = comm.Mprobe(source=r, tag=tag, status=st)
            if st.Get_count(MPI.BYTE) == b - a:
                msg.Recv([buf[a:b], MPI.BYTE])
                if problem is None and buf[a:a + 16].tobytes() != hdr_bytes:
                    problem = self._message_error(pending, r, buf[a:a + 16].copy().view(np.int64))
            else:  # another length: receive it whole (never truncate), then say why
                other = np.empty(max(st.Get_count(MPI.BYTE), 16), dtype=np.uint8)
                other[:16] = 0
                msg.Recv([other, MPI.BYTE])
                if problem is None:
                    problem = self._message_error(pending, r, other[:16].copy().view(np.int64))
        MPI.Request.Waitall(pending.requests)
        return problem

    def _message_error(self, pending: _Pending, r: int, hdr) -> ValueError:
        what = "halo exchange" + ("" if pending.kind == 0 else " (reverse)")
        me = self.comm.Get_rank()
        want, sig = self.plan_id * 2 + pending.kind, pending.layout[6]
        if int(hdr[1]) == _POISON:
            return ValueError(f"{what}: rank {r} passed an invalid input to this collective product "
                              f"(see the error raised on rank {r}); rank {me} cannot complete it")
        if int(hdr[0]) != want:
            return ValueError(f"{what}: rank {r} is running another exchange (plan/direction {int(hdr[0])}, "
                              f"rank {me}: {want}); every rank must call the same collective products "
                              "in the same order")
        return ValueError(f"{what}: rank {r} sent {_describe(int(hdr[1]))}, rank {me} expects "
                          f"{_describe(sig)}: the vectors' dtype or number of columns differ across ranks")

    def finish(self, pending: _Pending) -> torch.Tensor:
        """Collective (completes a started exchange). Ghost copies, or owned contributions.

        Raises ``ValueError`` when this rank's input was invalid, or when a
        neighbour's message says its input was invalid or differs in dtype or columns.
        """
        with _log.phase("halo", _EV_FINISH):
            return self._finish(pending)

    def _received(self, pending: _Pending) -> np.ndarray:
        """Complete ``pending``, raise this rank's or a neighbour's error, and view the received
        rows ``(n_ghost or n_send, ...)`` in the receive buffer."""
        problem = self._wait(pending)
        if pending.error is not None:
            raise pending.error
        if problem is not None:
            raise problem
        buf, recv = pending.recvbuf, pending.layout[0]
        if len(recv) == 1:
            flat = buf[16:]
        elif recv:
            flat = np.concatenate([buf[a + 16:b] for _, a, b in recv])
        else:
            flat = buf
        n = self.n_ghost if pending.kind == 0 else self.n_send
        return flat.view(pending.dtype).reshape((n,) + pending.trailing)

    def _finish(self, pending: _Pending) -> torch.Tensor:
        like = pending.like
        recv = torch.from_numpy(self._received(pending))
        if like.device.type != "cpu":
            recv = recv.to(like.device)
        if pending.kind == 0:
            return recv
        out = like.new_zeros((self.n_owned,) + tuple(like.shape[1:]))
        if self.n_send:
            out.index_add_(0, self.send_idx.to(like.device), recv)
        return out

    def forward_raw(self, x_owned: torch.Tensor) -> torch.Tensor:
        """Collective. :meth:`forward` without autograd (start and finish in one call)."""
        xn = _cpu_array(x_owned)
        if xn is None:
            return self.finish(self.start_forward(x_owned))
        return torch.from_numpy(self._exchange_array(xn, 0))

    def reverse_raw(self, g_ghost: torch.Tensor) -> torch.Tensor:
        """Collective. :meth:`reverse` without autograd (start and finish in one call)."""
        gn = _cpu_array(g_ghost)
        if gn is None:
            return self.finish(self.start_reverse(g_ghost))
        return torch.from_numpy(self._exchange_array(gn, 1))

    # -- NumPy exchanges (no torch, no autograd) ----------------------------
    def forward_array(self, x_owned: np.ndarray) -> np.ndarray:
        """Collective. :meth:`forward_raw` on NumPy arrays: ghost copies ``(n_ghost, ...)`` (a new
        array) of the rows of ``x_owned`` ``(n_owned, ...)``.

        The same messages, headers and errors as :meth:`forward_raw` (a rank whose ``x_owned`` is
        not an array with ``n_owned`` rows sends poison and raises, its neighbours with it), with
        no torch tensors and buffers kept per dtype and row shape: for callers that exchange small
        NumPy arrays many times (the FEM layer's Newton kernels), where the per-call Python costs
        more than the messages.
        """
        return self._exchange_array(x_owned, 0)

    def reverse_array(self, g_ghost: np.ndarray) -> np.ndarray:
        """Collective. :meth:`reverse_raw` on NumPy arrays: the owners' sums ``(n_owned, ...)`` (a new
        array) of the ghost rows ``g_ghost`` ``(n_ghost, ...)``, added in the order
        :meth:`reverse_raw` adds them (the same bits). Errors as :meth:`forward_array`."""
        return self._exchange_array(g_ghost, 1)

    def _array_plan(self, kind: int, dtype: np.dtype, trailing: tuple, poison: bool) -> tuple:
        """The kept buffers of :meth:`_exchange_array`: the layout, the send buffer with its headers
        written, each send segment's rows as a typed view, the receive buffer, and for a reverse
        exchange the flat destinations of the received items (float64: ``bincount``'s)."""
        key = (kind, dtype, trailing, poison)
        ap = self._array_plans.get(key)
        if ap is None:
            lay = self._layout_for(kind, dtype, trailing, poison)
            recv, nrecv, send, nsend, hdr = lay[:5]
            sendbuf = np.empty(nsend, dtype=np.uint8)
            rows = []
            for r, a, b, o, e in send:
                sendbuf[o:o + 16] = hdr
                rows.append(None if poison else sendbuf[o + 16:e].view(dtype).reshape((b - a,) + trailing))
            recvbuf = np.empty(nrecv, dtype=np.uint8)
            dest = None
            if kind == 1 and self.n_send:
                width = math.prod(trailing)
                dest = (self._send_idx_np[:, None] * width + np.arange(width)).reshape(-1)
            ap = self._array_plans[key] = (lay, sendbuf, rows, recvbuf, dest)
        return ap

    def _exchange_array(self, a, kind: int) -> np.ndarray:
        n_rows, what = (self.n_owned, "x_owned") if kind == 0 else (self.n_ghost, "g_ghost")
        error = None
        if not isinstance(a, np.ndarray):
            error = TypeError(f"{what} must be a NumPy array, got {type(a).__name__}")
        elif a.dtype.hasobject:
            error = TypeError(f"{what} must hold numbers, got dtype {a.dtype}")
        elif a.ndim < 1 or a.shape[0] != n_rows:
            error = ValueError(f"{what} must have {n_rows} rows along dim 0, got shape {a.shape}")
        if error is None:
            dtype, trailing = a.dtype, a.shape[1:]
        else:
            dtype, trailing = np.dtype(np.float64), ()
        with _log.phase("halo", _EV_START):
            lay, sendbuf, rows, recvbuf, dest = self._array_plan(kind, dtype, trailing, error is not None)
            comm, tag = self.comm, _TAG_FWD + kind
            reqs = []
            for (r, lo, hi, o, e), seg in zip(lay[2], rows):
                if seg is not None:
                    if kind == 0:
                        np.take(a, self._send_idx_np[lo:hi], axis=0, out=seg)
                    else:
                        seg[...] = a[lo:hi]
                reqs.append(comm.Isend([sendbuf[o:e], MPI.BYTE], dest=r, tag=tag))
        with _log.phase("halo", _EV_FINISH):
            got = self._received(_Pending(reqs, recvbuf, kind, None, None, lay, dtype, trailing, error))
            if kind == 0:
                return got.copy()
            if dtype == np.float64 and dest is not None:
                # bincount adds its weights in sequence from zero, as index_add_ does
                return np.bincount(dest, weights=got.reshape(-1),
                                   minlength=self.n_owned * math.prod(trailing)).reshape((self.n_owned,) + trailing)
            out = np.zeros((self.n_owned,) + trailing, dtype=dtype)
            if self.n_send:
                np.add.at(out, self._send_idx_np, got)
            return out

    def bound_exchange(self, kind: int, trailing: tuple = ()) -> "BoundExchange":
        """Local (made at the first call for ``kind`` and ``trailing``, then kept). The plan's
        ``BoundExchange`` of float64 rows of shape ``trailing`` (``kind`` 0 forward, 1 reverse): a
        header-less exchange with persistent requests, only for callers that guarantee every
        rank makes the same such exchanges in the same order on arrays of the plan's sizes
        (``slasolve.halo.plan.BoundExchange`` says what it relies on)."""
        key = (int(kind), tuple(trailing))
        ex = self._bound.get(key)
        if ex is None:
            ex = self._bound[key] = BoundExchange(self, *key)
        return ex

    # -- differentiable exchanges -------------------------------------------
    def forward(self, x_owned: torch.Tensor) -> torch.Tensor:
        """Collective. Ghost copies ``(n_ghost, ...)`` of owned rows; differentiable."""
        return LinearExchange.apply(x_owned, self.forward_raw, self.reverse_raw)

    def reverse(self, g_ghost: torch.Tensor) -> torch.Tensor:
        """Collective. Sum ghost contributions into ``(n_owned, ...)``; differentiable."""
        return LinearExchange.apply(g_ghost, self.reverse_raw, self.forward_raw)


class BoundExchange:
    """Local (construction: no communication); :meth:`run` is collective over the plan's
    neighbours. One exchange of a :class:`HaloPlan` on float64 rows of a fixed shape with
    persistent requests on kept buffers and no message headers: gather the rows to send,
    ``Startall``, ``Waitall`` (~3 us at 2 ranks against ~12-20 us for ``HaloPlan.forward_array``,
    whose Python around the messages costs more than the messages at small sizes).
    Made by ``HaloPlan.bound_exchange``.

    It checks nothing, so it is only for callers that guarantee what the checked exchanges'
    headers verify: every rank of the plan makes the same bound exchanges in the same order,
    each with an array of the plan's row count (``n_owned`` forward, ``n_ghost`` reverse) and
    this row shape, float64 -- e.g. the :mod:`slasolve.fem` Newton kernels on the SNES's own
    vectors, whose exchanges SNES's collective decisions order. A caller that cannot guarantee
    it uses ``HaloPlan.forward_array`` / ``reverse_array`` (a message of another
    length is not detected here and can hang Open MPI). Results are new arrays, equal bit for bit
    to ``forward_array`` / ``reverse_array``'s (the reverse adds the received rows in the same
    order). Logged as ``slaHaloStart`` / ``slaHaloFinish`` and ``info.times['halo']``.
    """

    def __init__(self, plan: HaloPlan, kind: int, trailing: tuple):
        if kind not in (0, 1):
            raise ValueError(f"kind must be 0 (forward) or 1 (reverse), got {kind!r}")
        self.kind, self.trailing = kind, trailing
        width = math.prod(trailing)
        fwd = kind == 0
        send_slices, recv_slices = (plan._send_slices, plan._recv_slices) if fwd else \
            (plan._recv_slices, plan._send_slices)
        self.send = np.empty(((plan.n_send if fwd else plan.n_ghost),) + trailing, dtype=np.float64)
        self.recv = np.empty(((plan.n_ghost if fwd else plan.n_send),) + trailing, dtype=np.float64)
        sflat, rflat = self.send.reshape(-1), self.recv.reshape(-1)
        comm, tag = plan.comm, _TAG_BOUND + kind
        self.reqs = ([comm.Recv_init([rflat[a * width:b * width], MPI.DOUBLE], source=r, tag=tag)
                      for r, a, b in recv_slices] +
                     [comm.Send_init([sflat[a * width:b * width], MPI.DOUBLE], dest=r, tag=tag)
                      for r, a, b in send_slices])
        self.send_idx = plan._send_idx_np
        self.n_owned, self.n_out = plan.n_owned, plan.n_owned * width
        # reverse: the flat destination of every received item (as reverse_array's bincount)
        self.dest = None if fwd or not plan.n_send else \
            (plan._send_idx_np[:, None] * width + np.arange(width)).reshape(-1)
        self.phase = _log.phase("halo")   # reused: one exchange at a time

    def run(self, a: np.ndarray) -> np.ndarray:
        """Collective (the plan's neighbours). Forward: the ghost copies ``(n_ghost, *trailing)`` of
        the owned rows ``a`` ``(n_owned, *trailing)``; reverse: the owners' sums ``(n_owned,
        *trailing)`` of the ghost rows ``a`` ``(n_ghost, *trailing)``. New arrays."""
        with self.phase:
            _EV_START.begin()
            if self.kind == 0:
                np.take(a, self.send_idx, axis=0, out=self.send)
            else:
                self.send[...] = a
            MPI.Prequest.Startall(self.reqs)
            _EV_START.end()
            _EV_FINISH.begin()
            MPI.Request.Waitall(self.reqs)
            _EV_FINISH.end()
        if self.kind == 0:
            return self.recv.copy()
        if self.dest is None:
            return np.zeros((self.n_owned,) + self.trailing)
        # bincount adds its weights in sequence from zero, as reverse_array (and index_add_) does
        return np.bincount(self.dest, weights=self.recv.reshape(-1),
                           minlength=self.n_out).reshape((self.n_owned,) + self.trailing)

    def __del__(self):
        if not MPI.Is_finalized():
            for r in getattr(self, "reqs", ()):
                if r != MPI.REQUEST_NULL:
                    r.Free()


def halo_forward(plan: HaloPlan, x_owned: torch.Tensor) -> torch.Tensor:
    """Collective. Functional form of :meth:`slasolve.HaloPlan.forward`."""
    return plan.forward(x_owned)


def halo_reverse(plan: HaloPlan, g_ghost: torch.Tensor) -> torch.Tensor:
    """Collective. Functional form of :meth:`slasolve.HaloPlan.reverse`."""
    return plan.reverse(g_ghost)
