"""The ``reuse_pc`` policy of :func:`slasolve.solve`: which solves keep the preconditioner
(or GAMG's prolongators) across value changes, the checks that make it safe (iterations capped,
a failed reusing solve redone with a fresh preconditioner, back-off), and ``"auto"``."""
from __future__ import annotations

import math

__all__ = ["REUSE_MODES", "LAG_GROWTH", "LAG_CAP", "LAG_BACKOFF_MAX", "with_reuse", "check_reuse",
           "resolve_reuse"]

#: ``reuse_pc`` modes besides ``False`` / ``True`` (``"auto"``, the default, picks one per call)
REUSE_MODES = ("lagged", "interpolation")
#: ``reuse_pc="lagged"`` / ``"interpolation"``: once a solve that reused the preconditioner
#: needed more than ``LAG_GROWTH`` times the iterations of the solve right after the last full
#: build, the next solve builds it afresh; a solve that reuses it is stopped after ``LAG_CAP``
#: times those iterations and redone with the preconditioner built for its values
#: after a solve that reused it had to be redone, the next 1, 3, 7, ... (at most
#: ``LAG_BACKOFF_MAX``) forward solves build the preconditioner without trying the kept one
LAG_GROWTH = 1.2
LAG_CAP = 2.0
LAG_BACKOFF_MAX = 15


def with_reuse(solver, run, mode, forward: bool, limit: int, fallback=None, tol=None):
    """Collective. ``run(reuse, other_solver=None, maxiter=None) -> (x, info)`` under the
    ``reuse_pc`` mode ``mode``; ``reuse`` is PETSc's ``KSPSetReusePreconditioner`` flag for
    the call, ``maxiter`` (if given) replaces the call's, whose value is ``limit``.

    Whatever the mode, a reusing solve that does not converge is solved again, from the
    same initial guess, with the preconditioner built from scratch for the current values
    (and if that fails too and ``fallback()`` gives one, by the default-mode solver: the
    interpolation mode's KSP is configured differently). So reuse changes iteration counts
    and set-up times, never the answer, nor whether the call raises.

    ``"lagged"`` and ``"interpolation"`` remember ``base``, the iterations of the forward
    solve right after the last full build. A forward solve that reuses and needs more than
    ``LAG_GROWTH * base`` iterations makes the next forward solve build afresh; it is capped
    at ``ceil(LAG_CAP * base)`` iterations (within ``limit``): a preconditioner that cannot
    do that well is rebuilt at once and the solve redone, so a stale one costs at most that
    many iterations; after such a redo the next 1, 3, 7, ... (consecutive failures; at most
    ``LAG_BACKOFF_MAX``) forward solves build without trying the kept one, so a loop whose
    values jump at every step does not pay the cap at every step. ``"lagged"`` keeps the whole preconditioner (the reuse flag);
    ``"interpolation"`` passes no flag (its GAMG recomputes the coarse operators, keeping
    the prolongators and the smoothers' eigenvalue estimates) and
    builds from scratch with ``reset_pc``. ``True`` keeps it without a cap (PETSc's
    semantics). The adjoint (``forward=False``) runs, uncapped, with whatever the forward
    left (same values: nothing is set up). Decisions use global quantities only (iteration
    counts, convergence), the same on every rank. Iteration counts are compared only between
    solves with the same tolerances ``tol`` (``(rtol, atol)``): a solve with other tolerances
    reuses what is kept, uncapped, and neither judges nor resets ``base``.
    """
    if mode is False:  # a default call forgets the rule's state (it rebuilds for new values)
        solver.reuse_state.clear()
        return run(False)
    state = solver.reuse_state
    reset = getattr(solver, "reset_pc", None)
    base = state.get("base")
    comparable = state.get("tol") == tol   # iteration counts at other tolerances say nothing
    built, cap = False, None
    if forward and mode in REUSE_MODES:
        if base is None or state.get("skip", 0) > 0:
            state["skip"] = max(state.get("skip", 0) - 1, 0)
            if mode == "interpolation" and state.get("used") and reset is not None:
                reset()  # prolongators from scratch for these values
            built = True
        elif comparable:
            cap = min(limit, math.ceil(LAG_CAP * max(base, 1)))
    x, info = run(mode is True or (mode == "lagged" and not built), None, cap)
    state["used"] = True
    retried, discarded = False, 0
    if not info.converged:
        if reset is not None:
            reset()
        x2, info2 = run(False)
        if not info2.converged and fallback is not None:
            x2, info2 = run(False, fallback())
        x, info, built, retried, discarded = x2, info2, True, True, info.iterations
    if cap is not None:  # back off after a kept preconditioner failed: the next 1, 3, 7, ... build
        state["fails"] = state.get("fails", 0) + 1 if retried else 0
        state["skip"] = min(2 ** state["fails"] - 1, LAG_BACKOFF_MAX)
    if built and forward and mode in REUSE_MODES:
        state["base"], state["tol"] = info.iterations, tol
    elif forward and mode in REUSE_MODES and base is not None and comparable and \
            info.iterations > LAG_GROWTH * max(base, 1):
        state.pop("base", None)  # slower than LAG_GROWTH x base: the next forward builds afresh
    elif built:
        state.pop("base", None)  # built in the backward (or under True): the next forward starts over
    info.pc_reuse = {"mode": mode, "rebuilt": built, "retried": retried, "discarded_iterations": discarded}
    return x, info


def check_reuse(reuse_pc):
    """Local. The problem with ``reuse_pc``, or None."""
    if isinstance(reuse_pc, bool) or (isinstance(reuse_pc, str) and reuse_pc in REUSE_MODES + ("auto",)):
        return None
    return ValueError(f"reuse_pc must be 'auto', False, True, 'lagged' or 'interpolation', got {reuse_pc!r}")


def resolve_reuse(reuse_pc, backend: str, pc):
    """Local. The mode ``reuse_pc="auto"`` stands for: ``"interpolation"`` for GAMG on the
    petsc backend (the prolongators kept across value changes, checked and rebuilt by
    :func:`with_reuse`'s rules), else ``False``; any other value as given."""
    if reuse_pc == "auto":
        return "interpolation" if backend == "petsc" and pc == "gamg" else False
    if reuse_pc == "interpolation" and backend != "petsc":
        return False  # no prolongators to keep
    return reuse_pc
