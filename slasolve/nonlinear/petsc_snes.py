"""PETSc SNES backend: ``newtonls`` (line search ``bt`` by default) driving the torch functions.

With a Jacobian, the SNES (with its KSP, PC, Vecs and Jacobian Mat) is kept on the Jacobian's
layout per settings (``RowLayout.cached("nonlinear_solvers", ...)``, ``SNES_CACHE_SIZE`` of them):
every setting that configures it (tolerances, ``maxiter``, line search, ``linear_solver``,
``petsc_options``, ``options_prefix``) is in the key, so a later call with the same settings
reuses it and one with other settings gets its own; the options database is read when it is
made, as for :func:`slasolve.solve`'s kept KSPs. Only the callbacks (the residual, Jacobian and
parameters of this call) change per call, and they are dropped when the call ends. Without a
Jacobian (matrix-free) a SNES is made per call. Each is configured in this order:
type ``newtonls``, the line search, tolerances (``rtol``, ``atol``, ``stol``, ``max_it``;
no function-evaluation limit, no divergence tolerance), the inner KSP from
``linear_solver`` (``method`` -> KSP type as in :func:`slasolve.solve`, ``"direct"`` ->
``preonly`` + MUMPS LU; ``pc``; inner ``rtol`` default ``1e-10``), then
``setFromOptions`` with ``petsc_options`` in the options database only for that call
(:func:`slasolve.petsc.temporary_options`): ``-snes_*`` / ``-ksp_*`` / ``-pc_*`` on the
command line or in ``petsc_options`` override the keyword arguments, as in PETSc.

GAMG keeps its prolongators from one Newton step's tangent to the next, and from the last
tangent of one call to the first of the next on a kept SNES (``-pc_gamg_reuse_interpolation
true``, PETSc's default, as DOLFINx's ``NewtonSolver`` keeps them) unless the options say
otherwise; if a linear solve then fails (``DIVERGED_LINEAR_SOLVE``), the kept SNES is dropped and
the whole solve is redone from ``u0`` with GAMG rebuilt for every tangent, so keeping them never
turns a solve that converges into a failure.

Callbacks: the residual callback converts PETSc's ``X`` to a torch tensor (u0's dtype),
evaluates ``residual`` (no autograd) and writes ``F``; the Jacobian callback evaluates
``jacobian`` and writes its values into the SNES's own AIJ Mat created from a first
Jacobian (``fill_petsc_mat``: an O(nnz) copy, no cache whose snapshot could go stale); on several
ranks that Mat carries ``MAT_NO_OFF_PROC_ENTRIES`` (only owned rows are ever written: its
assembly makes no reduction; a write to another rank's row raises in PETSc).
For a :mod:`slasolve.fem` problem's own ``residual`` / ``jacobian`` (float64, CPU) the callbacks
run the problem's NumPy kernels instead
(:meth:`slasolve.fem.NonlinearProblem.iterate_kernels`: the same operations and collectives),
which write the residual straight into ``F``'s array and the tangent's values into the Mat's
AIJ arrays, with no torch tensor and no layer of checks per call (81 unknowns: a residual or
tangent in ~0.4x the methods' time, measured side by side); ``F(u0)`` and ``J(u0)`` too, by
SNES's own first callbacks (as a raw petsc4py SNES on the same kernels) after one collective
check of ``u0`` and the parameters (:meth:`slasolve.fem.NonlinearProblem.start_kernels`, as the
methods check them), the SNES found by the kernels' template (the Jacobian's layout).
Without a Jacobian, SNES runs matrix-free (``SNESSetUseMF``: PETSc's MFFD ``J v``, no
preconditioner). Errors raised by slasolve's checks inside a callback are raised on
every rank (the checks are collective), stop SNES and are re-raised from the solve.

"Converged" is re-checked at exit: the reported ``residual_norm`` is ``||F(u)||`` of the
returned ``u`` (SNES's own norm of its function Vec where ``newtonls`` with ``bt`` / ``basic``
left ``F(u)`` there at its last monitor call and nothing changed since, which PETSc keeps cached:
no reduction; else SNES's last residual evaluation when it was at ``u`` on every rank; else one
more evaluation); a converged SNES reason whose
residual fails ``max(rtol ||F(u0)||, atol)`` (``CONVERGED_ITS`` of ``-snes_type ksponly`` on a
nonlinear problem) becomes ``DIVERGED_MAX_IT``, one that passes is named by the residual
test (``CONVERGED_FNORM_RELATIVE`` / ``_ABS``).
"""
from __future__ import annotations

import math
import time
import weakref
from typing import Callable, NamedTuple, Optional

import numpy as np
import torch
from mpi4py import MPI

from .._comm import allreduce_int, check_collective, options_key
from ..sparse import all_finite
from ..petsc import PETSc, fill_petsc_mat, garbage_cleanup, option_entries, temporary_options
from ..registry import petsc_method_name
from .info import NonlinearInfo
from .problem import global_norm
from .torch_newton import inner_rtol_default

