"""``integrate``: a trajectory of time steps, differentiable with bounded memory.

The forward sweep runs under ``torch.no_grad`` and keeps only what the checkpointing
schedule asks for (:mod:`slasolve.timestepping.checkpointing`): every state (full storage)
or ``s`` snapshots. ``loss.backward()`` then executes the rest of the schedule: it restores
snapshots, recomputes forward steps where needed, and runs one adjoint step per time step
(the problem's ``adjoint``: a transposed solve and products, never a Newton iteration or
a tape of the step). Gradients reach ``u0``, the problem's matrices' values and ``params``.
"""
from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Union

import torch

from .._comm import check_collective
from ..autograd import saved_tensors
from .checkpointing import actions as schedule_actions, optimal_recomputations

__all__ = ["integrate", "TrajectoryInfo"]


@dataclass
class TrajectoryInfo:
    """Local. What :func:`integrate` did (its adjoint fields are filled by the backward).

    Attributes
    ----------
    n_steps, dt, t0 : the integration.
    schedule : str
        ``"full storage"`` or the checkpointing schedule with its snapshot counts.
    snapshots : int or None
        States kept in memory (``None``: all).
    forward_steps : int
        Forward steps run, the backward's recomputations included.
    recomputed_steps : int
        ``forward_steps - n_steps``: steps run again by the backward.
    optimal_recomputed_steps : int or None
        The least possible with this many snapshots (Griewank-Walther binomial bound;
        ``None`` with full storage, where it is 0; 0 for a state-free adjoint).
    adjoint_steps : int
        Adjoint steps run (``n_steps`` after one backward).
    linear_solves, transposed_solves : int
        Solves of the forward (Newton's inner solves for nonlinear problems) and the
        adjoint's transposed solves.
    peak_stored_states : int
        The most states (vectors ``u_n``) held at once by the schedule.
    factorizations : int
        Numeric factorisations made by this integration (``method="direct"``: one per step
        matrix, reused by every forward and adjoint step; 0 for Krylov methods).
    forward_time, backward_time : float
        Seconds on this rank.
    """
    n_steps: int
    dt: float
    t0: float
    schedule: str
    snapshots: Optional[int]
    forward_steps: int = 0
    recomputed_steps: int = 0
    optimal_recomputed_steps: Optional[int] = None
    adjoint_steps: int = 0
    linear_solves: int = 0
    transposed_solves: int = 0
    peak_stored_states: int = 0
    factorizations: int = 0
    forward_time: float = 0.0
    backward_time: float = 0.0
    _stepper: object = field(default=None, repr=False)

    @property
    def recompute_factor(self) -> float:
        """Local. ``forward_steps / n_steps`` (1 with full storage)."""
        return self.forward_steps / self.n_steps if self.n_steps else 1.0


class _Store:
    """Local. Snapshots in memory or on disk (``torch.save`` per rank, a private temp dir)."""

    def __init__(self, rank: int):
        self.ram, self.disk, self.deps = {}, {}, {}
        self._dir = None
        self._rank = rank
        # id(vector) -> how many held states (ram or deps) hold it: n_states in O(1) per step
        # (a scan of every held state each step made full storage quadratic in n_steps)
        self._held: dict = {}

    def _hold(self, state, sign: int) -> None:
        for v in state:
            c = self._held.get(id(v), 0) + sign
            if c:
                self._held[id(v)] = c
            else:
                del self._held[id(v)]

    def set_dep(self, n: int, state) -> None:
        old = self.deps.get(n)
        if old is not None:
            self._hold(old, -1)
        self.deps[n] = tuple(state)
        self._hold(self.deps[n], +1)

    def pop_dep(self, n: int) -> None:
        old = self.deps.pop(n, None)
        if old is not None:
            self._hold(old, -1)

    def put(self, where: str, n: int, state) -> None:
        if where == "disk":
            if self._dir is None:
                self._dir = tempfile.TemporaryDirectory(prefix=f"slasolve-ckpt-{self._rank}-")
            path = os.path.join(self._dir.name, f"{n}.pt")
            torch.save(tuple(s.detach().cpu() for s in state), path)
            self.disk[n] = (path, state[0].device)
        else:
            old = self.ram.get(n)
            if old is not None:
                self._hold(old, -1)
            self.ram[n] = tuple(state)
            self._hold(self.ram[n], +1)

    def get(self, where: str, n: int, delete: bool):
        if where == "disk":
            path, dev = self.disk.pop(n) if delete else self.disk[n]
            state = tuple(s.to(dev) for s in torch.load(path))
            if delete:
                os.remove(path)
            return state
        if delete:
            state = self.ram.pop(n)
            self._hold(state, -1)
            return state
        return self.ram[n]

    def n_states(self, current=()) -> int:
        """Local. Distinct vectors held in memory (a state of depth k shares k-1 vectors with the
        next), ``current`` (the working state) included."""
        return len(self._held) + len({id(v) for v in current if id(v) not in self._held})

    def close(self) -> None:
        self.ram.clear(), self.disk.clear(), self.deps.clear(), self._held.clear()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


