"""Communicator helpers: default communicator, collective validation, reductions.

slasolve's rule for errors (README "MPI"): validation that can fail on one
rank is combined across ranks, and the same exception is raised on every rank, so
that no rank is left waiting in a collective that the failing rank never enters.
"""
from __future__ import annotations

import builtins
from typing import Optional, Sequence, Union

import numpy as np
import torch
from mpi4py import MPI

__all__ = ["get_comm", "check_collective", "raise_collected", "settings_digest", "agree_digest", "options_key", "exchange_by_rank", "reply_by_rank", "allreduce_sum", "allreduce_max", "allreduce_int",
           "exscan_sum", "user_code"]

_ERROR_TYPES = {"ValueError": ValueError, "TypeError": TypeError, "IndexError": IndexError,
                "FileNotFoundError": FileNotFoundError, "ImportError": ImportError}


def get_comm(comm: Optional[MPI.Comm] = None) -> MPI.Comm:
    """Local. Return ``comm``, or ``MPI.COMM_WORLD`` when it is ``None``."""
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py MPI.Comm, got {type(comm).__name__}")
    return comm


def settings_digest(settings) -> int:
    """Local. A 62-bit digest of ``settings`` (any value with a stable ``repr``),
    identical in every process for equal settings (unlike ``hash``, which is salted)."""
    import hashlib
    h = hashlib.blake2b(repr(settings).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") >> 2


def options_key(options) -> Union[tuple, str]:
    """Local. A hashable, rank-independent key of a settings dict (``petsc_options``,
    ``linear_solver``): its sorted ``(name, repr(value))`` pairs, ``()`` for None, the
    ``repr`` of anything else. Both the cache keys and the settings every rank must agree
    on (``check_collective(agree=...)``) are made with it. A tensor value (this rank's rows,
    e.g. ``linear_solver``'s ``near_nullspace``) stands for its dtype and trailing shape: its
    values are compared collectively where they are used."""
    if options is None:
        return ()
    if isinstance(options, dict):
        return tuple(sorted((str(k), _value_key(v)) for k, v in options.items()))
    return repr(options)


def _value_key(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"<tensor {v.dtype} (n_local, *{tuple(v.shape[1:])})>"
    return repr(v)


def agree_digest(agree) -> int:
    """Local. The digest :func:`check_collective` compares for the settings ``agree``."""
    return settings_digest(sorted((str(k), v) for k, v in dict(agree).items()))


def check_collective(comm: MPI.Comm, error: Optional[BaseException], *, agree=None, flag: bool = False,
                     digest: Optional[int] = None, flag_voids_errors: bool = False) -> bool:
    """Collective. Raise ``error`` (or the first rank's error) on every rank.

    Each rank passes the result of its own validation: ``None`` when its input is
    fine, or the exception it would raise. One small Allreduce decides whether any
    rank failed; only then are the messages gathered, and every rank raises the
    same exception type with the message of the lowest failing rank.

    ``agree`` (optional): a mapping ``{argument name: value}`` of settings that must
    be identical on every rank (method, tolerances, column counts, dtypes, ...).
    Their digest rides on the same Allreduce; when the ranks disagree, every rank
    raises ``ValueError`` naming the arguments that differ and their values per
    rank. Nothing extra is communicated when they agree.

    ``flag`` (optional): a local fact the caller needs combined over the ranks; it rides on
    the same Allreduce, and the return value is True when it is True on any rank.

    ``digest`` (optional, with ``agree``): ``settings_digest(sorted((str(k), v) for k, v in
    agree.items()))`` computed by the caller (who may keep it for settings it sees again).

    ``flag_voids_errors`` (optional): the caller redoes its work whenever the combined flag is
    True (e.g. it worked from data that turned out stale on some rank), so the errors of this
    attempt are then dropped and True is returned; settings that differ still raise.
    """
    if comm.Get_size() == 1:
        if flag and flag_voids_errors:
            return True
        if error is not None:
            raise error
        return bool(flag)
    if agree is None:
        buf = np.array([1 if error is not None else 0, 1 if flag else 0], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        failed, any_flag = int(buf[0]), bool(buf[1])
        differ = False
    else:
        d = agree_digest(agree) if digest is None else int(digest)
        # one Allreduce(MIN) of [-failed, digest, -digest, -flag]: -(number failed) needs SUM, so
        # count the failures separately only when some rank failed
        buf = np.array([-(1 if error is not None else 0), d, -d, -(1 if flag else 0)], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MIN)
        failed = -int(buf[0])
        differ = int(buf[1]) != -int(buf[2])
        any_flag = bool(buf[3])
        if failed:
            failed = allreduce_int(comm, 1 if error is not None else 0)
    if (failed == 0 or (any_flag and flag_voids_errors)) and not differ:
        return any_flag
    if failed == 0:
        mine = {str(k): v for k, v in dict(agree).items()}
        everyone = comm.allgather({k: repr(v) for k, v in mine.items()})
        names = sorted({k for e in everyone for k in e if len({repr(x.get(k)) for x in everyone}) > 1})
        detail = "; ".join(f"{k}: " + ", ".join(f"rank {r}: {e.get(k)}" for r, e in enumerate(everyone))
                           for k in names)
        raise ValueError(f"arguments must be the same on every rank, but differ: {detail}")
    raise_collected(comm, error, failed)


def raise_collected(comm: MPI.Comm, error: Optional[BaseException], failed: int) -> None:
    """Collective. Raise on every rank, once a reduction the caller made anyway has shown that
    ``failed > 0`` ranks hold an error (a deferred check: each rank recorded its own ``error``,
    or None, and added ``1 if error else 0`` to that reduction). As :func:`check_collective`:
    the lowest failing rank raises its own exception, every other rank one of the same
    built-in type (else ``RuntimeError``) with that message and the rank it came from.
    On one rank ``error`` is raised as it is."""
    if comm.Get_size() == 1:
        raise error
    payload = None if error is None else (type(error).__name__, str(error))
    messages = comm.allgather(payload)
    first = next(r for r, m in enumerate(messages) if m is not None)
    kind, text = messages[first]
    if error is not None and first == comm.Get_rank():
        raise _on_every_rank(error)
    exc_type = _ERROR_TYPES.get(kind)
    if exc_type is None:  # another built-in exception keeps its type; anything else: RuntimeError
        cand = getattr(builtins, kind, None)
        exc_type = cand if isinstance(cand, type) and issubclass(cand, Exception) else RuntimeError
    suffix = f" (on rank {first}; {failed} rank(s) failed)"
    raise _on_every_rank(exc_type(text + suffix))


def _on_every_rank(error: BaseException) -> BaseException:
    """Local. Mark ``error`` as raised on every rank at this point (by :func:`check_collective`),
    so an enclosing :func:`user_code` passes it on instead of combining it again."""
    try:
        error.raised_on_every_rank = True
    except AttributeError:  # pragma: no cover - exception types without a __dict__
        pass
    return error


def user_code(comm: MPI.Comm, fn, what: str = "user code"):
    """Local (the returned function is Collective). ``fn`` wrapped for calls that every rank
    makes at the same point of a distributed iteration (a Krylov callback, a callable
    preconditioner, a ``LinearOperator``'s product, a nonlinear residual or Jacobian).

    An exception raised by ``fn`` on some ranks would leave the others waiting in the
    iteration's next reduction. After each call the outcome is combined (one integer
    Allreduce, only on more than one rank): the rank where ``fn`` raised re-raises its
    own exception, every other rank raises one of the same built-in type (else
    ``RuntimeError``) with its message and the rank it came from, so all ranks leave
    the solve together. ``None`` and one-rank communicators return ``fn`` unchanged.
    """
    if fn is None or comm.Get_size() == 1:
        return fn

    def call(*args, **kwargs):
        err = out = None
        try:
            out = fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - user code: re-raised on every rank below
            if getattr(e, "raised_on_every_rank", False):
                raise      # already combined (a nested guard, a collective check): every rank raises
            err = e
        check_collective(comm, err)
        return out

    call.__wrapped__ = fn
    call.__name__ = getattr(fn, "__name__", what)
    return call


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").contiguous().numpy()


def allreduce_sum(comm: MPI.Comm, t: torch.Tensor) -> torch.Tensor:
    """Collective. Sum a (small) tensor over all ranks; identity on one rank."""
    if comm.Get_size() == 1:
        return t
    buf = _as_numpy(t).copy()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    return torch.from_numpy(buf).to(t.device)


def allreduce_max(comm: MPI.Comm, t: torch.Tensor) -> torch.Tensor:
    """Collective. Elementwise maximum of a (small) tensor over all ranks."""
    if comm.Get_size() == 1:
        return t
    buf = _as_numpy(t).copy()
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return torch.from_numpy(buf).to(t.device)


def allreduce_int(comm: MPI.Comm, value: int, op: MPI.Op = MPI.SUM) -> int:
    """Collective. ``op`` (SUM, MAX, MIN) of one integer over the ranks: one ``MPI_Allreduce``
    of a buffer (mpi4py's pickled ``comm.allreduce`` sends point-to-point messages and two
    broadcasts instead)."""
    if comm.Get_size() == 1:
        return int(value)
    buf = np.array([int(value)], dtype=np.int64)
    comm.Allreduce(MPI.IN_PLACE, buf, op=op)
    return int(buf[0])


def exscan_sum(comm: MPI.Comm, value: int) -> int:
    """Collective. Exclusive prefix sum of an integer over ranks (0 on rank 0)."""
    if comm.Get_size() == 1:
        return 0
    out = comm.exscan(int(value), op=MPI.SUM)
    return 0 if out is None else int(out)


def exchange_by_rank(comm: MPI.Comm, send: np.ndarray, send_counts: np.ndarray, tag: int = 811):
    """Collective. Point-to-point exchange of ``send`` (grouped by destination rank,
    ``send_counts[r]`` items for rank ``r``). Returns ``(recv, recv_counts)``. Use a
    communicator of its own (a ``Dup``) when other messages with ``tag`` may be in flight."""
    size = comm.Get_size()
    recv_counts = np.empty(size, dtype=np.int64)
    comm.Alltoall(np.ascontiguousarray(send_counts, dtype=np.int64), recv_counts)
    so = np.concatenate([[0], np.cumsum(send_counts)]).astype(np.int64)
    ro = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
    recv = np.empty(int(ro[-1]), dtype=send.dtype)
    reqs = [comm.Irecv(recv[ro[r]:ro[r + 1]], source=r, tag=tag)
            for r in range(size) if recv_counts[r]]
    reqs += [comm.Isend(send[so[r]:so[r + 1]], dest=r, tag=tag)
             for r in range(size) if send_counts[r]]
    MPI.Request.Waitall(reqs)
    return recv, recv_counts


def reply_by_rank(comm: MPI.Comm, answer: np.ndarray, recv_counts: np.ndarray, send_counts: np.ndarray,
                  tag: int = 812):
    """Collective. Send ``answer`` (aligned with what :func:`exchange_by_rank` received) back."""
    size = comm.Get_size()
    ro = np.concatenate([[0], np.cumsum(recv_counts)]).astype(np.int64)
    so = np.concatenate([[0], np.cumsum(send_counts)]).astype(np.int64)
    out = np.empty(int(so[-1]), dtype=answer.dtype)
    reqs = [comm.Irecv(out[so[r]:so[r + 1]], source=r, tag=tag) for r in range(size) if send_counts[r]]
    reqs += [comm.Isend(answer[ro[r]:ro[r + 1]], dest=r, tag=tag) for r in range(size) if recv_counts[r]]
    MPI.Request.Waitall(reqs)
    return out


def ownership_offsets(comm: MPI.Comm, n_local: int) -> np.ndarray:
    """Collective. ``(size+1,)`` offsets of contiguous ownership ranges (one Allgather)."""
    counts = np.asarray(comm.allgather(int(n_local)), dtype=np.int64)
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def same_on_all_ranks(comm: MPI.Comm, value: Sequence[int] | int) -> bool:
    """Collective. True when the integer (tuple) ``value`` is identical on every rank."""
    if comm.Get_size() == 1:
        return True
    values = comm.allgather(value)
    return all(v == values[0] for v in values)


from ._process import abort_on_unhandled_exception  # noqa: E402,F401  (kept importable from here)
