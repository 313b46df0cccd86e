"""Checkpointing schedules for the adjoint of a trajectory, and their optimal costs.

The schedules come from the ``checkpoint_schedules`` package (the field's own: Revolve,
multistage memory + disk; ``pip install checkpoint_schedules``, the ``checkpointing`` extra);
this module turns their actions into plain tuples that :mod:`slasolve.timestepping.trajectory`
executes, and states what the optimum is (Griewank & Walther, ACM TOMS 26 (2000)).

Actions (tuples): ``("forward", n0, n1, write_ics, write_adj_deps, storage)``,
``("reverse", n1, n0, clear_adj_deps)``, ``("copy" | "move", n, from_storage)``,
``("end_forward",)``, ``("end_reverse",)``; storages ``"ram"``, ``"disk"``, ``"work"``.
"""
from __future__ import annotations

from math import comb
from typing import Iterator, Optional, Tuple

__all__ = ["actions", "optimal_recomputations", "full_storage_actions", "REVOLVE_MAX_STEPS"]

#: ``schedule="binomial"`` with memory-only snapshots generates the sequence with
#: ``checkpoint_schedules.Revolve`` up to this many steps (0.1 s at 200 steps, 7 s at 1,000) and
#: with ``MultistageCheckpointSchedule`` beyond (0.01 s at 1,000 steps once numba has compiled
#: it, about 2 s per process): both give the binomial optimum
REVOLVE_MAX_STEPS = 200


def optimal_recomputations(n_steps: int, snapshots: int) -> int:
    """Local. The least number of forward steps recomputed to reverse ``n_steps`` steps with
    ``snapshots`` stored states, the initial state included (binomial checkpointing,
    Griewank & Walther 2000):
    ``t = r n - C(s + r, s + 1)`` for the repetition number ``r``, the least with
    ``C(s + r, s) >= n``. Counted as ``TrajectoryInfo.recomputed_steps`` counts (every
    forward step after the first ``n_steps``; the step before each reverse step included)."""
    n, s = int(n_steps), int(snapshots)
    if n <= 1:
        return 0
    s = max(1, min(s, n - 1))
    r = 1
    while comb(s + r, s) < n:
        r += 1
    return r * n - comb(s + r, s + 1)


def full_storage_actions(n_steps: int) -> Iterator[tuple]:
    """Local. Store every state in the forward sweep; reverse without recomputation."""
    yield ("forward", 0, n_steps, False, True, "work")
    yield ("end_forward",)
    yield ("reverse", n_steps, 0, True)
    yield ("end_reverse",)


def _storage(st) -> str:
    return str(getattr(st, "name", st)).lower()


def actions(n_steps: int, snapshots: Optional[int], snapshots_on_disk: int = 0,
            schedule: str = "binomial") -> Tuple[Iterator[tuple], str]:
    """Local. ``(iterator of actions, description)`` for ``n_steps`` steps with ``snapshots``
    states kept in memory (``None``: full storage) and ``snapshots_on_disk`` on disk.

    ``schedule``: ``"binomial"`` (``checkpoint_schedules.MultistageCheckpointSchedule``,
    Griewank-Walther binomial, memory + disk by Stumm & Walther's multistage rule; for short
    memory-only runs the same optimal sequence from ``checkpoint_schedules.Revolve``, see
    :data:`REVOLVE_MAX_STEPS`) or ``"revolve"`` (``checkpoint_schedules.Revolve``, memory only).
    Raises ImportError, with what to install, when ``checkpoint_schedules`` is missing."""
    if snapshots is None:
        return full_storage_actions(n_steps), "full storage"
    try:
        import checkpoint_schedules as cs
    except ImportError as e:  # pragma: no cover - depends on the installation
        raise ImportError("checkpointed adjoints (checkpoints=...) need the checkpoint_schedules package: "
                          "pip install checkpoint_schedules (or slasolve[checkpointing]); "
                          "checkpoints=None stores every step instead") from e
    if n_steps == 1:
        return full_storage_actions(n_steps), "full storage (1 step)"
    s = min(int(snapshots), n_steps - 1)
    d = min(int(snapshots_on_disk), n_steps - 1 - s) if snapshots_on_disk else 0
    if schedule == "revolve" and d:
        raise ValueError("schedule='revolve' keeps snapshots in memory only; use 'binomial' with "
                         "snapshots_on_disk")
    if schedule == "revolve" or (d == 0 and n_steps <= REVOLVE_MAX_STEPS):
        # the same (optimal) sequence; Revolve's pure-Python generator is quick for short runs,
        # where the multistage generator's numba compilation (~2 s per process) would dominate
        sched = cs.Revolve(n_steps, s)
    else:
        sched = cs.MultistageCheckpointSchedule(n_steps, s, d)
    return _convert(sched, cs), f"{schedule} ({s} in memory, {d} on disk)"


def _convert(sched, cs) -> Iterator[tuple]:
    for a in sched:
        if isinstance(a, cs.Forward):
            yield ("forward", a.n0, a.n1, bool(a.write_ics), bool(a.write_adj_deps), _storage(a.storage))
        elif isinstance(a, cs.Reverse):
            yield ("reverse", a.n1, a.n0, bool(a.clear_adj_deps))
        elif isinstance(a, cs.Copy):
            yield ("copy", a.n, _storage(a.from_storage), _storage(a.to_storage))
        elif isinstance(a, cs.Move):
            yield ("move", a.n, _storage(a.from_storage), _storage(a.to_storage))
        elif isinstance(a, cs.EndForward):
            yield ("end_forward",)
        elif isinstance(a, cs.EndReverse):
            yield ("end_reverse",)
            return
        else:  # pragma: no cover - a schedule type this driver does not know
            raise NotImplementedError(f"checkpoint schedule action {a!r} is not supported")