class _Run:
    """Local. One integration: the stepper, the schedule's actions and the stores."""

    def __init__(self, stepper, n_steps: int, t0: float, params, actions, info: TrajectoryInfo,
                 outputs_order, comm):
        self.stepper, self.n_steps, self.t0 = stepper, n_steps, t0
        self.actions, self.info, self.comm = actions, info, comm
        self.outputs_order = list(outputs_order)
        self.outputs = set(self.outputs_order)
        self.tensor_idx = [i for i, p in enumerate(params) if isinstance(p, torch.Tensor)]
        self.tensor_params = [params[i] for i in self.tensor_idx]
        self.params = [p.detach() if isinstance(p, torch.Tensor) else p for p in params]
        self.store = _Store(comm.Get_rank())
        self.k = stepper.history
        self.state = None      # (n, state tuple): the current forward state ("work")
        self.collected = {}    # output step -> u

    def param_want(self, want_tensors):
        """Local. Per-param flags (all params) from the flags of the tensor params."""
        flags = [False] * len(self.params)
        for j, i in enumerate(self.tensor_idx):
            flags[i] = bool(want_tensors[j])
        return flags

    def tensor_part(self, per_param):
        """Local. The entries of a per-param list that belong to tensor params."""
        return [per_param[i] for i in self.tensor_idx]

    def forward(self, n0: int, n1: int, write_ics: bool, write_deps: bool, storage: str, first: bool):
        n, state = self.state
        if n != n0:
            raise RuntimeError(f"checkpoint schedule: forward from step {n0}, but the state is at step {n}")
        if write_ics:
            self.store.put(storage, n0, state)
        for m in range(n0, n1):
            if write_deps:
                self.store.set_dep(m, state)
            u = self.stepper.advance(state, m, self.t0, self.params)
            state = (u,) + state[:-1]
            self.info.forward_steps += 1
            if first and (m + 1) in self.outputs:
                self.collected[m + 1] = u
            self._note_peak()
        if write_deps:
            self.store.set_dep(n1, state)
        self.state = (n1, state)
        self._note_peak()

    def _note_peak(self):
        cur = self.store.n_states(() if self.state is None else self.state[1])
        self.info.peak_stored_states = max(self.info.peak_stored_states, cur)


def _adjoint_step(run: _Run, state, u_new, n: int, lam, zero, want_inputs, want_params, g_at):
    """Collective. The adjoint of step ``n`` (``state``, ``u_new``: None for a state-free adjoint):
    the new ``lam`` (``dL/d(u_n, u_{n-1}, ...)``) and this step's input and tensor-param parts."""
    d_state, d_in, d_par = run.stepper.adjoint(state, u_new, n, run.t0, lam[0], run.params, want_inputs,
                                               run.param_want(want_params))
    k = run.k
    new = []
    for i in range(k):     # lam[i + 1] + d_state[i], without adding zeros
        base, d = (lam[i + 1] if i + 1 < k else None), d_state[i]
        new.append(zero if base is None and d is None else base if d is None else d if base is None else base + d)
    if n in g_at:
        new[0] = new[0] + g_at[n]
    run.info.adjoint_steps += 1
    return new, d_in, run.tensor_part(d_par)


def _flush(stepper) -> None:
    """Collective. The stepper's batched solve checks (raise on every rank if one failed)."""
    flush = getattr(stepper, "flush", None)
    if flush is not None:
        flush()


def _want(t) -> bool:
    return isinstance(t, torch.Tensor) and t.requires_grad


