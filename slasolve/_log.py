"""PETSc log stages / events for slasolve's phases, and per-phase wall-clock times.

Local (no communication). With petsc4py, ``-log_view`` (or ``PETSc.Log.begin()``)
shows slasolve's work next to PETSc's own events:

========================  ==========================================================
stage                      pushed by
========================  ==========================================================
``slaAssembly``            :class:`slasolve.fem.Assembler` (set-up, matrix / vector assembly)
``slaSolve``               :func:`slasolve.solve` (forward), :func:`slasolve.spsolve`,
                           :func:`slasolve.factorized` and its solves
``slaAdjoint``             the backward pass of :func:`slasolve.solve` / :func:`slasolve.eigsh`
``slaEigsh``               :func:`slasolve.eigsh`
``slaNonlinear``           :func:`slasolve.nonlinear_solve`
========================  ==========================================================

A stage is pushed only by the outermost slasolve call (an inner solve of eigsh's
shift-invert stays in ``slaEigsh``), so the stage times of the summary add up.
Events (``EVENT_NAMES``): ``slaHaloStart`` / ``slaHaloFinish`` (packing and posting,
then waiting and unpacking a halo exchange), ``slaMatCreate`` / ``slaMatRefill`` (a
tensor's values into its cached PETSc Mat; the refill includes the comparison with
the snapshot), ``slaAsmSetup`` / ``slaAssembleMat`` / ``slaAssembleVec``, ``slaSolve``,
``slaSolverSetup`` (KSP / native solver creation), ``slaPCSetUp`` (per-call
preconditioner set-up), ``slaSolveVerify`` (true-residual check), ``slaAdjoint``,
``slaEigsh``, ``slaEigSetup``, ``slaEigSolve``, ``slaEigVerify``, ``slaEigBackward``,
``slaDirect`` (a direct factorisation and/or solve), ``slaNonlinear``.

Every stage and event is registered here, at import (which is collective: every
rank imports slasolve), in one fixed order, so the ids agree across ranks as
``-log_view``'s reductions need (PETSc matches stages and events across ranks by
id). Push / pop and begin / end are local calls, made inside slasolve's collective
functions; a stage used on some ranks only (a one-rank solve of a local matrix under
``mpirun``) is reported as such. Without petsc4py all of this is a no-op.

Cost: an event begin/end pair is ~0.2 us in petsc4py whether logging is on or off;
:class:`phase` adds two ``perf_counter`` calls (~1 us in all).

Phase times: :func:`collect` opens a dictionary that the :class:`phase` blocks run
inside it add their *exclusive* wall time to (a phase nested in another phase of
the same collection is subtracted from the outer one), so the entries never add
up to more than the collection's ``"total"``. A nested :func:`collect` (an inner
solve) keeps its phases to itself; the outer phase that contains it counts it whole.
"""
from __future__ import annotations

import functools
import time
from typing import Callable, Dict, Optional

try:  # slasolve/__init__ has initialised PETSc (with sys.argv) before this import
    from petsc4py import PETSc as _PETSc
except ImportError:  # torch-only install
    _PETSc = None

__all__ = ["STAGE_NAMES", "EVENT_NAMES", "Event", "Stage", "event", "stage", "phase", "collect", "logged",
           "enabled"]

STAGE_NAMES = ("slaAssembly", "slaSolve", "slaAdjoint", "slaEigsh", "slaNonlinear")
EVENT_NAMES = ("slaHaloStart", "slaHaloFinish", "slaMatCreate", "slaMatRefill",
               "slaAsmSetup", "slaAssembleMat", "slaAssembleVec",
               "slaSolve", "slaSolverSetup", "slaPCSetUp", "slaSolveVerify", "slaAdjoint",
               "slaEigsh", "slaEigSetup", "slaEigSolve", "slaEigVerify", "slaEigBackward",
               "slaDirect", "slaNonlinear")


def enabled() -> bool:
    """Local. True when petsc4py is present (stages and events are registered)."""
    return _PETSc is not None