__all__ = ["snes_solve", "KeptTangent", "adjoint_solve_kept"]

_REASONS = {}
for _name in dir(PETSc.SNES.ConvergedReason):
    if _name.isupper() and _name.startswith(("CONVERGED", "DIVERGED")):
        _REASONS[int(getattr(PETSc.SNES.ConvergedReason, _name))] = _name
# defaults slasolve sets only where the options database has no entry
_DEFAULT_ENTRIES = {"snes_divergence_tolerance": "-1", "pc_gamg_reuse_interpolation": "true"}
# GAMG keeps its prolongators from one Newton step's tangent to the next (PETSc's default; 15-30%
# of a forward); should a linear solve then fail, the whole solve is redone with GAMG rebuilt for
# every tangent (these entries), so kept prolongators never cause a failure the rebuild avoids
_REBUILD_ENTRIES = {"pc_gamg_reuse_interpolation": "false"}
_EPS64 = float(np.finfo(np.float64).eps)


def database_key(options_prefix: Optional[str]) -> tuple:
    """Local. The options database entries a SNES reads (``snes_*``, ``ksp_*``, ``pc_*``,
    ``mat_*`` under ``options_prefix``), sorted: part of the kept SNES's key, so an entry set
    or removed between calls (``PETSc.Options().setValue``) gets a SNES configured with it.
    ``nonlinear_solve`` checks that every rank has the same."""
    entries = PETSc.Options().getAll()
    # the whole database unchanged since the latest call with this prefix: the same key (exact, no
    # change counter needed: a dict comparison in C)
    hit = _DATABASE_KEYS.get(options_prefix)
    if hit is not None and hit[0] == entries:
        return hit[1]
    head = options_prefix or ""
    names = tuple(head + p for p in ("snes_", "ksp_", "pc_", "mat_"))
    key = tuple(sorted((k, str(v)) for k, v in entries.items() if k.startswith(names)))
    if len(_DATABASE_KEYS) >= 8 and options_prefix not in _DATABASE_KEYS:
        _DATABASE_KEYS.clear()
    _DATABASE_KEYS[options_prefix] = (entries, key)
    return key


#: per options prefix: (the whole options database as PETSc.Options().getAll() gave it, its key)
_DATABASE_KEYS: dict = {}


def _linear_method_name(ksp_type: str) -> str:
    return "direct" if ksp_type == "preonly" else petsc_method_name(ksp_type)


def _reason(code: int) -> str:
    name = _REASONS.get(int(code))
    if name is None:
        return "DIVERGED_LINEAR_SOLVE" if int(code) < 0 else "CONVERGED_ITERATING"
    return name


def _configure_ksp(ksp, ls: dict, comm_size: int, n_global: int, matrix_free: bool) -> None:
    from ..krylov.petsc_backend import configure_ksp, configure_pc
    from ..krylov.torch_methods import default_maxiter
    method = ls.get("method", "gmres")
    if method == "direct":
        ksp.setType("preonly")
        configure_pc(ksp.getPC(), "lu", comm_size)
    else:
        configure_ksp(ksp, method, int(ls.get("restart", 30)))
        configure_pc(ksp.getPC(), "none" if matrix_free else ls.get("pc"), comm_size)
    maxiter = ls.get("maxiter")
    ksp.setTolerances(rtol=float(ls["rtol"]), atol=float(ls.get("atol", 0.0)), divtol=1e300,
                      max_it=default_maxiter(n_global) if maxiter is None else int(maxiter))


def _write_values(P, csr, slot, dJ) -> None:
    """Collective (the first call on ``slot``: it makes the writer). ``dJ``'s values into the AIJ
    Mat ``P`` of the pattern ``csr`` (checked by the caller): every entry is overwritten, in
    PETSc's arrays where the writer of ``slot`` (a :class:`_Solver`) applies (as the linear
    path's refill), else by INSERT; then assembled."""
    vals = dJ.values.detach()
    vals = vals if vals.dtype == torch.float64 else vals.to(torch.float64)
    if slot is not None and slot.writer is False:
        from ..petsc import aij_value_writer
        slot.writer = aij_value_writer(P, dJ)   # collective: on every rank's first refill
    _write_array(P, csr, None if slot is None else slot.writer, vals)


#: below this many local entries MatSetValuesCSR refills the Jacobian Mat faster than the writer
#: into its arrays (fixed cost ~40 us: 497 entries 12 vs 44 us, 29k entries 960 vs 128 us)
_CSR_BELOW = 1024


def _write_array(P, csr, writer, vals: torch.Tensor) -> None:
    """Collective (the assembly). The float64 CPU values ``vals`` of the pattern ``csr`` into the
    AIJ Mat ``P``, by ``writer`` (an ``aij_value_writer`` or None) where it applies and is the
    faster, else by INSERT; then assembled."""
    if writer is None or vals.numel() < _CSR_BELOW or not writer.write(vals):
        P.setValuesCSR(csr[0], csr[1], vals.numpy(), PETSc.InsertMode.INSERT_VALUES)
    P.assemble()


