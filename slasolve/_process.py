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

4. **One torch thread per core, not per core per rank**: with more than one rank and no
   ``OMP_NUM_THREADS`` in the environment, each rank gets ``max(1, cpus // ranks on its
   node)`` torch threads (``slasolve/_threads.py``; ``SLASOLVE_TORCH_THREADS=k`` sets ``k``,
   ``=0`` leaves torch alone). One process is never changed.
"""
from __future__ import annotations

from ._argv import parse_args, petsc_argv, split_petsc_args
from ._faults import abort_on_unhandled_exception, install
from ._startup import init_petsc
from ._threads import set_torch_threads

__all__ = ["init_petsc", "set_torch_threads", "install", "abort_on_unhandled_exception", "parse_args", "split_petsc_args",
           "petsc_argv"]
