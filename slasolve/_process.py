"""Process-level safety under ``mpirun``: PETSc start-up, abort on failure, exit watchdog.

Everything here runs once, at ``import slasolve``, which is therefore
**collective** under ``mpirun`` (every rank imports slasolve, as every rank
imports mpi4py). Three things happen:

1. **PETSc and SLEPc are initialised with the command line**, collectively, when
   petsc4py / slepc4py import: ``petsc4py.init(sys.argv)`` then ``slepc4py.init(sys.argv)``
   (GNU-style ``--long`` options and their values are left out: they are the script's;
   PETSc options take a single dash)
   (unless the program imported ``petsc4py.PETSc`` / ``slepc4py.SLEPc`` first: then
   its own initialisation stands). PETSc's start-up is collective; doing it lazily,
   on the first PETSc use, hangs the job when one rank takes a different path (a
   validation error on one rank) and loses ``-ksp_monitor``, ``-log_view`` etc. from
   the command line. Cost: about 0.07 s (PETSc) + 0.01 s (SLEPc) on top of ~1.4 s for
   importing torch. Without petsc4py nothing happens.

2. **An unhandled exception on any rank aborts the whole job** (when
   ``COMM_WORLD`` has more than one rank): ``sys.excepthook`` prints the traceback
   (through any previously installed hook) and calls ``MPI.COMM_WORLD.Abort(1)``,
   as ``python -m mpi4py script.py`` does. Without it, the other ranks wait forever
   in their next collective. Opt out with ``SLASOLVE_ABORT_ON_EXCEPTION=0`` or
   :func:`abort_on_unhandled_exception(False) <abort_on_unhandled_exception>`.

3. **Exit watchdog** (``atexit``): a rank that reaches the end of the program enters
   a non-blocking barrier (``Ibarrier`` on a private duplicate of ``COMM_WORLD``)
   and waits for every rank to get there. If they do not within
   ``SLASOLVE_EXIT_TIMEOUT`` seconds (default 600; ``0`` = wait forever, the plain
   MPI behaviour), it prints which ranks are missing and what probably happened
   (they wait in a collective this rank never called: ``backward()`` or a solve on
   some ranks only, ``sys.exit()`` on one rank, an exception caught on one rank),
   and calls ``Abort`` with a non-zero status. After ``sys.exit(n)`` with ``n != 0``
   it waits at most 5 s, whatever the timeout (a failing rank should not keep the
   job alive; ranks that all exit together still exit cleanly with their status).
   That part belongs to step 2 and is switched off with it. Python gives ``atexit``
   no exit status, so slasolve wraps ``sys.exit`` to remember it (a ``raise
   SystemExit(n)`` or ``exit(n)`` is treated as a normal exit; a ``sys.exit(n)`` that
   was caught only shortens the wait to 5 s).

   The default is generous because ranks may legitimately finish far apart (rank 0
   writing results after the last collective while the others are done): the
   watchdog only aborts a job whose ranks stay apart for 10 minutes, and it
   tells how to raise the limit. Set ``SLASOLVE_EXIT_TIMEOUT`` higher (or ``0``)
   for programs with long rank-0-only post-processing.

Steps 2 and 3 are no-ops on one rank, in Jupyter/IPython and in interactive
sessions (``python -i``, the REPL).
"""
from __future__ import annotations

import atexit
import builtins
import os
import sys
import time
from typing import Optional

from mpi4py import MPI

__all__ = ["init_petsc", "install", "abort_on_unhandled_exception", "parse_args", "split_petsc_args",
           "petsc_argv"]

ENV_ABORT = "SLASOLVE_ABORT_ON_EXCEPTION"
ENV_TIMEOUT = "SLASOLVE_EXIT_TIMEOUT"
DEFAULT_EXIT_TIMEOUT = 600.0
NONZERO_EXIT_GRACE = 5.0
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


# --------------------------------------------------------------------------- environment
def _interactive() -> bool:
    """Jupyter / IPython kernels, ``python -i`` and the REPL: an exception must not kill
    the session, and the end of the session is no synchronisation point."""
    return (hasattr(builtins, "__IPYTHON__") or "ipykernel" in sys.modules or bool(sys.flags.interactive)
            or hasattr(sys, "ps1"))


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


def petsc_argv(argv) -> list:
    """Local. The part of a command line ``argv`` that PETSc gets: everything but GNU-style
    ``--long`` options (the script's own, e.g. ``--n 8``, ``--version``) and their value.

    PETSc would take ``--n 8`` as its option ``-n``; dropping a ``--long`` token together with
    the non-option token after it keeps PETSc's reading of every single-dash option (a
    value always follows its option directly) unchanged."""
    argv = list(argv)
    out, i = argv[:1], 1
    while i < len(argv):
        tok = argv[i]
        i += 1
        if tok.startswith("--"):
            if "=" not in tok and i < len(argv) and not _petsc_key(argv[i]):
                i += 1
            continue
        out.append(tok)
    return out