class _Callbacks:
    """SNES function / Jacobian / monitor callbacks (state per solve). A problem inside them is
    checked collectively where it happens (raised on every rank): PETSc 3.18's line search decides
    some NaN cases per rank, so handing it NaNs from one rank's failed residual (a deferred check)
    desynchronises the ranks -- seen as a hang at 2 ranks."""

    def __init__(self, prob, dtype, progress, callback, u0, r0, J0, csr=None, X=None, mat_slot=None):
        self.prob, self.dtype = prob, dtype
        self.csr = csr     # (indptr, indices) of the Mat in PETSc's int type, or None
        self.mat_slot = mat_slot   # the _Solver: its Jacobian Mat's value writer, made at the first refill
        self.error = None      # raised inside a callback on every rank (a collective check)
        self.hist, self.totals = [], []   # ||F|| at each monitor call; SNES's linear iterations so far, each step
        self.progress, self.callback = progress, callback
        self.report = bool(progress) or callback is not None
        # F(u0) and J(u0), already evaluated: used once each when SNES asks at exactly u0
        self.u0, self.r0, self.J0 = u0, r0, J0
        # SNES's solution Vec holding u0: (handle, state) right after u0 was written. SNES changes
        # it only by Vec operations every rank makes, so "unchanged" is the same on every rank
        # and needs no reduction
        self.x0 = None if X is None else (X.handle, X.stateGet())
        # SNES's solution and function Vecs (X, and the F its function was set with)
        self.vecs = None if X is None or mat_slot is None else (X, mat_slot.F)
        self.last = None   # (u, F(u)) of the latest function evaluation
        self.evaluations = 0   # function callbacks so far (the same count on every rank)
        # at the latest monitor call: (evaluations, X's and F's handles and states), see final_norm
        self.at_monitor = None
        self.last_objective = None   # (u, objective(u)) of the latest objective evaluation
        # the problem's NumPy kernels for SNES's own iterates (Problem.iterate_kernels), set once the
        # evaluations at u0 passed their checks: (residual_into, tangent_values) or None
        self.kernels = None

    def _u(self, X) -> torch.Tensor:
        u = torch.from_numpy(X.getArray(readonly=True).copy())
        return u if self.dtype == torch.float64 else u.to(self.dtype)

    def _at_u0(self, X) -> bool:
        """Local, the same on every rank: is ``X`` SNES's solution Vec, unchanged since it got u0?"""
        return self.x0 is not None and X.handle == self.x0[0] and X.stateGet() == self.x0[1]

    def function(self, snes, X, F) -> None:
        self.evaluations += 1
        if self.r0 is not None and self._at_u0(X):
            u, r = self.u0, self.r0
        elif self.kernels is not None:
            # straight into F's array: no tensors, no checks beyond the kernel's own (collective)
            x = X.getArray(readonly=True).copy()
            f = F.getArray()
            try:
                self.prob.nfev += 1
                self.kernels[0](x, f)
                self.last = (torch.from_numpy(x), torch.from_numpy(f.copy()))
            except Exception as e:
                self.error = self.error or e
                raise
            finally:
                del f   # restores F's array (its state moves: PETSc recomputes its norm)
            self.r0 = None
            return
        else:
            u = self._u(X)
            try:
                r = self.prob.residual(u)
            except Exception as e:  # a collective check (raised on every rank) or the user's error
                self.error = self.error or e
                raise
        self.r0 = None
        self.last = (u, r)
        F.setArray(r.numpy() if r.dtype == torch.float64 else r.to(torch.float64).numpy())

    def jacobian(self, snes, X, J, P) -> None:
        try:
            if self.J0 is not None and self._at_u0(X):
                dJ = self.J0
            elif self.kernels is not None and self.csr is not None and self.mat_slot is not None and \
                    self.mat_slot.writer is not False:   # the Mat's writer made (by the Jacobian at u0)
                self.prob.njev += 1
                vals = self.kernels[1](X.getArray(readonly=True).copy())
                self.J0 = None
                _write_array(P, self.csr, self.mat_slot.writer, torch.from_numpy(vals))
                if J.handle != P.handle:
                    J.assemble()
                return
            else:
                dJ = self.prob.jacobian(self._u(X))
            self.J0 = None
        except Exception as e:
            self.error = self.error or e
            raise
        if self.csr is not None:
            _write_values(P, self.csr, self.mat_slot, dJ)
        else:
            fill_petsc_mat(P, dJ.to(torch.float64))
        if J.handle != P.handle:
            J.assemble()

    def objective(self, snes, X) -> float:
        u = self._u(X)
        try:
            # the line search asks at the accepted point of its previous call again: reuse that
            # value when u is the same on every rank (one small Allreduce against the objective's own)
            if self.last_objective is not None and self._same_everywhere(u, self.last_objective[0]):
                return self.last_objective[1]
            val = self.prob.objective(u)
        except Exception as e:
            self.error = self.error or e
            raise
        self.last_objective = (u, val)
        return val

    def _same_everywhere(self, u: torch.Tensor, v: torch.Tensor) -> bool:
        """Collective (one small Allreduce): is ``u == v`` on every rank?"""
        from .._comm import allreduce_max
        differs = not torch.equal(u, v)
        return not bool(allreduce_max(self.prob.comm, torch.tensor([float(differs)]))[0])

    def _state(self, snes) -> tuple:
        if self.vecs is None:
            X, F = snes.getSolution(), snes.getFunction()[0]
            return self.evaluations, X.handle, X.stateGet(), F.handle, F.stateGet()
        # SNES's own X and F (the Python objects SNES was given: their handles cannot change)
        return self.evaluations, self.vecs[0].stateGet(), self.vecs[1].stateGet()

    def final_norm(self, snes, method: str, line: Optional[str]) -> Optional[float]:
        """Collective (no communication where PETSc has the norm cached). ``||F(u)||`` of SNES's
        solution ``u`` from SNES's own function Vec, or None (decided alike on every rank): when the
        SNES is ``newtonls`` with the ``bt`` or ``basic`` line search computing norms (``line``:
        None where ``-snes_linesearch_norms false`` turned them off), which leave ``F = F(X)`` in
        SNES's Vecs at every monitor call, and neither Vec changed nor the function was evaluated
        since the last one. The Vecs' states move only by operations every rank makes (Vec
        operations, the callbacks' array writes), so the answer needs no reduction; ``F.norm()``
        returns the norm the line search computed (PETSc caches it on the Vec until the Vec
        changes) or computes it, on every rank alike."""
        if method != "newtonls" or line not in ("bt", "basic") or self.at_monitor is None or \
                self.at_monitor != self._state(snes):
            return None
        return float((self.vecs[1] if self.vecs is not None else snes.getFunction()[0]).norm())

    def monitor(self, snes, its, fnorm) -> None:
        vecs = self.vecs
        self.at_monitor = self._state(snes) if vecs is None else \
            (self.evaluations, vecs[0].stateGet(), vecs[1].stateGet())   # _state, inline (per step)
        self.hist.append(fnorm)   # a Python float (petsc4py's)
        if its > 0:
            self.totals.append(snes.getLinearSolveIterations())
            if self.report:
                self._report(snes, its, fnorm)

    def _report(self, snes, its, fnorm) -> None:
        if self.progress and snes.getComm().tompi4py().Get_rank() == 0:
            print(f"  Newton {its:3d}  residual {fnorm:.3e}  ({self.lits[-1]} linear iterations)", flush=True)
        if self.callback is not None:
            self.callback(int(its), float(fnorm))

    @property
    def lits(self) -> list:
        """Local. The linear iterations of each Newton step (from SNES's running totals)."""
        t = [0] + self.totals
        return [int(b - a) for a, b in zip(t, t[1:])]


