"""Abort on an unhandled exception and the exit watchdog under ``mpirun`` (steps 2 and 3 of
:mod:`slasolve._process`)."""
from __future__ import annotations

import atexit
import os
import sys
import time
from typing import Optional

from mpi4py import MPI

from ._argv import interactive

__all__ = ["install", "abort_on_unhandled_exception", "exit_status", "restore_exit_status"]

ENV_ABORT = "SLASOLVE_ABORT_ON_EXCEPTION"
ENV_TIMEOUT = "SLASOLVE_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT = 600.0
NONZERO_EXIT_GRACE = 5.0
ABORT_GRACE = 0.3   # seconds between printing the traceback and MPI_Abort
_TAG_ASK, _TAG_HERE = 7301, 7302


class _State:
    abort = False            # excepthook installed and sys.exit(n != 0) aborts
    previous_hook = None     # the hook ours chains to
    original_exit = None     # sys.exit before we wrapped it
    exit_status = None       # last status given to sys.exit (a hint, see _exit_watchdog)
    watchdog = False         # atexit barrier registered
    comm: Optional[MPI.Comm] = None   # private duplicate of COMM_WORLD
    requests: list = []      # roll-call sends in flight (kept alive until exit)
    timeout = DEFAULT_EXIT_TIMEOUT


_state = _State()


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    return value not in ("0", "false", "no", "off")


def _env_timeout() -> float:
    value = os.environ.get(ENV_TIMEOUT, "").strip()
    if not value:
        return DEFAULT_EXIT_TIMEOUT
    try:
        t = float(value)
        if t != t:
            raise ValueError("nan")
    except ValueError:
        print(f"slasolve: ignoring {ENV_TIMEOUT}={value!r} (not a number of seconds); "
              f"using {DEFAULT_EXIT_TIMEOUT:g}", file=sys.stderr)
        return DEFAULT_EXIT_TIMEOUT
    return max(t, 0.0)


def _abort(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    # the launcher forwards a rank's output asynchronously and MPI_Abort kills it with the job:
    # without a moment's grace the traceback was cut to its first line in 1 of 6 MPICH runs
    time.sleep(ABORT_GRACE)
    MPI.COMM_WORLD.Abort(int(status) if status else 1)


def _excepthook(kind, value, tb) -> None:
    try:
        (_state.previous_hook or sys.__excepthook__)(kind, value, tb)
    except Exception:  # noqa: BLE001 - a broken chained hook must not stop the abort
        sys.__excepthook__(kind, value, tb)
    if not _state.abort:
        return
    rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
    print(f"slasolve: unhandled {kind.__name__} on rank {rank} of {size}: aborting the MPI job "
          f"(opt out: {ENV_ABORT}=0)", file=sys.stderr)
    _abort(130 if issubclass(kind, KeyboardInterrupt) else 1)


def _exit(status=None):
    """``sys.exit`` that remembers its status for the exit watchdog."""
    _state.exit_status = status
    return _state.original_exit(status)


def exit_status():
    """Local. The status last given to ``sys.exit`` (None: none), which the exit watchdog reads."""
    return _state.exit_status


def restore_exit_status(status) -> None:
    """Local. Put back the status recorded before a ``sys.exit`` that was raised and caught (a
    library calling ``sys.exit`` inside a ``try``): it was no exit."""
    _state.exit_status = status


def _exit_code(status) -> int:
    if status is None:
        return 0
    if isinstance(status, bool) or not isinstance(status, int):
        return 1                       # sys.exit("message") exits with 1
    return status


def _install_hook() -> None:
    if sys.excepthook is not _excepthook:
        _state.previous_hook = sys.excepthook
        sys.excepthook = _excepthook
    if sys.exit is not _exit:
        _state.original_exit = sys.exit
        _exit.__doc__ = sys.exit.__doc__
        sys.exit = _exit
    _state.abort = True


def _remove_hook() -> None:
    _state.abort = False
    if sys.excepthook is _excepthook:
        sys.excepthook = _state.previous_hook or sys.__excepthook__
    if sys.exit is _exit and _state.original_exit is not None:
        sys.exit = _state.original_exit


def abort_on_unhandled_exception(enable: bool = True, comm: Optional[MPI.Comm] = None) -> None:
    """Local. Make an unhandled exception (or ``sys.exit(n)``, ``n != 0``) on any rank abort
    the whole MPI job -- **the default** since ``import slasolve`` under ``mpirun``.

    With more than one rank in ``COMM_WORLD``, ``import slasolve`` installs a
    ``sys.excepthook`` that prints the traceback (through the hook that was installed
    before, so custom hooks keep working) and then calls ``MPI.COMM_WORLD.Abort(1)``
    (status 130 for ``KeyboardInterrupt``), as ``python -m mpi4py script.py`` does.
    Without it, a rank that dies of an exception leaves the others waiting forever
    in their next collective. A ``sys.exit(n)`` with ``n != 0`` on one rank aborts the
    job with status ``n`` after at most 5 s (ranks that all exit together exit
    cleanly); see :mod:`slasolve._process` for the exit watchdog, which also catches
    ``sys.exit(0)`` / the end of the script on some ranks only.

    Opt out before the import with the environment variable
    ``SLASOLVE_ABORT_ON_EXCEPTION=0``, or at run time with
    ``abort_on_unhandled_exception(False)`` (restores the previous ``sys.excepthook``).
    ``abort_on_unhandled_exception()`` re-enables it (idempotent: the hook is never
    installed twice). A no-op on one rank and in Jupyter/IPython or interactive
    sessions.

    Parameters
    ----------
    enable : bool
        True to install the hook, False to remove it.
    comm : mpi4py.MPI.Comm, optional
        Accepted for compatibility; the job is aborted through ``COMM_WORLD``.
    """
    if isinstance(enable, MPI.Comm):   # old signature: abort_on_unhandled_exception(comm)
        enable, comm = True, enable
    if not enable:
        _remove_hook()
        return
    if MPI.COMM_WORLD.Get_size() <= 1 or interactive():
        return
    _install_hook()


# --------------------------------------------------------------------------- exit watchdog
def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    parts, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        parts.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    if len(parts) > 20:
        parts = parts[:20] + ["..."]
    return ", ".join(parts)


def _answer_roll_calls(comm: MPI.Comm) -> None:
    status = MPI.Status()
    while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_ASK, status=status):
        comm.recv(source=status.Get_source(), tag=_TAG_ASK)
        _state.requests.append(comm.isend(comm.Get_rank(), dest=status.Get_source(), tag=_TAG_HERE))