class _Trajectory(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, u0, *tensors):
        t_start = time.perf_counter()
        run.state = (0, (u0.detach(),) * run.k)
        if 0 in run.outputs:
            run.collected[0] = u0.detach()
        for a in run.actions:
            if a[0] == "forward":
                run.forward(a[1], a[2], a[3], a[4], a[5], first=True)
            elif a[0] == "end_forward":
                break
            else:  # pragma: no cover - schedules start with forward actions
                raise RuntimeError(f"checkpoint schedule: unexpected action {a} before the end of the forward")
        _flush(run.stepper)
        run.info.forward_time += time.perf_counter() - t_start
        ctx.run = run
        ctx.save_for_backward(u0, *tensors)
        outs = tuple(run.collected[n].clone() for n in run.outputs_order)
        run.collected = {}
        return outs

    @staticmethod
    def backward(ctx, *grads):
        if torch.is_grad_enabled():
            raise RuntimeError("slasolve.timestepping.integrate is differentiable once (backward with "
                               "create_graph=True is not implemented)")
        run: _Run = ctx.run
        saved = saved_tensors(ctx, run.comm, "backward of slasolve.timestepping.integrate")
        if run.actions is None:
            raise RuntimeError("slasolve.timestepping.integrate: the trajectory's adjoint has been run already "
                               "(its checkpoints are freed); integrate again for a second backward")
        t_start = time.perf_counter()
        u0 = saved[0]
        n_inputs = len(run.stepper.inputs())
        want_inputs = [ctx.needs_input_grad[2 + i] for i in range(n_inputs)]
        want_params = [ctx.needs_input_grad[2 + n_inputs + i] for i in range(len(run.tensor_params))]
        g_at = {n: g for n, g in zip(run.outputs_order, grads) if g is not None}
        zero = torch.zeros_like(u0)
        N, k = run.n_steps, run.k
        lam = [g_at.get(N, zero).clone()] + [zero.clone() for _ in range(k - 1)]
        d_inputs = [None] * n_inputs
        d_params = [None] * len(run.tensor_params)

        def acc(total, part):
            return [t if p is None else (p.clone() if t is None else t + p) for t, p in zip(total, part)]

        for a in run.actions:
            kind = a[0]
            if kind == "forward":
                run.forward(a[1], a[2], a[3], a[4], a[5], first=False)
            elif kind in ("copy", "move"):
                run.state = (a[1], run.store.get(a[2], a[1], delete=kind == "move"))
            elif kind == "reverse_free":
                for n in range(a[1] - 1, a[2] - 1, -1):
                    lam, d_in, d_par = _adjoint_step(run, None, None, n, lam, zero, want_inputs, want_params, g_at)
                    d_inputs = acc(d_inputs, d_in)
                    d_params = acc(d_params, d_par)
            elif kind == "reverse":
                n1, n0, clear = a[1], a[2], a[3]
                for n in range(n1 - 1, n0 - 1, -1):
                    state, u_new = run.store.deps[n], run.store.deps[n + 1][0]
                    lam, d_in, d_par = _adjoint_step(run, state, u_new, n, lam, zero, want_inputs, want_params, g_at)
                    d_inputs = acc(d_inputs, d_in)
                    d_params = acc(d_params, d_par)
                    if clear:
                        run.store.pop_dep(n + 1)
                if clear:
                    run.store.pop_dep(n0)
            elif kind == "end_reverse":
                break
        finish = getattr(run.stepper, "adjoint_finish", None)
        if finish is not None:     # the gradients the stepper batches
            d_in, d_par = finish(run.t0, run.params, run.param_want(want_params))
            d_inputs = acc(d_inputs, d_in)
            d_params = acc(d_params, run.tensor_part(d_par))
        _flush(run.stepper)
        run.store.close()
        run.actions = None
        st = run.stepper
        run.info.linear_solves, run.info.transposed_solves = st.linear_solves, st.transposed_solves
        run.info.factorizations = getattr(st, "factorizations", lambda: 0)()
        run.info.recomputed_steps = run.info.forward_steps - N
        run.info.backward_time += time.perf_counter() - t_start
        g_u0 = lam[0]
        for extra in lam[1:]:
            g_u0 = g_u0 + extra
        if g_u0 is zero:
            g_u0 = zero.clone()
        return (None, g_u0 if ctx.needs_input_grad[1] else None, *d_inputs, *d_params)