class _KernelCallbacks(_Callbacks):
    """:class:`_Callbacks` of a solve whose residual and tangent are a :mod:`slasolve.fem` problem's
    NumPy kernels (:meth:`Problem.start_kernels`) from ``u0`` on, ``u0``'s evaluations included (as
    a raw petsc4py SNES on the same kernels): the residual straight into ``F``'s array, the tangent's
    values into the Mat; no tensors, no checks beyond the kernels' own (collective)."""

    def __init__(self, prob, progress, callback, kernels, csr, X, solver):   # noqa: D107 - no super(): fewer fields
        self.prob, self.dtype, self.csr, self.mat_slot = prob, torch.float64, csr, solver
        self.error = self.last = self.at_monitor = self.last_objective = None
        self.hist, self.totals = [], []
        self.evaluations = 0
        self.progress, self.callback = progress, callback
        self.report = bool(progress) or callback is not None
        self.vecs = (X, solver.F)
        self.residual_into, self.tangent_values = kernels
        self.writer = solver.writer

    def function(self, snes, X, F) -> None:
        self.evaluations += 1
        x = X.getArray(readonly=True).copy()
        f = F.getArray()
        try:
            self.prob.nfev += 1
            self.residual_into(x, f)
            self.last = (x, f.copy())   # NumPy: tensors only where snes_solve needs them
        except Exception as e:   # the kernels' checks are collective: raised on every rank
            self.error = self.error or e
            raise
        finally:
            del f   # restores F's array (its state moves: PETSc recomputes its norm)

    def jacobian(self, snes, X, J, P) -> None:
        try:
            self.prob.njev += 1
            vals = self.tangent_values(X.getArray(readonly=True).copy())
        except Exception as e:
            self.error = self.error or e
            raise
        writer = self.writer
        if writer is None or vals.size < _CSR_BELOW or not writer.write(torch.from_numpy(vals)):
            P.setValuesCSR(self.csr[0], self.csr[1], vals, PETSc.InsertMode.INSERT_VALUES)
        P.assemble()
        if J.handle != P.handle:
            J.assemble()


