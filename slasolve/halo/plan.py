"""HaloPlan: who sends which owned entries to whom, agreed once, exchanged many times.

The index space is distributed in contiguous ownership ranges that increase with
the rank (PETSc's layout). A rank asks for copies of some global ids it does not
own (its *ghosts*). The plan finds their owners from the ownership offsets, agrees
the send lists with one Alltoall of counts plus point-to-point messages of the
requested ids, and preallocates the buffers. Exchanges are mpi4py ``Isend`` /
``Irecv`` between neighbours only, and move exactly the ghost entries.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective, ownership_offsets

__all__ = ["HaloPlan", "halo_forward", "halo_reverse"]

_TAG_PLAN, _TAG_FWD, _TAG_REV = 71, 72, 73


class _Pending:
    """An exchange in flight: requests, receive buffer and how to finish it."""

    __slots__ = ("requests", "recvbuf", "kind", "like", "keep")

    def __init__(self, requests, recvbuf, kind, like, keep):
        self.requests, self.recvbuf, self.kind, self.like, self.keep = requests, recvbuf, kind, like, keep


class HaloPlan:
    """Collective (constructor). A reusable ghost-exchange schedule.

    Parameters
    ----------
    comm : MPI.Comm
    owned_range : (int, int)
        This rank owns global ids ``[start, end)``.
    ghost_ids : int tensor or array
        Sorted, unique global ids this rank needs copies of (none of them owned).
    offsets : array, optional
        Ownership offsets ``(size+1,)`` when already known (saves one Allgather).

    Notes
    -----
    ``forward(x_owned)`` returns ghost copies ``(n_ghost, ...)``;
    ``reverse(g_ghost)`` returns the owners' summed contributions ``(n_owned, ...)``.
    Each is the adjoint of the other, and both are differentiable.
    The plan duplicates ``comm`` so its messages never match anybody else's.
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
        if offsets[comm.Get_rank()] != start or offsets[comm.Get_rank() + 1] != end:
            err = ValueError(f"owned_range {owned_range} is not contiguous with the other ranks' ranges")
        elif ghosts.size and (ghosts.min() < 0 or ghosts.max() >= offsets[-1]):
            err = ValueError(f"ghost_ids out of range [0, {offsets[-1]})")
        elif ghosts.size > 1 and not (ghosts[1:] > ghosts[:-1]).all():
            err = ValueError("ghost_ids must be sorted and unique")
        elif ghosts.size and ((ghosts >= start) & (ghosts < end)).any():
            err = ValueError("ghost_ids contains ids owned by this rank")
        check_collective(comm, err)

        self.comm = comm.Dup() if size > 1 else comm
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
        self.send_idx = torch.from_numpy(send_ids - start)
        self.n_send = int(send_ids.size)
        self._send_idx_np = self.send_idx.numpy()

    # -- reporting ----------------------------------------------------------
    @property
    def neighbours(self) -> List[int]:
        """Ranks this rank exchanges with (sends to or receives from)."""
        return sorted(set(self.recv_ranks) | set(self.send_ranks))

    def bytes_per_exchange(self, itemsize: int = 8, width: int = 1) -> Dict[str, int]:
        """Local. Bytes this rank sends and receives in one forward exchange
        (reverse is the mirror) of entries of ``width`` items of ``itemsize`` bytes."""
        return {"send": self.n_send * itemsize * width, "recv": self.n_ghost * itemsize * width,
                "messages_send": len(self.send_ranks), "messages_recv": len(self.recv_ranks)}

    # -- raw exchanges (no autograd) ----------------------------------------
    def _check_first_dim(self, t: torch.Tensor, n: int, what: str) -> None:
        if t.dim() < 1 or t.shape[0] != n:
            raise ValueError(f"{what} must have {n} rows along dim 0, got shape {tuple(t.shape)}")

    def start_forward(self, x_owned: torch.Tensor) -> _Pending:
        """Collective (non-blocking). Start owner -> ghost copies of ``x_owned`` rows."""
        self._check_first_dim(x_owned, self.n_owned, "x_owned")
        xs = x_owned.detach()
        trailing = tuple(xs.shape[1:])
        xn = xs.to("cpu").numpy() if xs.device.type != "cpu" else xs.numpy()
        sendbuf = np.take(xn, self._send_idx_np, axis=0) if self.n_send else None
        recvbuf = np.empty((self.n_ghost,) + trailing, dtype=xn.dtype)
        comm = self.comm
        reqs = [comm.Irecv(recvbuf[a:b], source=r, tag=_TAG_FWD) for r, a, b in self._recv_slices]
        reqs += [comm.Isend(sendbuf[a:b], dest=r, tag=_TAG_FWD) for r, a, b in self._send_slices]
        return _Pending(reqs, recvbuf, "forward", xs, sendbuf)

    def start_reverse(self, g_ghost: torch.Tensor) -> _Pending:
        """Collective (non-blocking). Start sending ghost contributions to their owners."""
        self._check_first_dim(g_ghost, self.n_ghost, "g_ghost")
        gs = g_ghost.detach()
        trailing = tuple(gs.shape[1:])
        gn = np.ascontiguousarray(gs.to("cpu").numpy())
        recvbuf = np.empty((self.n_send,) + trailing, dtype=gn.dtype)
        comm = self.comm
        reqs = [comm.Irecv(recvbuf[a:b], source=r, tag=_TAG_REV) for r, a, b in self._send_slices]
        reqs += [comm.Isend(gn[a:b], dest=r, tag=_TAG_REV) for r, a, b in self._recv_slices]
        return _Pending(reqs, recvbuf, "reverse", gs, gn)

    def finish(self, pending: _Pending) -> torch.Tensor:
        """Collective (completes a started exchange). Ghost copies, or owned contributions."""
        MPI.Request.Waitall(pending.requests)
        like = pending.like
        recv = torch.from_numpy(pending.recvbuf).to(like.device)
        if pending.kind == "forward":
            return recv
        out = like.new_zeros((self.n_owned,) + tuple(like.shape[1:]))
        if self.n_send:
            out.index_add_(0, self.send_idx.to(like.device), recv)
        return out

    def forward_raw(self, x_owned: torch.Tensor) -> torch.Tensor:
        return self.finish(self.start_forward(x_owned))

    def reverse_raw(self, g_ghost: torch.Tensor) -> torch.Tensor:
        return self.finish(self.start_reverse(g_ghost))

    # -- differentiable exchanges -------------------------------------------
    def forward(self, x_owned: torch.Tensor) -> torch.Tensor:
        """Collective. Ghost copies ``(n_ghost, ...)`` of owned rows; differentiable."""
        return _HaloForward.apply(x_owned, self)

    def reverse(self, g_ghost: torch.Tensor) -> torch.Tensor:
        """Collective. Sum ghost contributions into ``(n_owned, ...)``; differentiable."""
        return _HaloReverse.apply(g_ghost, self)


class _HaloForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_owned, plan):
        ctx.plan = plan
        return plan.forward_raw(x_owned)

    @staticmethod
    def backward(ctx, g):
        return ctx.plan.reverse_raw(g.contiguous()), None


class _HaloReverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g_ghost, plan):
        ctx.plan = plan
        return plan.reverse_raw(g_ghost)

    @staticmethod
    def backward(ctx, g):
        return ctx.plan.forward_raw(g.contiguous()), None


def halo_forward(plan: HaloPlan, x_owned: torch.Tensor) -> torch.Tensor:
    """Collective. Functional form of :meth:`HaloPlan.forward`."""
    return plan.forward(x_owned)


def halo_reverse(plan: HaloPlan, g_ghost: torch.Tensor) -> torch.Tensor:
    """Collective. Functional form of :meth:`HaloPlan.reverse`."""
    return plan.reverse(g_ghost)