def _petsc_argv() -> list:
    # a Jupyter kernel's argv (-f kernel.json) is the kernel's, not the user's
    if _interactive() or not getattr(sys, "argv", None):
        return [sys.executable]
    return petsc_argv(sys.argv)


# --------------------------------------------------------------------------- PETSc
def init_petsc() -> bool:
    """Collective (at import). Initialise PETSc and SLEPc with ``sys.argv`` if petsc4py /
    slepc4py import and the program has not initialised them already. Returns True when
    petsc4py is available."""
    try:
        import petsc4py
    except ImportError:
        return False
    if "petsc4py.PETSc" not in sys.modules:
        petsc4py.init(_petsc_argv())
    from petsc4py import PETSc  # noqa: F401  (initialises PETSc if the user imported petsc4py only)
    try:
        import slepc4py
    except ImportError:
        return True
    if "slepc4py.SLEPc" not in sys.modules:
        slepc4py.init(_petsc_argv())
    from slepc4py import SLEPc  # noqa: F401
    return True


# --------------------------------------------------------------------------- abort on exception
def _abort(status: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
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
    if MPI.COMM_WORLD.Get_size() <= 1 or _interactive():
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
    if MPI.COMM_WORLD.Get_size() <= 1 or _interactive():
        return
    if _env_flag(ENV_ABORT, True):
        _install_hook()
    _state.timeout = _env_timeout()
    if not _state.watchdog:
        _state.comm = MPI.COMM_WORLD.Dup()       # collective: every rank imports slasolve
        atexit.register(_exit_watchdog)          # after PETSc's init: runs before PetscFinalize
        _state.watchdog = True


# --------------------------------------------------------------------------- command lines
def _petsc_key(token: str) -> bool:
    """PETSc's rule (PetscOptionsValidKey): ``-`` or ``--`` followed by a letter."""
    t = token[2:] if token.startswith("--") else token[1:] if token.startswith("-") else ""
    return bool(t) and t[0].isalpha()


def split_petsc_args(args, option_strings=()) -> tuple:
    """Local. Split command-line ``args`` into ``(petsc, rest)``.

    A PETSc option is a single-dash token of more than one letter (``-ksp_monitor``,
    ``-pc_type``, ``-log_view``, ``-help``) that is not one of ``option_strings`` (the
    script's own options); as in PETSc, the next token is its value unless it is
    itself an option (negative numbers are values). Everything else is ``rest``.
    """
    own = set(option_strings)
    petsc, rest, i = [], [], 0
    args = list(args)
    while i < len(args):
        tok = args[i]
        name = tok.split("=", 1)[0]
        if (tok.startswith("-") and not tok.startswith("--") and len(name) > 2 and _petsc_key(tok)
                and name not in own):
            petsc.append(tok)
            if i + 1 < len(args) and not _petsc_key(args[i + 1]) and args[i + 1] != "--":
                petsc.append(args[i + 1])
                i += 1
        else:
            rest.append(tok)
        i += 1
    return petsc, rest


def parse_args(parser, argv=None):
    """Local. ``parser.parse_args`` that lets PETSc options through.

    Single-dash options such as ``-ksp_monitor -ksp_type gmres -log_view`` are left to
    PETSc (which ``import slasolve`` initialised with ``sys.argv``); anything else the
    ``argparse`` ``parser`` does not know is an error (``parser.error``: exit status 2,
    with a hint that PETSc options take one dash). When ``argv`` is given explicitly
    (not read from ``sys.argv``), its PETSc options are put into PETSc's options
    database, as the command line would. Without petsc4py, PETSc options are an error.
    """
    explicit = argv is not None
    args = list(sys.argv[1:] if argv is None else argv)
    own = [s for a in parser._actions for s in a.option_strings]
    petsc, rest = split_petsc_args(args, own)
    ns, unknown = parser.parse_known_args(rest)
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)} "
                     f"(PETSc options take a single dash, e.g. -ksp_monitor)")
    if petsc:
        try:
            from petsc4py import PETSc
        except ImportError:
            parser.error(f"PETSc options {' '.join(petsc)} given, but petsc4py is not installed")
        if explicit:
            import shlex
            PETSc.Options().insertString(" ".join(shlex.quote(a) for a in petsc))
    return ns