class _Dispatch:
    """What the SNES calls back: the current solve's :class:`_Callbacks` (``cb``, None between
    solves, so a kept SNES holds neither the problem nor its parameters). It never refers to
    the SNES (no reference cycle through PETSc's callback context)."""

    def __init__(self):
        self.cb = None

    def function(self, snes, X, F) -> None:
        self.cb.function(snes, X, F)

    def jacobian(self, snes, X, J, P) -> None:
        self.cb.jacobian(snes, X, J, P)

    def objective(self, snes, X) -> float:
        return self.cb.objective(snes, X)

    def monitor(self, snes, its, fnorm) -> None:
        self.cb.monitor(snes, its, fnorm)


class _Solver:
    """Collective (constructor). A configured SNES with its Vecs and Jacobian Mat: made per
    call without a Jacobian, kept per Jacobian layout and settings with one (``SNES_CACHE_SIZE``)."""

    def __init__(self, comm, n_local, J0, rtol, atol, stol, maxiter, line_search, ls, petsc_options,
                 options_prefix, extra, use_objective=False):
        from ..petsc import create_petsc_mat
        self.calls = _Dispatch()
        # dofs per node (checked to divide every rank's rows): GAMG aggregates nodes of the Mat's
        # block size, and the Vecs get it too (as DOLFINx makes them on a vector space)
        bs = int(ls.get("block_size", 1)) if J0 is not None else 1
        X = self.X = PETSc.Vec().createMPI((n_local, PETSc.DECIDE), bsize=bs, comm=comm)
        n_global = X.getSize()
        F = self.F = X.duplicate()
        snes = self.snes = PETSc.SNES().create(comm=comm)
        self.csr = None
        self.writer = False   # the Jacobian Mat's value writer: not made yet (None: cannot be)
        self.adjoint_work = None   # a Vec for the backward's residual check (adjoint_solve_kept)
        if J0 is not None and J0.values.device.type == "cpu":
            loc = J0.local
            self.csr = (loc.indptr.numpy().astype(PETSc.IntType), loc.indices.numpy().astype(PETSc.IntType))
        # the Mat's pattern is the Jacobian's at u0 (its values are written at every Jacobian call)
        self.Jmat = None if J0 is None else create_petsc_mat(J0.to(torch.float64), "aij", bsize=bs if bs > 1 else None)
        if self.Jmat is not None and comm.Get_size() > 1:
            # every write is of this rank's own rows (the tangent's values in its CSR): the assembly
            # after each one then skips the off-process stash's reduction (one per Jacobian); a
            # write to another rank's row would raise in PETSc, never be dropped
            self.Jmat.setOption(PETSc.Mat.Option.NO_OFF_PROC_ENTRIES, True)
        # the near-nullspace lives on this SNES's own Jacobian Mat; values changed on any rank
        # make a new SNES (GAMG keeps the near-nullspace data of its first set-up)
        self.near_nullspace = None
        try:
            if options_prefix:
                snes.setOptionsPrefix(options_prefix)
            snes.setType("newtonls")
            snes.setFunction(self.calls.function, F)
            if use_objective:   # the line search's merit function instead of ||F||^2 / 2
                snes.setObjective(self.calls.objective)
            if self.Jmat is not None:
                snes.setJacobian(self.calls.jacobian, self.Jmat)
                if ls.get("near_nullspace") is not None:
                    from ..krylov.petsc_backend import near_nullspace_of
                    Z = ls["near_nullspace"].detach().to(device="cpu", dtype=torch.float64)
                    self.Jmat.setNearNullSpace(near_nullspace_of(self.Jmat, Z, comm))
                    self.near_nullspace = Z.clone()
            else:
                snes.setUseMF(True)
            snes.setTolerances(rtol=float(rtol), atol=float(atol), stol=float(stol or 0.0), max_it=int(maxiter))
            snes.setMaxFunctionEvaluations(-1)
            snes.setMonitor(self.calls.monitor)
            _configure_ksp(snes.getKSP(), ls, comm.Get_size(), n_global, J0 is None)
            db = PETSc.Options(options_prefix)
            entries = {k: v for k, v in {**_DEFAULT_ENTRIES, **extra}.items() if not db.hasName(k)}
            entries["snes_linesearch_type"] = line_search
            if db.hasName("snes_linesearch_type"):
                entries.pop("snes_linesearch_type")
            entries.update(option_entries(petsc_options))
            try:
                with temporary_options(entries, options_prefix):
                    snes.setFromOptions()
                    self.tols = snes.getTolerances()       # (rtol, atol, stol, max_it) in force
                    db = PETSc.Options(options_prefix)
                    self.line = db.getString("snes_linesearch_type") if db.hasName("snes_linesearch_type") \
                        else line_search
                    # whether the line search computes ||F|| (SNES's Vecs then hold F(X) at each step)
                    self.norms = db.getBool("snes_linesearch_norms", True)
            except PETSc.Error as e:
                raise ValueError(f"PETSc rejected the SNES configuration (petsc_options={petsc_options!r}, "
                                 f"linear_solver={ls!r}): {e}") from None
            ksp = snes.getKSP()
            self.types = (snes.getType(), ksp.getType(), ksp.getPC().getType())
        except BaseException:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Collective. Destroy the PETSc objects now (a solver made for one call)."""
        for obj in (self.snes, self.X, self.F, self.Jmat, self.adjoint_work):
            if obj is not None:
                obj.destroy()


#: SNES solvers kept per Jacobian layout (least recently used dropped first)
SNES_CACHE_SIZE = 4


class _Run(NamedTuple):
    """One SNES solve: its solution, reason, iteration count, line search, callbacks (history),
    SNES / KSP / PC types, tolerances in force ``(rtol, atol, stol, max_it)``, set-up seconds."""
    u: torch.Tensor
    reason: str
    its: int
    line: str
    cb: _Callbacks
    method: str
    ksp_type: str
    pc: str
    tols: tuple
    setup: float
    drop: Optional[Callable[[], None]]   # forgets the kept SNES (None: made for this call)
    kept: Optional["KeptTangent"]        # the kept SNES, for the backward (None: made for this call)
    fnorm: Optional[float]               # ||F(u)|| from SNES's Vecs (_Callbacks.final_norm), or None


def _snes_run(prob, u0, rtol, atol, stol, maxiter, line_search, ls, use_jacobian, callback, progress,
              petsc_options, options_prefix, r0, settings, extra, r0_error=None, start=None) -> _Run:
    """Collective. One SNES solve from ``u0`` with the option entries ``extra`` on top of the
    defaults, on the SNES kept for the Jacobian's layout and these settings (made on a miss).
    ``r0_error``: this rank's problem with ``r0`` (a deferred check), raised on every rank
    before SNES starts, by the check of the Jacobian at ``u0``. ``start``: ``(template, kernels)``
    from :meth:`Problem.start_kernels` (``u0`` and the parameters checked on every rank; ``r0``
    None): SNES evaluates at ``u0`` by the kernels too, the template naming the Jacobian's layout
    and pattern; or None."""
    t0 = time.perf_counter()
    comm = prob.comm
    # the Jacobian at u0 (handed to SNES's first Jacobian call), or the kernels' template, names the
    # layout whose SNES is used
    if start is not None:
        J0 = start[0]
    elif use_jacobian:
        J0 = prob.jacobian(u0, pending=r0_error)   # u0: the tensor F(u0) was evaluated at
    else:
        J0 = None
        check_collective(comm, r0_error)
    args = (comm, prob.n_local, J0, rtol, atol, stol, maxiter, line_search, ls, petsc_options,
            options_prefix, extra, prob.has_objective)
    cache = key = None
    if J0 is None:
        garbage_cleanup(comm)
        solver = _Solver(*args)
    else:
        # every entry agrees across ranks (checked by nonlinear_solve): all ranks hit or miss alike;
        # a dropped SNES is destroyed by PETSc at the next garbage_cleanup, run before making one
        # ls is the settings' linear_solver (keyed) with its rtol default (from the agreed dtype and
        # jacobian): the key needs only that rtol besides
        key = settings.key() + (prob.n_local, repr(ls["rtol"]), options_key(extra) if extra else ())
        cache = J0._layout.cache("nonlinear_solvers")

        def build():
            garbage_cleanup(comm)
            return _Solver(*args)
        solver = J0._layout.cached("nonlinear_solvers", key, build, SNES_CACHE_SIZE)
        if solver.calls.cb is not None:   # in use: a nested call from inside one of its callbacks
            cache, solver = None, _Solver(*args)
        elif ls.get("near_nullspace") is not None and _near_nullspace_changed(comm, solver, ls["near_nullspace"]):
            cache.pop(key, None)
            solver = J0._layout.cached("nonlinear_solvers", key, build, SNES_CACHE_SIZE)
    snes, X = solver.snes, solver.X
    X.setArray(u0.numpy() if u0.dtype == torch.float64 and u0.device.type == "cpu" and not u0.requires_grad
               else u0.detach().to(torch.float64).cpu().numpy())
    if start is not None:
        if solver.csr is None:   # not reached: the kernels' template is a CPU tensor
            raise RuntimeError("slasolve internal: the kernels' template is not on the CPU")
        if solver.writer is False:   # collective: every rank's SNES is at the same point
            from ..petsc import aij_value_writer
            solver.writer = aij_value_writer(solver.Jmat, J0)
        cb = _KernelCallbacks(prob, progress, callback, start[1], solver.csr, X, solver)
    else:
        cb = _Callbacks(prob, u0.dtype, progress, callback, u0.detach(), r0, J0, solver.csr, X, solver)
        if J0 is not None:   # F(u0) and J(u0) passed their checks
            cb.kernels = prob.iterate_kernels()
    setup = time.perf_counter() - t0
    solver.calls.cb = cb
    njev = prob.njev
    ok = False
    try:
        # F(u0) and J(u0) passed their collective checks: SNES evaluates at its own iterates now
        prob.iterating = True
        try:
            if type(cb) is _KernelCallbacks and not prob.has_objective:   # NumPy kernels: no graph to record
                snes.solve(None, X)
            else:
                with torch.no_grad():   # the callbacks record no graph: one mode switch for all of them
                    snes.solve(None, X)
        except PETSc.Error:
            if cb.error is not None:
                raise cb.error from None
            raise
        finally:
            prob.iterating = False
        code = snes.getConvergedReason()
        its = snes.getIterationNumber()
        fnorm = cb.final_norm(snes, solver.types[0], solver.line if solver.norms else None)
        u = torch.from_numpy(X.getArray(readonly=True).copy())
        if u0.dtype != torch.float64:
            u = u.to(u0.dtype)
        ok = True
    finally:
        solver.calls.cb = None
        if cache is None:
            solver.destroy()
        elif not ok:    # raised on every rank (collective checks): drop the SNES, whatever state it is in
            cache.pop(key, None)
    if type(cb) is _KernelCallbacks and prob.njev == njev:
        # SNES stopped before its first Jacobian (F(u0) not finite, converged at u0, maxiter 0): the
        # tangent at u0 is evaluated all the same, as the methods' path does before SNES, so that
        # its problems raise alike (on every rank: SNES's reason is global) and the counts agree
        prob.njev += 1
        cb.tangent_values(u0.numpy().copy())
    method, lm, pc = solver.types
    drop = None if cache is None else (lambda: cache.pop(key, None))
    kept = None if cache is None or solver.Jmat is None or solver.csr is None else KeptTangent(solver, J0._layout)
    return _Run(u, _reason(code), its, solver.line, cb, method, lm, pc, solver.tols, setup, drop, kept, fnorm)


def _near_nullspace_changed(comm, solver: _Solver, Z: torch.Tensor) -> bool:
    """Collective. Whether ``Z`` differs from the near-nullspace ``solver`` was made with, on any rank."""
    built = solver.near_nullspace
    same = built is not None and built.shape == Z.shape and torch.equal(built, Z.detach().to(built))
    return allreduce_int(comm, int(not same), MPI.MAX) > 0


class KeptTangent:
    """Local. What a finished solve leaves for its backward: the kept SNES it ran on, weakly
    referenced (an autograd graph does not keep a dropped SNES alive), and the Jacobian layout
    whose pattern that SNES's Mat has."""

    __slots__ = ("_solver", "layout")

    def __init__(self, solver: _Solver, layout):
        self._solver = weakref.ref(solver)
        self.layout = layout

    def solver(self) -> Optional[_Solver]:
        return self._solver()