class Event:
    """Local. A registered PETSc log event; ``with ev:`` or ``begin()`` / ``end()``."""

    __slots__ = ("name", "petsc")

    def __init__(self, name: str):
        self.name = name
        self.petsc = _PETSc.Log.Event(name) if _PETSc is not None else None

    def begin(self) -> None:
        if self.petsc is not None:
            self.petsc.begin()

    def end(self) -> None:
        if self.petsc is not None:
            self.petsc.end()

    def __enter__(self):
        if self.petsc is not None:
            self.petsc.begin()
        return self

    def __exit__(self, *exc) -> bool:
        if self.petsc is not None:
            self.petsc.end()
        return False

    def perf_info(self, stage: Optional[str] = None) -> Dict[str, float]:
        """Local. PETSc's counters of this event in ``stage`` (a stage name; default the
        main stage): ``count``, ``time``, ``flops``, ... (all zero without logging)."""
        if self.petsc is None:
            return {}
        sid = _STAGES[stage].petsc.id if stage is not None else 0
        return dict(self.petsc.getPerfInfo(sid))


_depth = [0]   # slasolve stages currently open (only the outermost is pushed)


class Stage:
    """Local. A registered PETSc log stage; ``with st:`` pushes it unless a slasolve stage
    is already open (local; slasolve uses it inside its collective functions)."""

    __slots__ = ("name", "petsc", "_pushed")

    def __init__(self, name: str):
        self.name = name
        self.petsc = _PETSc.Log.Stage(name) if _PETSc is not None else None
        self._pushed = []

    def __enter__(self):
        push = self.petsc is not None and _depth[0] == 0
        if push:
            self.petsc.push()
        self._pushed.append(push)
        _depth[0] += 1
        return self

    def __exit__(self, *exc) -> bool:
        _depth[0] -= 1
        if self._pushed.pop():
            self.petsc.pop()
        return False


# registration at import, in a fixed order (identical ids on every rank)
_STAGES: Dict[str, Stage] = {n: Stage(n) for n in STAGE_NAMES}
_EVENTS: Dict[str, Event] = {n: Event(n) for n in EVENT_NAMES}


def event(name: str) -> Event:
    """Local. The registered event ``name`` (one of ``EVENT_NAMES``)."""
    return _EVENTS[name]


def stage(name: str) -> Stage:
    """Local. The registered stage ``name`` (one of ``STAGE_NAMES``)."""
    return _STAGES[name]


_collections: list = []   # open collect() dictionaries, innermost last
_open: list = []          # open phases, innermost last


class phase:
    """Local. ``with phase("refill", event("slaMatRefill")):`` -- log the event and add the
    block's exclusive wall time to ``times["refill"]`` of the innermost :func:`collect`."""

    __slots__ = ("key", "ev", "times", "t0", "child")

    def __init__(self, key: str, ev: Optional[Event] = None):
        # the PETSc event itself (None: none or no petsc4py): one call less per begin / end
        self.key, self.ev = key, None if ev is None else ev.petsc

    def __enter__(self):
        if self.ev is not None:
            self.ev.begin()
        self.times = _collections[-1] if _collections else None
        self.child = 0.0
        _open.append(self)
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> bool:
        dt = time.perf_counter() - self.t0
        _open.pop()
        times = self.times
        if times is not None:
            key = self.key
            times[key] = times.get(key, 0.0) + dt - self.child
            if _open:
                outer = _open[-1]
                if outer.times is times:
                    outer.child += dt
        if self.ev is not None:
            self.ev.end()
        return False


class collect:
    """Local. ``with collect() as times:`` -- gather the phases run inside into ``times``
    (a dict of seconds); on exit ``times["total"]`` is the block's wall time."""

    __slots__ = ("times", "t0")

    def __enter__(self) -> Dict[str, float]:
        self.times = {}
        _collections.append(self.times)
        self.t0 = time.perf_counter()
        return self.times

    def __exit__(self, *exc) -> bool:
        self.times["total"] = time.perf_counter() - self.t0
        _collections.pop()
        return False


def logged(stage_name: Optional[str] = None, event_name: Optional[str] = None) -> Callable:
    """Local. Decorator: run the function inside the stage (unless a slasolve stage is
    open) and the event. Only for collective functions (the stage push order)."""
    st = stage(stage_name) if stage_name is not None else None
    ev = event(event_name) if event_name is not None else None

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            if st is None:
                with ev:
                    return fn(*args, **kwargs)
            if ev is None:
                with st:
                    return fn(*args, **kwargs)
            with st, ev:
                return fn(*args, **kwargs)
        return wrapper
    return deco