def integrate(problem, u0: torch.Tensor, *params, dt: float, n_steps: int, t0: float = 0.0,
              outputs: Optional[Sequence[int]] = None, checkpoints: Optional[int] = None,
              snapshots_on_disk: int = 0, schedule: str = "binomial", return_info: bool = False
              ) -> Union[torch.Tensor, List[torch.Tensor], tuple]:
    """Collective. Integrate ``problem`` from ``u0`` over ``n_steps`` steps of ``dt``; differentiable.

    Parameters
    ----------
    problem : LinearTimeProblem or NonlinearTimeProblem
        The equation and its time discretisation.
    u0 : torch.Tensor
        This rank's owned rows of the initial state; may require grad.
    *params
        Passed to the problem's ``source`` / ``residual`` / ``jacobian``; tensors that require
        grad get gradients (this rank's share for a tensor every rank uses identically, as
        :func:`slasolve.nonlinear_solve`).
    dt, n_steps, t0
        Step size, number of steps and initial time (``t_n = t0 + n dt``).
    outputs : sequence of int, optional
        The steps whose states are returned (``0`` is ``u0``), as a list in this order.
        Default: the final state only, returned as a tensor.
    checkpoints : int, optional
        States kept in memory for the adjoint. ``None`` (default): every state (full
        storage, no recomputation). Ignored when the adjoint reads no state (a
        :class:`LinearTimeProblem` whose ``M`` and ``K`` values need no gradient: its adjoint
        steps are transposed solves and products with ``mu`` only), which stores and
        recomputes nothing (``info.schedule`` says so). An int ``s``: a binomial (Revolve) schedule from the
        ``checkpoint_schedules`` package, with the least number of recomputed steps for
        ``s`` snapshots (``info.optimal_recomputed_steps``); memory then grows with ``s``,
        not with ``n_steps``.
    snapshots_on_disk : int
        More snapshots on disk (``schedule="binomial"``: Stumm & Walther's multistage
        memory + disk), one ``torch.save`` file per rank in a private temporary directory.
    schedule : {"binomial", "revolve"}
        ``checkpoint_schedules.MultistageCheckpointSchedule`` or ``checkpoint_schedules.Revolve``
        (memory only); both are optimal for memory-only snapshots.
    return_info : bool
        Also return a :class:`TrajectoryInfo` (its adjoint fields are filled by the backward).

    Returns
    -------
    The final state (``outputs=None``) or the list of states at ``outputs`` (and the info).

    Notes
    -----
    Every setting must agree across ranks (one reduction checks them). The backward runs
    once per ``integrate`` call (the schedule frees its snapshots as it goes); a second
    backward through the same result raises RuntimeError. Gradients with checkpointing are
    those of full storage: recomputed steps repeat the same operations on the same data.

    Examples
    --------
    Heat equation on 5 grid points, Crank-Nicolson, gradient of the final state with
    respect to the initial one through 8 steps with 2 snapshots:

    >>> import scipy.sparse as sp, torch, slasolve
    >>> from slasolve.timestepping import LinearTimeProblem, integrate
    >>> K = slasolve.DSparseTensor.from_global(sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5)).tocsr())
    >>> M = K.with_values((K.values == 2.0).to(torch.float64))   # the identity, K's pattern
    >>> P = LinearTimeProblem(M, K, scheme="cn")
    >>> u0 = torch.ones(K.n_local, dtype=torch.float64, requires_grad=True)
    >>> u, info = integrate(P, u0, dt=0.1, n_steps=8, checkpoints=2, return_info=True)
    >>> slasolve.global_sum(u.sum()).backward()
    >>> info.adjoint_steps, info.recomputed_steps == info.optimal_recomputed_steps
    (8, True)
    """
    comm = getattr(problem, "comm", None)
    err = None
    if comm is None:
        raise TypeError(f"problem must be a LinearTimeProblem or NonlinearTimeProblem, got {type(problem).__name__}")
    out_list = None
    try:
        if not isinstance(u0, torch.Tensor) or u0.dim() != 1:
            raise TypeError(f"u0 must be a 1-D tensor of this rank's owned rows, got "
                            f"{tuple(u0.shape) if isinstance(u0, torch.Tensor) else type(u0).__name__}")
        n_local = getattr(problem, "n_local", None)
        if n_local is not None and u0.shape[0] != n_local:
            raise ValueError(f"u0 must hold this rank's {n_local} owned rows, got {u0.shape[0]}")
        if isinstance(n_steps, bool) or not isinstance(n_steps, int) or n_steps < 1:
            raise ValueError(f"n_steps must be an int >= 1, got {n_steps!r}")
        if not (isinstance(dt, (int, float)) and not isinstance(dt, bool) and dt > 0):
            raise ValueError(f"dt must be a positive number, got {dt!r}")
        if checkpoints is not None and (isinstance(checkpoints, bool) or not isinstance(checkpoints, int)
                                        or checkpoints < 1):
            raise ValueError(f"checkpoints must be None or an int >= 1, got {checkpoints!r}")
        if schedule not in ("binomial", "revolve"):
            raise ValueError(f"schedule must be 'binomial' or 'revolve', got {schedule!r}")
        if outputs is not None:
            out_list = [int(n) for n in outputs]
            if any(n < 0 or n > n_steps for n in out_list) or len(set(out_list)) != len(out_list):
                raise ValueError(f"outputs must be distinct steps in [0, {n_steps}], got {list(outputs)}")
        for i, p in enumerate(params):
            items = p.values() if isinstance(p, dict) else (p if isinstance(p, (list, tuple)) else ())
            if any(isinstance(q, torch.Tensor) and q.requires_grad for q in items):
                raise TypeError(f"params[{i}] holds tensors that require grad inside a {type(p).__name__}; "
                                "pass them as separate params")
    except (TypeError, ValueError) as e:
        err = e
    grad_on = torch.is_grad_enabled()
    tensors = list(problem.inputs())
    needs = grad_on and any(_want(t) for t in [u0] + tensors + [p for p in params if isinstance(p, torch.Tensor)])
    # an adjoint that reads no state (a linear problem whose matrices need no gradient): no snapshots,
    # no recomputation, whatever checkpoints asks for
    needs_states = getattr(problem, "adjoint_needs_states", None)
    state_free = needs and needs_states is not None and not needs_states([grad_on and _want(t) for t in tensors])
    check_collective(comm, err, agree={
        "dt": repr(dt), "n_steps": repr(n_steps), "t0": repr(t0), "outputs": repr(out_list),
        "checkpoints": repr(checkpoints), "snapshots_on_disk": repr(snapshots_on_disk), "schedule": schedule,
        "number of params": len(params), "requires grad": needs,
        "return_info": bool(return_info), "dtype": str(u0.dtype)})
    stepper = problem.begin(dt)
    if hasattr(stepper, "set_steps"):
        stepper.set_steps(n_steps)
    order = [n_steps] if out_list is None else out_list
    if state_free:
        acts = iter([("forward", 0, n_steps, False, False, "work"), ("end_forward",),
                     ("reverse_free", n_steps, 0), ("end_reverse",)])
        desc = "state-free adjoint (no state stored or recomputed)"
    elif needs:
        acts, desc = schedule_actions(n_steps, checkpoints, snapshots_on_disk, schedule)
    else:   # nothing to differentiate: keep the current state only
        acts, desc = iter([("forward", 0, n_steps, False, False, "work"), ("end_forward",)]), "no adjoint"
    info = TrajectoryInfo(n_steps=n_steps, dt=float(dt), t0=float(t0), schedule=desc,
                          snapshots=checkpoints if needs else None, _stepper=stepper)
    if state_free:
        info.optimal_recomputed_steps = 0
    elif needs and checkpoints is not None:
        info.optimal_recomputed_steps = optimal_recomputations(n_steps, min(checkpoints + snapshots_on_disk,
                                                                             max(n_steps - 1, 1)))
    run = _Run(stepper, n_steps, float(t0), params, acts, info, order, comm)
    if needs:
        outs = _Trajectory.apply(run, u0, *tensors, *run.tensor_params)
    else:
        with torch.no_grad():
            outs = _Trajectory.forward(_NoCtx(), run, u0, *tensors)
        run.store.close()
    info.linear_solves = stepper.linear_solves
    info.factorizations = getattr(stepper, "factorizations", lambda: 0)()
    result = outs[0] if out_list is None else list(outs)
    return (result, info) if return_info else result


class _NoCtx:
    """Local. Stands in for an autograd ctx when nothing needs a gradient."""

    def save_for_backward(self, *tensors):
        pass