def adjoint_solve_kept(kept: KeptTangent, comm, J, g: torch.Tensor, rtol: float, atol: float,
                       maxiter: Optional[int]) -> Optional[torch.Tensor]:
    """Collective. ``lam`` with ``J^T lam = g`` (this rank's rows) by the Newton solve's own KSP
    and preconditioner (as DOLFINx's hand adjoints use the Newton solver's KSP): ``J`` (the tangent
    at the solution) is written into the kept SNES's Jacobian Mat, the preconditioner is set up
    for it under the SNES's reuse rules (GAMG keeps its prolongators), and one
    ``KSPSolveTranspose`` runs from zero. The true residual ``||g - J^T lam||`` must pass
    ``max(rtol ||g||, atol)``; None on every rank alike (one reduction decides) when the kept SNES
    is gone, busy, on another pattern or dtype, or the solve did not get there: the caller then
    solves from scratch (the answer never depends on this path)."""
    from ..krylov.torch_methods import default_maxiter
    solver = kept.solver()
    usable = solver is not None and solver.calls.cb is None and solver.Jmat is not None and \
        solver.csr is not None and getattr(J, "_layout", None) is kept.layout and \
        J.values.device.type == "cpu" and not J.values.requires_grad and g.shape == (solver.X.getLocalSize(),) \
        and all_finite(J.values) and all_finite(g)   # else slasolve.solve's checks say what is wrong
    if comm.Get_size() > 1:
        usable = allreduce_int(comm, int(not usable), MPI.MAX) == 0
    if not usable:
        return None
    ksp, A, B, L = solver.snes.getKSP(), solver.Jmat, solver.F, solver.X
    if solver.adjoint_work is None:
        solver.adjoint_work = B.duplicate()
    R = solver.adjoint_work
    _write_values(A, solver.csr, solver, J)
    tols, guess = ksp.getTolerances(), ksp.getInitialGuessNonzero()
    gn = g.detach().to(device="cpu", dtype=torch.float64).contiguous().numpy()
    try:
        ksp.setOperators(A, A)
        n_global = A.getSize()[0]
        ksp.setTolerances(rtol=float(rtol), atol=float(atol),
                          max_it=default_maxiter(n_global) if maxiter is None else int(maxiter))
        ksp.setInitialGuessNonzero(False)
        B.setArray(gn)
        L.set(0.0)
        ksp.solveTranspose(B, L)
        ok = ksp.getConvergedReason() > 0
        if ok:   # "converged" means the true residual passes (as slasolve.solve's verification)
            A.multTranspose(L, R)
            R.aypx(-1.0, B)     # R = g - J^T lam
            R.normBegin(), B.normBegin()
            true, bnorm = R.normEnd(), B.normEnd()
            ok = math.isfinite(true) and true <= max(float(rtol) * bnorm, float(atol))
    except PETSc.Error:   # e.g. a preconditioner without a transpose apply: the same on every rank
        ok = False
    finally:
        ksp.setTolerances(rtol=tols[0], atol=tols[1], divtol=tols[2], max_it=tols[3])
        ksp.setInitialGuessNonzero(guess)
    if not ok:
        return None
    return torch.from_numpy(L.getArray(readonly=True).copy()).to(g.dtype)