def _roll_call(comm: MPI.Comm, wait: float = 1.0) -> set:
    """Ranks (other than this one) that answer from their own exit watchdog within ``wait`` s."""
    me, size = comm.Get_rank(), comm.Get_size()
    for r in range(size):
        if r != me:
            _state.requests.append(comm.isend(me, dest=r, tag=_TAG_ASK))
    here, t0 = set(), time.monotonic()
    while len(here) < size - 1 and time.monotonic() - t0 < wait:
        _answer_roll_calls(comm)
        while comm.Iprobe(source=MPI.ANY_SOURCE, tag=_TAG_HERE):
            here.add(comm.recv(source=MPI.ANY_SOURCE, tag=_TAG_HERE))
        time.sleep(0.01)
    return here


def _exit_watchdog() -> None:
    comm = _state.comm
    if comm is None or MPI.Is_finalized():
        return
    code = _exit_code(_state.exit_status)
    timeout = _state.timeout
    if code != 0 and _state.abort:
        timeout = min(timeout, NONZERO_EXIT_GRACE) if timeout > 0 else NONZERO_EXIT_GRACE
    if timeout <= 0:
        return
    req = comm.Ibarrier()
    t0, nap = time.monotonic(), 0.001
    while not req.Test():
        _answer_roll_calls(comm)
        if time.monotonic() - t0 > timeout:
            _report_and_abort(comm, code, timeout)
        time.sleep(nap)
        nap = min(2 * nap, 0.05)


def _report_and_abort(comm: MPI.Comm, code: int, timeout: float) -> None:
    me, size = comm.Get_rank(), comm.Get_size()
    missing = sorted(set(range(size)) - _roll_call(comm) - {me})
    how = "ended normally" if code == 0 else f"called sys.exit({_state.exit_status!r})"
    msg = (f"slasolve: rank {me} of {size} {how}, but rank(s) {_ranks_text(missing) or '?'} did not reach "
           f"the end of the program within {timeout:g} s. They are probably blocked in a collective "
           f"operation that this rank never called (an MPI call, a solve, eigsh, backward(), ...): "
           f"typically a branch on the rank (e.g. loss.backward() or sys.exit() on some ranks only) "
           f"or an exception caught on one rank. Aborting the job (MPI_Abort).")
    if code == 0:
        msg += (f" If the ranks legitimately finish this far apart, set {ENV_TIMEOUT} to more seconds "
                f"(0 waits forever).")
    print(msg, file=sys.stderr)
    _abort(code if code != 0 else 1)


# --------------------------------------------------------------------------- install at import
def install() -> None:
    """Collective (at import). Set up steps 2 and 3 of the module doc on ``COMM_WORLD``."""
    if MPI.COMM_WORLD.Get_size() <= 1 or interactive():
        return
    if _env_flag(ENV_ABORT, True):
        _install_hook()
    _state.timeout = _env_timeout()
    if not _state.watchdog:
        _state.comm = MPI.COMM_WORLD.Dup()       # collective: every rank imports slasolve
        atexit.register(_exit_watchdog)          # after PETSc's init: runs before PetscFinalize
        _state.watchdog = True