def snes_solve(prob, u0, *, rtol, atol, stol, maxiter, line_search, linear_solver, use_jacobian,
               callback, progress, settings, petsc_options=None, options_prefix=None, r0=None,
               r0_error=None, start=None) -> tuple:
    """Collective. ``(u, NonlinearInfo, kept)`` from PETSc SNES (``kept``: a :class:`KeptTangent`
    for the backward's :func:`adjoint_solve_kept`, or None when the SNES was made for this call); raises only for errors inside the
    callbacks (collective checks, re-raised on every rank) or a rejected configuration. ``settings``: the call's
    :class:`slasolve.settings.Settings` (agreed by ``nonlinear_solve``), whose key selects the
    kept SNES. ``r0``: ``F(u0)`` from :meth:`Problem.residual_local`, or None with its problem
    ``r0_error`` on this rank (raised on every rank before SNES starts); or None with ``start``
    (:meth:`Problem.start_kernels`' answer: SNES evaluates at ``u0`` by the kernels)."""
    t0 = time.perf_counter()
    comm = prob.comm
    ls = dict(linear_solver)
    ls.setdefault("rtol", inner_rtol_default(u0.dtype, use_jacobian))
    args = (prob, u0, rtol, atol, stol, maxiter, line_search, ls, use_jacobian, callback, progress,
            petsc_options, options_prefix, r0, settings)
    out = _snes_run(*args, {}, r0_error=r0_error, start=start)
    if out.reason == "DIVERGED_LINEAR_SOLVE" and out.pc == "gamg" and \
            not PETSc.Options(options_prefix).hasName("pc_gamg_reuse_interpolation") and \
            "pc_gamg_reuse_interpolation" not in option_entries(petsc_options):  # the same on every rank
        if out.drop is not None:   # its prolongators failed: the next call starts afresh
            out.drop()
        out = _snes_run(*args, _REBUILD_ENTRIES, start=start)
    u, reason, its, line, cb, method, lm, pc, (rtol, atol, stol_, max_it), setup, _, kept, fn = out
    lits = cb.lits
    # the true residual of the returned u decides "converged": SNES's own ||F|| at u where its
    # Vecs hold F(u) (no reduction); else SNES's last evaluation when it was at u on every rank
    # (one reduction decides and sums), else one more evaluation
    if fn is None:
        last = cb.last
        if last is not None and isinstance(last[0], np.ndarray):   # the kernels' (float64)
            last = (torch.from_numpy(last[0]), torch.from_numpy(last[1]))
        if last is not None and torch.equal(last[0], u):
            r = last[1].numpy() if last[1].dtype == torch.float64 else last[1].to(torch.float64).numpy()
            buf = np.array([float(np.dot(r, r)), 0.0])
        else:
            buf = np.array([0.0, 1.0])
        if comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        if buf[1] == 0:
            fn = math.sqrt(float(buf[0]))
        else:
            fn = global_norm(comm, prob.residual(u))
    hist = cb.hist or [float("nan")]
    target = max(rtol * hist[0], atol)
    if reason.startswith("CONVERGED") and reason != "CONVERGED_SNORM_RELATIVE":
        # same norm as SNES's own test; the slack only absorbs rounding between the two evaluations
        if math.isfinite(fn) and fn <= target * (1 + 1e-8) + 1e3 * _EPS64 * hist[0]:
            if reason not in ("CONVERGED_FNORM_ABS", "CONVERGED_FNORM_RELATIVE"):  # e.g. ksponly's CONVERGED_ITS
                reason = "CONVERGED_FNORM_ABS" if atol > 0 and fn <= atol else "CONVERGED_FNORM_RELATIVE"
        else:
            reason = "DIVERGED_MAX_IT" if its >= max_it or reason == "CONVERGED_ITS" else "DIVERGED_LOCAL_MIN"
    info = NonlinearInfo(converged=reason.startswith("CONVERGED"), reason=reason, iterations=int(its),
                         residual_norm=fn, residual_history=hist, linear_iterations=sum(lits),
                         linear_iterations_per_step=lits, method=method, backend="petsc",
                         line_search=line, linear_method=_linear_method_name(lm) if use_jacobian
                         else f"{_linear_method_name(lm)} (matrix-free)", pc=pc,
                         rtol=float(rtol), atol=float(atol), stol=float(stol_), setup_time=setup,
                         solve_time=time.perf_counter() - t0 - setup)
    return u, info, kept
