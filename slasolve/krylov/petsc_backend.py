"""KSP backend: slasolve's solve options mapped onto PETSc KSP/PC.

Tolerances: PETSc's default convergence test ``||r|| <= max(rtol ||b||, atol)``
on the *unpreconditioned* residual norm (CG: left preconditioning with
``KSP_NORM_UNPRECONDITIONED``; GMRES/BiCGStab: right preconditioning), so
``rtol`` means what it means in SciPy. MINRES in PETSc 3.18 supports only the
preconditioned norm: with a preconditioner PETSc tests ``||B r||``; when it reports
convergence slasolve checks the true residual ``||b - A x||`` (one product) and, if
that is above ``max(rtol ||b||, atol)``, continues from ``x`` with a tighter tolerance
(within ``maxiter``), else reports ``DIVERGED_ITS``; the same for any KSP the options
put on another norm. ``SolveInfo.residual_norm`` is then the true residual.

The KSP is cached (see ``solve._solver``, the layout's ``"solvers"`` cache) and reused while only the right-hand
side changes. Nothing a call asks for survives into the next call:

* every per-call setting is set on every call: ``rtol``, ``atol``, ``max_it``
  (default :func:`~slasolve.krylov.torch_methods.default_maxiter`, as the torch
  backend), the divergence tolerance (infinite: SciPy has none, so a far-away
  ``x0`` never stops the solve with ``DIVERGED_DTOL``), the initial-guess flag,
  the callback and history;
* ``rtol >= 1`` (refused by PETSc) becomes the absolute tolerance
  ``max(rtol ||b||, atol)``, SciPy's test; ``b == 0`` returns ``x = 0`` (0
  iterations, ``CONVERGED_ATOL``) as SciPy does, whatever ``x0``;
* PETSc's BiCGStab keeps the initial guess of a nonzero-guess solve in the KSP
  and adds it to every later solution (``KSP_BCGS::guess``); for that family the
  solve always runs in nonzero-guess mode, with an explicit zero vector when no
  ``x0`` was given, so the stored guess is overwritten on every call;
* ``petsc_options`` are in the options database only while this KSP reads them
  (:func:`slasolve.petsc.temporary_options`): ``setFromOptions`` and every
  preconditioner set-up (GAMG's level smoothers read ``-mg_levels_*`` there); entries
  of the options database (``petsc_options`` or the command line) for ``ksp_rtol``, ``ksp_atol``,
  ``ksp_max_it`` and ``ksp_divtol`` take precedence over the keyword arguments,
  as in PETSc (``setFromOptions`` after the programmatic settings);
* new values are written into the same Mat (:func:`slasolve.petsc.to_petsc_mat`
  compares them with what the Mat holds), which changes the Mat's state, and
  PETSc rebuilds the preconditioner on the next solve. For GAMG under
  ``reuse_pc=False`` slasolve sets ``-pc_gamg_reuse_interpolation false`` (unless the
  options database says otherwise; the default ``reuse_pc="auto"`` uses the
  ``reuse_interpolation`` KSP below, with the checks of ``reuse.with_reuse``): PETSc 3.18 otherwise keeps the old prolongators *and* the
  Chebyshev eigenvalue estimates made for the old matrix, which can give
  ``DIVERGED_INDEFINITE_PC`` after large value changes (SIMP densities). The
  ``reuse_interpolation`` KSP keeps both too (PETSc's default, as DOLFINx), guarded by
  ``reuse.with_reuse``: a kept preconditioner that fails or slows down is rebuilt from
  scratch and the solve redone.

Several right-hand sides (``b`` of shape ``(n_local, k)``, :meth:`PetscKrylov.solve_many`,
and the adjoint :meth:`PetscKrylov.solve_transpose_many`) are solved in one call: the
operator refresh (value comparison, refill), the KSP settings, the preconditioner set-up
and its collective checks happen once; then one ``KSPSolve`` per nonzero column on two
work Vecs; then one true-residual check for all columns (a sparse-times-dense MatMatMult
and one reduction for the column norms). That is what PETSc 3.18's ``KSPMatSolve`` does
for every KSP type of this build (only KSPHPDDM, not built in Debian's PETSc, has a block
method; the others loop over the columns in C), but ``KSPMatSolve`` is not wrapped by
petsc4py 3.18 and resets the converged reason per column, keeping only the last one, so
slasolve loops itself and keeps everything per column: each column's tolerance
``max(rtol ||b_j||, atol)`` (``rtol >= 1`` included), its ``x0`` column, zeros for zero
columns, per-column history and callback, callable preconditioners, and the true-residual
continuation for a column PETSc called converged too early. Only ``maxiter=0`` (or
``-ksp_max_it 0``) falls back to one full single-column call per column.

CG on several ranks runs PETSc's single-reduction variant (both inner products of a step in one
Allreduce, plus the norm's: 2 per step instead of 3) when ``rtol >= 1e-10`` (or ``rtol >= 1``),
and the classic variant at tighter tolerances, where the variant's recurrence for ``A p`` costs
iterations near the attainable accuracy; one cached KSP switches per call
(``KSPCGUseSingleReduction``). ``-ksp_cg_single_reduction`` in the options fixes the variant.
One rank: the classic variant (no reduction to save).

``near_nullspace`` (``(n_local, m)``) is a hint for the preconditioners in
``_USES_NEAR_NULLSPACE`` (GAMG, ML; hypre's BoomerAMG and the others do not read it): the
columns are orthonormalised collectively (Cholesky QR twice), made a ``MatNullSpace`` and
set on the operator Mat only for this call's set-up, and cleared after the solve, so the
cached Mat (shared by every solver of the layout) never carries it into another call.
GAMG keeps the near-nullspace data of its first set-up through later rebuilds, and
``PCReset`` leaves its levels' sizes behind, so when ``near_nullspace`` differs from what
this KSP's preconditioner was built with (by value, on any rank; given or not), the
preconditioner implementation is replaced (same type and options) and built from scratch.
"""
from __future__ import annotations

import ctypes
import functools
import math
import time
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from .. import _log
from .._comm import allreduce_int, check_collective
from ..petsc import PETSc, cached_mat, option_entries, temporary_options, to_petsc_mat, values_differ
from ..registry import PRECONDITIONERS, krylov_method, petsc_method_name, preconditioner
from .base import KrylovSolver
from .info import REASONS, SolveInfo
from .torch_methods import default_maxiter

__all__ = ["PetscKrylov", "reason_name", "configure_ksp", "configure_pc", "near_nullspace_of"]

# KSP types that keep the last nonzero initial guess and add it to later solutions
_GUESS_STATE = {"bcgs", "fbcgs", "fbcgsr", "pipebcgs"}
# option defaults slasolve sets (only where the options database has no entry)
_DEFAULT_ENTRIES = {"pc_gamg_reuse_interpolation": "false"}
# reuse_pc="interpolation": GAMG keeps its prolongators across value changes (coarse operators
# recomputed) and, as PETSc's default does (DOLFINx users get that), the Chebyshev smoothers'
# eigenvalue estimates of its last full set-up (GAMG's smoothed-aggregation ones). Re-estimating
# on every set-up (-pc_gamg_use_sa_esteig false: 10 CG steps on every level) cost 163 of 198
# Mflop of the set-up at 1M-cell Poisson, ~10% of the whole optimisation iteration. Stale
# estimates (DIVERGED_INDEFINITE_PC after large SIMP value changes) are caught by reuse.with_reuse:
# a kept preconditioner that fails, or needs more than LAG_CAP x the iterations after its last
# full set-up, is rebuilt from scratch (new prolongators and estimates) and the solve redone;
# one needing more than LAG_GROWTH x is rebuilt for the next solve. top88 over 40 OC steps:
# 120x40 no redo (2867 iterations against 2873), 300x100 one redo (11 iterations discarded).
_INTERPOLATION_ENTRIES = {"pc_gamg_reuse_interpolation": "true"}
# CG + GAMG: the smoothers' eigenvalue estimates (GAMG's smoothed-aggregation one and the
# Chebyshev smoothers' own) made by CG, as PETSc does for a Mat flagged SPD, instead of GMRES.
# GMRES builds its Ritz values in the Euclidean inner product, where D^-1 A of a SIMP matrix
# (diagonal spanning 1e-9..1) is far from normal: its 10 steps put lambda_max of D^-1 A at
# 1.44-1.46 on two coarse levels of the 300x100 top88 beam whose true value is 1.92-2.42, beyond
# the Chebyshev interval's reach (1.21 x the estimate), so the smoothers amplified those modes
# and CG stopped with DIVERGED_INDEFINITE_PC after 8 iterations. CG (Lanczos in the D inner
# product) estimates lambda_max(D^-1 A) as for a symmetric matrix. The Mat is not flagged
# SPD: it is shared with solvers of other methods.
_CG_ENTRIES = {"pc_gamg_esteig_ksp_type": "cg", "mg_levels_esteig_ksp_type": "cg"}
# ... and, for an estimating KSP that is CG (by these defaults or the user's options), its
# reductions cut: the natural norm sqrt(r.z) comes with CG's own inner product (the default
# preconditioned norm costs one more Allreduce per step; the estimates are the same bits, they
# come from CG's coefficients), and the level smoothers' own estimates (10 steps on a level's
# operator, on each value change, where GAMG gives the smoother no smoothed-aggregation estimate:
# options with -pc_gamg_use_sa_esteig false, smoothers other than Jacobi) use CG's single-reduction
# variant (one Allreduce per step instead of two; the same Lanczos coefficients up to rounding).
# At 2 ranks, 8k-cell Poisson, re-estimating: 99 -> 42 Allreduces per set-up.
_CG_ESTEIG_EXTRAS = {"pc_gamg_esteig_": {"ksp_norm_type": "natural"},
                     "mg_levels_esteig_": {"ksp_norm_type": "natural", "ksp_cg_single_reduction": "true"}}
# CG on several ranks: PETSc's single-reduction variant (the two inner products of a step, z.r and
# z.Az with A p kept by recurrence, in one Allreduce; the unpreconditioned norm keeps its own: 3 -> 2
# Allreduces per step, the same MatMults and PC applications) for rtol >= this, the classic
# variant below it. Its recurrence drifts near the attainable accuracy: top88's SIMP beams at
# rtol 1e-12 (accepted at the rounding floor) needed up to 7 more iterations (89 -> 96, 300x100
# holes, 2 ranks), while at rtol 1e-6, 1e-8 and 1e-10 every case took the same or fewer (104 -> 99).
# Set per call (KSPCGUseSingleReduction, not wrapped by petsc4py 3.18), unless the options name
# -ksp_cg_single_reduction; one rank: the classic variant (nothing to save).
_SINGLE_REDUCTION_RTOL = 1e-10
# preconditioners whose PETSc set-up fails (on the ranks holding it, inside collective
# set-up) or divides by a zero diagonal entry
_ROUNDING_FLOOR = 1e3 * 2.220446049250313e-16  # x eps (||b|| + ||A x||)
# the same 2-norm summed in another order differs by far less than this (relative)
_NORM_SLACK = 1.0 + 1e-12
# x eps (||A||_inf ||x|| + ||b||): the normwise backward-error floor (SolveInfo.floor)
_BACKWARD_FLOOR = 4 * 2.220446049250313e-16
# x ||b||: the most a floor may accept, the default rtol: an answer accepted at the floor passes
# a default call's test. It rejects the blown-up x of a singular, inconsistent system (GMRES +
# GAMG: ||x|| 7e14, tiny backward error, residual 0.24 ||b||). It was sqrt(eps): below what
# legitimate floors reach (top88 120x40 graded: ||A|| ||x|| 3e8 ||b||, SciPy's spsolve leaves
# 1.3e-8 ||b||), it cost 74 extra CG iterations there and, without the block size, 29000.
_FLOOR_CAP = 1e-5
# x ||b||: the floor serves tolerances under sqrt(eps) only (as when the cap was sqrt(eps)):
# ||A||_inf ||x|| overstates the attainable residual of a badly scaled A (MINRES + Jacobi on a
# Poisson matrix scaled by 10^+-3 reaches 1e-7 ||b||, its floor is 2.5e-7 ||b||)
_FLOOR_BELOW = 2.220446049250313e-16 ** 0.5
_EV_VERIFY, _EV_PCSETUP = _log.event("slaSolveVerify"), _log.event("slaPCSetUp")
_NEEDS_DIAGONAL = tuple(p.petsc_type for p in PRECONDITIONERS.values() if p.needs_diagonal)
# preconditioners that read the operator's near-nullspace (hypre's BoomerAMG does not; ML, reached
# through petsc_options only, does)
_USES_NEAR_NULLSPACE = tuple(p.petsc_type for p in PRECONDITIONERS.values() if p.uses_near_nullspace) + ("ml",)
# options that override the keyword arguments: name -> (getter, key)
_OVERRIDES = {"ksp_rtol": ("getReal", "rtol"), "ksp_atol": ("getReal", "atol"),
              "ksp_divtol": ("getReal", "divtol"), "ksp_max_it": ("getInt", "max_it")}

# PETSc's C names (KSP_DIVERGED_ITS, ...); petsc4py spells two of them differently
_ALIASES = {"DIVERGED_MAX_IT": "DIVERGED_ITS", "DIVERGED_PCSETUP_FAILED": "DIVERGED_PC_FAILED"}
_REASONS = {}
for _name in dir(PETSc.KSP.ConvergedReason):
    if _name.isupper() and _name.startswith(("CONVERGED", "DIVERGED")):
        _REASONS.setdefault(getattr(PETSc.KSP.ConvergedReason, _name), _ALIASES.get(_name, _name))


def reason_name(code: int) -> str:
    """Local. PETSc's name of a KSPConvergedReason code (``"DIVERGED_ITS"``, ...)."""
    name = _REASONS.get(int(code), "DIVERGED_NULL" if int(code) < 0 else "CONVERGED_ITERATING")
    if name not in REASONS:  # CG trust-region reasons etc. that slasolve never requests
        name = "DIVERGED_NULL" if int(code) < 0 else "CONVERGED_ITS"
    return name


def configure_ksp(ksp, method: str, restart: int = 30) -> None:
    """Local. The registered ``method``'s KSP type, preconditioning side and norm on ``ksp``:
    the unpreconditioned residual norm (what ``rtol`` means) wherever PETSc supports it."""
    m = krylov_method(method)
    ksp.setType(m.petsc_type)
    if m.restart:
        ksp.setGMRESRestart(int(restart))
    if m.pc_side == "right":
        ksp.setPCSide(PETSc.PC.Side.RIGHT)
    if m.unpreconditioned_norm:
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)


def configure_pc(pc, name: Optional[str], comm_size: int) -> None:
    """Local. The registered preconditioner ``name`` (None: none) on the PETSc PC ``pc``;
    ``ValueError`` for a name the petsc backend does not know."""
    spec = preconditioner(name, "petsc")
    pc.setType(spec.parallel_petsc_type if comm_size > 1 and spec.parallel_petsc_type else spec.petsc_type)
    if spec.hypre_type is not None:
        pc.setHYPREType(spec.hypre_type)
    if spec.factor_solver is not None:
        pc.setFactorSolverType(spec.factor_solver)


class _PyPC:
    """A user callable ``z = fn(r)`` as a PETSc ``python`` PC (``fn`` is replaced per call)."""

    def __init__(self, fn, n_local, dtype):
        self.fn, self.n, self.dtype = fn, n_local, dtype

    def apply(self, pc, x, y):
        r = torch.from_numpy(x.getArray(readonly=True).copy()).to(self.dtype)
        z = self.fn(r)
        y.setArray(z.detach().cpu().to(torch.float64).numpy())

    applyTranspose = apply


class _Monitor:
    """KSP monitor state. Holds no reference to the solver (the KSP keeps the monitor
    alive from C, which Python's garbage collector cannot see through)."""

    def __init__(self):
        self.history = None
        self.callback = None

    def __call__(self, ksp, its, rnorm):
        if self.history is not None:
            self.history.append(float(rnorm))
        if self.callback is not None and its > 0:
            self.callback(int(its), float(rnorm))


def _vec(t: torch.Tensor, n_global: int, comm):
    """A Vec over the owned rows ``t`` (float64 CPU contiguous), global size known."""
    arr = t.numpy()
    return PETSc.Vec().createWithArray(arr, size=(arr.shape[0], n_global), comm=comm)


class PetscKrylov(KrylovSolver):
    """Collective (constructor). A cached KSP for one operator layout and method.

    Configuration errors (unknown ``ksp_type`` in the options, a preconditioner PETSc
    cannot set up) raise ``ValueError`` from the constructor, which the caller combines
    across ranks.
    """

    backend = "petsc"

    def __init__(self, dA, method: str, pc, *, restart: int = 30, options_prefix: Optional[str] = None,
                 petsc_options: Optional[dict] = None, reuse_interpolation: bool = False):
        super().__init__()
        self.symmetric = krylov_method(method).symmetric
        self.method = method
        self._diag_checked: dict = {}   # "main"/"T" -> (error, operator stamp) of the last diagonal check
        self._set_up_for: dict = {}     # "main"/"T" -> operator stamp + reuse flag of the last successful set-up
        self._reuse: dict = {}          # "main"/"T" -> the reuse flag PETSc's PC has now
        self._shells: dict = {}         # "b"/"x" -> a Vec of this layout whose array each solve places
        self._pc_types: dict = {}       # "main"/"T" -> the KSP's PC type (fixed once configured)
        self._ops: dict = {}            # "main"/"T" -> the operator Mat last given to the KSP (held)
        self.comm = dA.comm
        self.n_global = dA.global_shape[0] * (dA.local.block_shape[0] if dA.local.is_block else 1)
        t0 = time.perf_counter()
        # block tensors go to KSP as AIJ with the block size set: every PC accepts
        # that (GAMG and hypre do not take BAIJ in PETSc 3.18)
        mat = dA.to_petsc(mat_type="aij")
        # the Mat is shared by every solver on this layout: a near-nullspace another call left
        # on it must not reach this KSP's first set-up (each call sets or clears it)
        mat.setNearNullSpace(PETSc.NullSpace())
        ksp = PETSc.KSP().create(comm=self.comm)
        self.ksp, self._ksp_T, self._matT = ksp, None, None
        self._nns = {}  # "main"/"T" -> (near-nullspace snapshot, PETSc.NullSpace) its PC was built with
        self._explicit_T = False  # KSPSolveTranspose failed once: transposes use _ksp_T
        self._monitor = _Monitor()
        self._watched: set = set()   # "main"/"T": KSPs the monitor is set on (see _watch)
        self._pyctx = None
        self._defaults = dict(_DEFAULT_ENTRIES)
        if reuse_interpolation:
            self._defaults.update(_INTERPOLATION_ENTRIES)
        if method == "cg" and (pc == "gamg" or reuse_interpolation):
            self._defaults.update(_CG_ENTRIES)
        try:
            self._configure(ksp, mat, dA, method, pc, restart, options_prefix, petsc_options)
        except PETSc.Error as e:
            ksp.destroy()
            raise ValueError(f"PETSc rejected the solver configuration (method={method!r}, pc={pc!r}, "
                             f"petsc_options={petsc_options!r}, options_prefix={options_prefix!r}): "
                             f"{_petsc_message(e)}") from None
        self.setup_time = time.perf_counter() - t0

    def _configure(self, ksp, mat, dA, method, pc, restart, options_prefix, petsc_options):
        ksp.setOperators(mat)
        configure_ksp(ksp, method, restart)
        if options_prefix:
            ksp.setOptionsPrefix(options_prefix)
        pcobj = ksp.getPC()
        if callable(pc):
            pcobj.setType("python")
            self._pyctx = _PyPC(pc, dA.n_local, dA.dtype)
            pcobj.setPythonContext(self._pyctx)
        else:
            configure_pc(pcobj, pc, self.comm.Get_size())
        self._entries = self._option_entries(pc if isinstance(pc, str) else None, options_prefix,
                                             petsc_options)
        self._prefix = options_prefix
        with temporary_options(self._entries, options_prefix):
            ksp.setFromOptions()
            self._overrides = _read_overrides(options_prefix)
        # CG on several ranks, its variant not named in the options: this solver picks it per call
        # (see _SINGLE_REDUCTION_RTOL, _cg_variant), alike on every rank (whether any rank cannot
        # rides on the diagonal check's Allreduce). Single reduction from the first set-up on:
        # KSPSetUp_CG allocates the variant's two extra work Vecs only when it is on then.
        can = None
        if method == "cg" and self.comm.Get_size() > 1:
            can = ksp.getType() == "cg" and "ksp_cg_single_reduction" not in self._entries and \
                not PETSc.Options(options_prefix).hasName("ksp_cg_single_reduction") and \
                _cg_single_reduction_fn() is not None
        cannot = check_collective(self.comm, _diagonal_error(dA, ksp.getPC().getType()),   # before the
                                  flag=can is False)                                      # collective set-up
        self._switch_cg, self._single = can is not None and not cannot, True
        if self._switch_cg:
            _cg_single_reduction_fn()(ksp.handle, 1)
        with temporary_options(self._entries, options_prefix):
            ksp.setUp()  # configuration errors surface here, inside the collective check
        self.ksp_type = ksp.getType()
        self.method_name = petsc_method_name(self.ksp_type)
        self.pc_type = ksp.getPC().getType()
        self.norm = ("preconditioned" if ksp.getNormType() == PETSc.KSP.NormType.PRECONDITIONED
                     and self.pc_type != "none" else "unpreconditioned")

    def _call_set_up(self, ksp, dA, near_nullspace, op=None, pc_type: Optional[str] = None) -> None:
        """Collective. This call's preconditioner set-up (near-nullspace included); a
        failed set-up leaves no near-nullspace on the shared Mat. ``op``, ``pc_type``: the
        KSP's operator Mat and PC type when the caller has them."""
        try:
            with _log.phase("setup", _EV_PCSETUP):
                if near_nullspace is not None or self._nns:
                    self._apply_near_nullspace(ksp, near_nullspace)
                self._set_up(ksp, dA, op, pc_type)
        except ValueError:
            _clear_near_nullspace(ksp)
            raise

    def _option_entries(self, pc_name, prefix, petsc_options) -> dict:
        user = option_entries(petsc_options)
        db = PETSc.Options(prefix)
        needed = preconditioner(pc_name, "petsc").petsc_entries(self.comm.Get_size(), self.method) \
            if pc_name else {}
        entries = {k: v for k, v in {**self._defaults, **needed}.items()
                   if not db.hasName(k)}
        entries.update(user)
        if self.method == "cg" and "pc_gamg_esteig_ksp_type" in self._defaults:   # (_CG_ENTRIES)
            for pre, extra in _CG_ESTEIG_EXTRAS.items():
                if entries.get(pre + "ksp_type") == "cg":
                    entries.update({pre + k: v for k, v in extra.items()
                                    if pre + k not in entries and not db.hasName(pre + k)})
        return entries

    def reset_pc(self) -> None:
        """Collective. Make the next solve build an algebraic multigrid preconditioner from
        scratch, prolongators included (GAMG configured by ``reuse_interpolation`` keeps them
        otherwise). Every other preconditioner is rebuilt whenever a solve without
        ``reuse_pc`` sees values it was not built for, so nothing needs forgetting."""
        for ksp in (self.ksp, self._ksp_T):
            if ksp is not None and ksp.getPC().getType() in _USES_NEAR_NULLSPACE:
                self._fresh_pc(ksp)

    def set_callable(self, fn) -> None:
        """Local. Use ``fn`` as the (python) preconditioner from now on."""
        if self._pyctx is not None:
            self._pyctx.fn = fn

    def _run(self, ksp, dA, b: torch.Tensor, x0: Optional[torch.Tensor], transpose: bool, *, rtol, atol,
             maxiter, callback, record_history, reuse_pc: bool = False,
             reset_operators: bool = True, near_nullspace: Optional[torch.Tensor] = None,
             known_bnorm: Optional[float] = None) -> tuple:
        bb = _cpu64(b)
        bn = bb.numpy()
        key = "main" if ksp is self.ksp else "T"
        pc_type = self._pc_types.get(key)
        if pc_type is None:
            pc_type = self._pc_types[key] = ksp.getPC().getType()
        op = self._ops.get(key) if reset_operators and known_bnorm is not None else None
        if op is not None:
            # the caller established collectively that the operator Mat has not changed since this
            # KSP's last solve (operator_stamp), which refreshed and checked it, and knows ||b||
            bnorm = float(known_bnorm)
        elif reset_operators:
            # one reduction: whether any rank's values changed (the Mat is refilled in place
            # then), ||b||^2 (local dot products summed, as PETSc's VecNorm does) and whether a
            # rank's diagonal fails the preconditioner's need (checked here, before the refill,
            # unless the Mat holds these values and they passed; see _set_up)
            differ = values_differ(dA, "aij")
            needs = pc_type in _NEEDS_DIAGONAL
            pre = None
            if needs:
                last = self._ops.get(key)    # the operator this KSP was given last (held: handle not reused)
                if last is None:
                    last = self._ops[key] = ksp.getOperators()[0]
                if differ is not False or self._diag_checked.get(key, (None, None))[1] != \
                        (last.handle, last.stateGet(), pc_type):
                    pre = _diagonal_error(dA, pc_type)
            flags = np.array([float(bool(differ)), float(bn.dot(bn)), float(pre is not None)])
            if self.comm.Get_size() > 1:
                self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.SUM)
            if flags[2]:
                check_collective(self.comm, pre)    # raises on every rank
            op = to_petsc_mat(dA, mat_type="aij", changed=bool(flags[0]))
            ksp.setOperators(op)
            self._ops[key] = op
            if needs:   # every rank's diagonal is known good for the Mat as it is now
                self._diag_checked[key] = (op, (op.handle, op.stateGet(), pc_type))
            bnorm = math.sqrt(flags[1])
        B = self._over("b", bn)
        if not reset_operators:
            bnorm = B.norm()
        if bnorm == 0.0:  # SciPy: x = 0 whatever x0
            B.resetArray()
            return torch.zeros_like(b), self._info("CONVERGED_ATOL", 0, 0.0, [0.0] if record_history else None,
                                                   0.0, 0.0, rtol, atol)
        ov = self._overrides
        r, a = ov.get("rtol", rtol), ov.get("atol", atol)
        absolute = r >= 1.0  # PETSc requires rtol < 1; SciPy's test is max(rtol ||b||, atol)
        if absolute:
            # PETSc's own ||b|| (its residual test at x = 0) may differ from bnorm in the last
            # bits (another summation order): x = 0 must pass at rtol = 1 whatever the order
            r, a = 0.0, max(r * bnorm * _NORM_SLACK, a)
        max_it = ov.get("max_it", default_maxiter(self.n_global) if maxiter is None else int(maxiter))
        ksp.setTolerances(rtol=r, atol=a, divtol=ov.get("divtol", math.inf), max_it=max_it)
        if x0 is None:
            xn = np.zeros(b.shape[0])
            x = torch.from_numpy(xn)
        else:
            x = x0.detach().to(device="cpu", dtype=torch.float64).clone()
            xn = x.numpy()
        if max_it == 0:  # PETSc's KSPs still take one step; test the initial guess only (torch backend)
            return self._initial_guess_only(ksp, B, x, b, r, a, bnorm, rtol, atol, record_history, transpose)
        ksp.setInitialGuessNonzero(x0 is not None or self.ksp_type in _GUESS_STATE)
        self._set_reuse(ksp, bool(reuse_pc))
        X = self._over("x", xn)
        mon = self._monitor
        if record_history or callback is not None:
            mon = self._watch(ksp, True)
            mon.history = [] if record_history else None
            mon.callback = callback
        t0 = time.perf_counter()
        try:
            self._call_set_up(ksp, dA, near_nullspace, op, pc_type)
        except ValueError:
            B.resetArray(), X.resetArray()
            raise
        t1 = time.perf_counter()
        try:
            self._cg_variant(ksp, absolute or r >= _SINGLE_REDUCTION_RTOL)
            with _log.phase("solve"):
                if transpose:
                    ksp.solveTranspose(B, X)
                else:
                    ksp.solve(B, X)
            reason = reason_name(ksp.getConvergedReason())
            its, rnorm = int(ksp.getIterationNumber()), float(ksp.getResidualNorm())
            floor = None
            if reason.startswith("CONVERGED"):
                # PETSc tests a recurrence (GMRES: the least-squares residual) or another norm;
                # "converged" must mean the true residual passes (GMRES + GAMG on a singular,
                # inconsistent system reported 1e-9 for a true residual of 1). One MatMult.
                tol = a if absolute else max(r * bnorm, a)
                with _log.phase("verify", _EV_VERIFY):
                    reason, its, rnorm, floor = _verify_true_residual(ksp, B, X, transpose, tol, max_it,
                                                                       its, reason, float(bnorm),
                                                                       work=(self._work("ax"), self._work("r")),
                                                                       op=op)
            _sync_solution(X, xn)
            t2 = time.perf_counter()
            history = mon.history
        finally:
            self._cg_variant(ksp, True)
            mon.history = mon.callback = None
            if near_nullspace is not None:   # else this call set none (see _apply_near_nullspace)
                _clear_near_nullspace(ksp)
            B.resetArray(), X.resetArray()
        if absolute and reason == "CONVERGED_ATOL" and not (atol > 0 and rnorm <= atol):
            reason = "CONVERGED_RTOL"
        info = self._info(reason, its, rnorm, history, t1 - t0, t2 - t1, rtol, atol, ksp)
        info.floor = floor
        if b.dtype != torch.float64 or b.device.type != "cpu":
            x = x.to(device=b.device, dtype=b.dtype)
        return x, info

    def _set_up(self, ksp, dA, op=None, pc_type: Optional[str] = None) -> None:
        """Collective. Set up the KSP and the preconditioner's local blocks now, and raise on
        every rank if PETSc failed on any. Block-Jacobi/ASM sub-solvers are otherwise set up
        lazily inside ``KSPSolve``, where an error on one rank (ILU of a block with a missing
        diagonal entry) leaves the others waiting in the iteration's reductions. GAMG and
        the factorisations need a nonzero diagonal; PETSc fails on the ranks that hold a zero
        one inside its collective set-up, so that is checked first, on every rank."""
        err = None
        # the diagonal check scans dA's values: skip it while the operator Mat is the one the
        # last check passed on, unchanged since (its PETSc state; the Mat is held, so its
        # handle is not reused) -- dA's values were written into it, so they are the same
        checked = self._diag_checked
        key = "main" if ksp is self.ksp else "T"
        if op is None:
            op = ksp.getOperators()[0]
        stamp = (op.handle, op.stateGet(), ksp.getPC().getType() if pc_type is None else pc_type)
        if self._set_up_for.get(key) == stamp + (self._reuse.get(key),):
            # set up on this operator state and nothing rebuilt since (every rank's state moves
            # only in collective refills, so every rank takes this branch alike): PETSc's set-up
            # would do nothing, and there is nothing to check or combine
            return
        if checked.get(key, (None, None))[1] != stamp:   # (alike on every rank, as above)
            try:
                checked.pop(key, None)
                _check_diagonal(dA, ksp.getPC().getType())
            except ValueError as e:
                err = e
            # combined BEFORE the collective set-up: a rank with a zero diagonal must not leave the
            # others inside PETSc's set-up (GAMG after a value change hung here at 2+ ranks)
            check_collective(self.comm, err)
        try:
            # the options stay in the database through the set-up: GAMG creates its levels'
            # smoothers there and they read theirs then (-mg_levels_*, -pc_gamg_esteig_*)
            with temporary_options(self._entries, self._prefix):
                ksp.setUp()
                ksp.setUpOnBlocks()
            checked[key] = (op, stamp)
        except ValueError as e:
            err = e
        except PETSc.Error as e:
            sub = ksp.getPC().getType()
            hint = (" (ILU/ICC factorisations need a stored diagonal entry in every row; empty rows "
                    "make the matrix singular)" if e.ierr == 73 and sub in ("bjacobi", "asm", "ilu", "icc") else "")
            err = ValueError(f"PETSc could not set up the preconditioner {sub!r} for this matrix: "
                             f"{_petsc_message(e)}{hint}")
        check_collective(self.comm, err)
        self._set_up_for[key] = stamp + (self._reuse.get(key),)

    def _initial_guess_only(self, ksp, B, x, b, r, a, bnorm, rtol, atol, record_history, transpose):
        X = _vec(x, self.n_global, self.comm)
        R = B.duplicate()
        op = ksp.getOperators()[0]
        (op.multTranspose if transpose else op.mult)(X, R)
        R.aypx(-1.0, B)  # R = B - A X
        rnorm = R.norm()
        R.destroy(), X.destroy(), B.resetArray()
        tol = max(r * bnorm, a)
        reason = ("DIVERGED_ITS" if not rnorm <= tol else
                  "CONVERGED_ATOL" if atol > 0 and rnorm <= atol else "CONVERGED_RTOL")
        info = self._info(reason, 0, rnorm, [rnorm] if record_history else None, 0.0, 0.0, rtol, atol)
        return x.to(device=b.device, dtype=b.dtype), info

    def _info(self, reason, its, rnorm, history, setup, solve, rtol, atol, ksp=None):
        ksp = self.ksp if ksp is None else ksp
        return SolveInfo(converged=reason.startswith("CONVERGED") and reason != "CONVERGED_ITERATING",
                         reason=reason, iterations=its, residual_norm=rnorm, residual_history=history,
                         setup_time=setup, solve_time=solve, method=self.method_name,
                         backend="petsc", rtol=rtol, atol=atol,
                         pc="callable" if self.pc_type == "python" else self.pc_type)

    def operator_stamp(self, dA) -> Optional[tuple]:
        """Local. ``(Mat, PETSc state)`` of the operator Mat cached on ``dA``'s layout (every solve
        on the layout refreshes that Mat), or None when there is none yet; stamps compare equal when
        the Mat is the same (its handle: a stamp holds the Mat, so the handle is not reused) and its
        values have not changed since. A solve made on a stamp that is unchanged on every rank may
        pass ``known_bnorm`` (see :meth:`_run`)."""
        mat = cached_mat(dA, "aij")
        return None if mat is None else (mat, mat.stateGet())

    def solve(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A x = b`` for one right-hand side ``(n_local,)``.

        ``dA`` shares this solver's layout; its values are written into the cached
        Mat (in place) when they differ from the values the Mat holds.
        """
        return self._run(self.ksp, dA, b, x0, False, **kw)

    @property
    def transpose_is_forward(self) -> bool:
        """Local. True when :meth:`solve_transpose` runs the forward KSP on ``A`` itself
        (CG, MINRES), so an adjoint solve with the forward's right-hand side and initial
        guess repeats the forward solve."""
        return self.symmetric

    def _transpose_target(self, dA):
        """Collective. ``(ksp, transpose, reset_operators)`` for a solve with ``A^T``: the
        same KSP (CG/MINRES: ``A`` is symmetric; others: ``KSPSolveTranspose``) or the
        second KSP on the explicit transpose (refreshed when the values changed)."""
        if self.symmetric:
            return self.ksp, False, True
        if not self._explicit_T and self.pc_type not in ("hypre", "python"):
            return self.ksp, True, True
        if self._ksp_T is None:
            kspT = PETSc.KSP().create(comm=self.comm)
            kspT.setType(self.ksp.getType())
            if self._prefix:
                kspT.setOptionsPrefix(self._prefix)
            kspT.getPC().setType(self.pc_type)
            if self.pc_type == "python":
                kspT.getPC().setPythonContext(self._pyctx)
            kspT.setPCSide(self.ksp.getPCSide())
            kspT.setNormType(self.ksp.getNormType())
            with temporary_options(self._entries, self._prefix):
                kspT.setFromOptions()
            self._ksp_T = kspT
            self._ksp_T_state = None
        mat = dA.to_petsc(mat_type="aij")
        state = mat.stateGet()
        if self._ksp_T_state is None or state != self._ksp_T_state:
            if self._matT is not None:
                self._matT.destroy()
            self._matT = mat.transpose(PETSc.Mat())  # petsc4py: transpose() without out is IN PLACE
            self._ksp_T.setOperators(self._matT)
            self._ksp_T_state = state
        return self._ksp_T, False, False

    def solve_transpose(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A^T x = b`` reusing the operator and preconditioner.

        CG and MINRES use the same KSP (``A`` is symmetric). GMRES/BiCGStab use
        ``KSPSolveTranspose``; preconditioners without a transpose apply (hypre)
        get a second KSP on the explicit transpose, rebuilt when the values change.
        """
        ksp, transpose, reset = self._transpose_target(dA)
        if transpose:
            try:
                return self._run(ksp, dA, b, x0, True, **kw)
            except PETSc.Error:  # the PC has no transpose apply: the explicit transpose from now on
                self._explicit_T = True
                ksp, transpose, reset = self._transpose_target(dA)
        return self._run(ksp, dA, b, x0, transpose, reset_operators=reset, **kw)

    def solve_many(self, dA, B, X0=None, **kw):
        """Collective. Solve ``A X = B`` for ``B`` of shape ``(n_local, k)`` in one call:
        ``(X, [SolveInfo per column])``. See :meth:`_run_many`."""
        return self._run_many(self.ksp, dA, B, X0, False, **kw)

    def solve_transpose_many(self, dA, B, x0=None, **kw):
        """Collective. Solve ``A^T X = B`` for ``k`` columns in one call (the adjoint of
        :meth:`solve_many`), with the KSP :meth:`solve_transpose` would use."""
        ksp, transpose, reset = self._transpose_target(dA)
        if transpose:
            try:
                return self._run_many(ksp, dA, B, x0, True, **kw)
            except PETSc.Error:
                self._explicit_T = True
                ksp, transpose, reset = self._transpose_target(dA)
        return self._run_many(ksp, dA, B, x0, transpose, reset_operators=reset, **kw)

    def _run_many(self, ksp, dA, B: torch.Tensor, X0: Optional[torch.Tensor], transpose: bool, *, rtol,
                  atol, maxiter, callback, record_history, reuse_pc: bool = False,
                  reset_operators: bool = True, near_nullspace: Optional[torch.Tensor] = None) -> tuple:
        """Collective. ``k`` right-hand sides (columns of ``B``) in one call.

        What a single solve does once per call is done once for all columns: the
        operator refresh (value comparison, refill), the KSP settings, the
        near-nullspace, the preconditioner set-up and its collective checks; then
        one ``KSPSolve`` per nonzero column on two work Vecs, which is what PETSc
        3.18's ``KSPMatSolve`` does for every KSP type but HPDDM (a C loop over
        the columns; petsc4py 3.18 does not wrap it, and inside it the per-column
        converged reason is lost). The true-residual verification is vectorised:
        one sparse-times-dense product ``R = B - A X`` and one reduction for all
        column norms; columns PETSc called converged whose true residual is too
        large continue one by one exactly as a single solve does. Everything that
        holds per column for a single solve holds here: each column's tolerance
        ``max(rtol ||b_j||, atol)``, its ``x0`` column, zero columns give zeros,
        callback / history per column, one :class:`SolveInfo` per column.
        ``maxiter=0`` (and ``-ksp_max_it 0``) falls back to the column loop.
        """
        k = int(B.shape[1])
        if reset_operators:
            with _log.phase("refill", _log.event("slaMatRefill")):
                ksp.setOperators(dA.to_petsc(mat_type="aij"))
        ov = self._overrides
        max_it = ov.get("max_it", default_maxiter(self.n_global) if maxiter is None else int(maxiter))
        if max_it == 0:
            xs, infos = [], []
            for j in range(k):
                x, info = self._run(ksp, dA, B[:, j].contiguous(), None if X0 is None else X0[:, j].contiguous(),
                                    transpose, rtol=rtol, atol=atol, maxiter=maxiter, callback=callback,
                                    record_history=record_history, reuse_pc=reuse_pc, reset_operators=False,
                                    near_nullspace=near_nullspace)
                xs.append(x)
                infos.append(info)
            return torch.stack(xs, 1), infos
        # columns as rows of (k, n) buffers: each column contiguous, and the buffer is a
        # column-major (n, k) array a PETSc dense Mat can wrap without copying
        Bt = B.detach().to(device="cpu", dtype=torch.float64).t().contiguous()
        Xt = torch.zeros_like(Bt) if X0 is None else X0.detach().to(device="cpu", dtype=torch.float64).t().contiguous()
        bnorms = _column_norms(self.comm, Bt)
        zero = bnorms == 0.0  # SciPy: x = 0 whatever x0 (NaN columns are solved and fail there)
        Xt[torch.from_numpy(zero)] = 0.0
        infos = [None] * k
        for j in np.flatnonzero(zero):
            infos[j] = self._info("CONVERGED_ATOL", 0, 0.0, [0.0] if record_history else None, 0.0, 0.0,
                                  rtol, atol)
        cols = np.flatnonzero(~zero)
        if not cols.size:
            return Xt.t().to(device=B.device, dtype=B.dtype), infos
        ksp.setInitialGuessNonzero(X0 is not None or ksp.getType() in _GUESS_STATE)
        self._set_reuse(ksp, bool(reuse_pc))
        mon = self._watch(ksp, record_history or callback is not None)
        t0 = time.perf_counter()
        self._call_set_up(ksp, dA, near_nullspace)
        setup = time.perf_counter() - t0
        op = ksp.getOperators()[0]
        Xv, Bv = op.createVecs()  # work Vecs in PETSc memory (a PC may swap the solution's array)
        r0, a0 = ov.get("rtol", rtol), ov.get("atol", atol)
        divtol = ov.get("divtol", math.inf)
        res = {}
        try:
            for j in cols:
                r, a = r0, a0
                absolute = r >= 1.0  # PETSc requires rtol < 1; SciPy's test is max(rtol ||b||, atol)
                if absolute:
                    r, a = 0.0, max(r * bnorms[j], a)
                ksp.setTolerances(rtol=r, atol=a, divtol=divtol, max_it=max_it)
                self._cg_variant(ksp, absolute or r >= _SINGLE_REDUCTION_RTOL)
                Bv.getArray()[:] = Bt[j].numpy()
                Xv.getArray()[:] = Xt[j].numpy()
                mon.history = [] if record_history else None
                mon.callback = callback
                t1 = time.perf_counter()
                with _log.phase("solve"):
                    (ksp.solveTranspose if transpose else ksp.solve)(Bv, Xv)
                Xt[j].numpy()[:] = Xv.getArray(readonly=True)
                res[j] = [reason_name(ksp.getConvergedReason()), int(ksp.getIterationNumber()),
                          float(ksp.getResidualNorm()), mon.history, time.perf_counter() - t1,
                          a if absolute else max(r * bnorms[j], a), absolute]
            mon.history = mon.callback = None
            # the true residual of every column at once: one sparse x dense product
            t1 = time.perf_counter()
            with _log.phase("verify", _log.event("slaSolveVerify")):
                Xs = Xt[torch.from_numpy(cols)].contiguous()
                AX = _mat_mat(op, Xs, transpose, self.n_global, self.comm)
                ax = _column_norms(self.comm, AX)
                true = _column_norms(self.comm, Bt[torch.from_numpy(cols)] - AX)
                for i, j in enumerate(cols):
                    reason, its, rnorm, history, t_solve, tol, absolute = res[j]
                    floor = _ROUNDING_FLOOR * (bnorms[j] + ax[i])
                    if reason.startswith("CONVERGED") and not true[i] <= max(tol, floor):
                        # continue this column as a single solve would (rare)
                        Bv.getArray()[:] = Bt[j].numpy()
                        Xv.getArray()[:] = Xt[j].numpy()
                        mon.history, mon.callback = history, callback
                        reason, its, rnorm, floor = _verify_true_residual(
                            ksp, Bv, Xv, transpose, tol, max_it, its, reason, float(bnorms[j]), pnorm=rnorm)
                        res[j].append(floor)
                        mon.history = mon.callback = None
                        Xt[j].numpy()[:] = Xv.getArray(readonly=True)
                    elif reason.startswith("CONVERGED"):
                        rnorm = float(true[i])
                    if absolute and reason == "CONVERGED_ATOL" and not (atol > 0 and rnorm <= atol):
                        reason = "CONVERGED_RTOL"
                    res[j][:3] = reason, its, rnorm
            t_verify = (time.perf_counter() - t1) / cols.size
        finally:
            self._cg_variant(ksp, True)
            mon.history = mon.callback = None
            _clear_near_nullspace(ksp)
            Bv.destroy(), Xv.destroy()
        for i, j in enumerate(cols):
            reason, its, rnorm, history, t_solve = res[j][:5]
            infos[j] = self._info(reason, its, rnorm, history, setup if i == 0 else 0.0, t_solve + t_verify,
                                  rtol, atol, ksp)
            infos[j].floor = res[j][7] if len(res[j]) > 7 else None
        return Xt.t().to(device=B.device, dtype=B.dtype), infos

    def _apply_near_nullspace(self, ksp, Z: Optional[torch.Tensor]) -> None:
        """Collective. For an AMG preconditioner that reads it (``_USES_NEAR_NULLSPACE``), put
        ``span(Z)`` on the KSP's operator Mat as its near-nullspace for this call's set-up;
        the caller clears it after the solve (:func:`_clear_near_nullspace`), so it never
        reaches another solver or a later call. When ``Z`` differs from the near-nullspace
        this KSP's preconditioner was built with (compared by value on every rank;
        ``None`` included), the preconditioner is rebuilt from scratch: GAMG keeps the
        near-nullspace data of its first set-up through later rebuilds, and ``PCReset``
        leaves its levels' sizes behind."""
        if ksp.getPC().getType() not in _USES_NEAR_NULLSPACE:
            return
        key = "main" if ksp is self.ksp else "T"
        built = self._nns.get(key)
        if Z is None:
            if built is not None:
                self._nns[key] = None
                self._fresh_pc(ksp)
            return
        Zd = Z.detach().to(device="cpu", dtype=torch.float64)
        same = built is not None and built[0].shape == Zd.shape and torch.equal(built[0], Zd)
        if allreduce_int(self.comm, int(not same), MPI.MAX) == 0:   # unchanged on every rank
            nsp = built[1]
        else:
            nsp = near_nullspace_of(ksp.getOperators()[0], Zd, self.comm)
            self._nns[key] = (Zd.clone(), nsp)
            self._fresh_pc(ksp)
        ksp.getOperators()[0].setNearNullSpace(nsp)

    def _over(self, name: str, a: np.ndarray):
        """Collective on first use, then Local. This solver's Vec ``name`` over ``a``'s memory
        (float64 contiguous, owned rows; a tensor's ``numpy()`` view): made once, its array placed
        per call (``resetArray`` after the solve), so a solve sets up no Vec layout (an Allgather each)."""
        V = self._shells.get(name)
        if V is None:
            V = self._shells[name] = PETSc.Vec().createMPI((a.shape[0], self.n_global), comm=self.comm)
        V.placeArray(a)
        return V

    def _watch(self, ksp, needed: bool) -> "_Monitor":
        """Local. The monitor, set on ``ksp`` the first time a call ``needed`` it (history or
        callback) and kept from then on: a KSP without it iterates without calling into Python
        (options' monitors, ``-ksp_monitor``, are PETSc's own and unaffected)."""
        key = "main" if ksp is self.ksp else "T"
        if needed and key not in self._watched:
            ksp.setMonitor(self._monitor)
            self._watched.add(key)
        return self._monitor

    def _work(self, name: str):
        """Collective on first use, then Local. This solver's work Vec ``name`` (the layout of
        :meth:`_over`'s, PETSc-owned memory), made once."""
        V = self._shells.get(name)
        if V is None:
            V = self._shells[name] = PETSc.Vec().createMPI((self._shells["b"].getLocalSize(), self.n_global),
                                                           comm=self.comm)
        return V

    def _cg_variant(self, ksp, single: bool) -> None:
        """Local (alike on every rank: ``single`` comes from the agreed tolerances). CG's
        single-reduction variant on this solver's KSP when ``single``, else the classic one (see
        ``_SINGLE_REDUCTION_RTOL``), where this solver switches it. Between calls it rests on
        single reduction, the variant it was set up with."""
        if self._switch_cg and ksp is self.ksp and self._single != single:
            _cg_single_reduction_fn()(ksp.handle, int(single))
            self._single = single

    def _set_reuse(self, ksp, reuse: bool) -> None:
        """Local. PETSc's ``PCSetReusePreconditioner`` for this call, remembered for the set-up
        stamp (a set-up that kept the old preconditioner is not one for the current values);
        the flag is only ever set here, so an unchanged one is not set again."""
        key = "main" if ksp is self.ksp else "T"
        if self._reuse.get(key) is not reuse:
            ksp.getPC().setReusePreconditioner(reuse)
            self._reuse[key] = reuse

    def _fresh_pc(self, ksp) -> None:
        """Collective. A new preconditioner implementation of the same type and options
        (the next set-up builds it from scratch)."""
        self._set_up_for.pop("main" if ksp is self.ksp else "T", None)
        pc = ksp.getPC()
        kind = pc.getType()
        pc.setType("none")
        pc.setType(kind)
        with temporary_options(self._entries, self._prefix):
            pc.setFromOptions()

    def destroy(self) -> None:
        """Collective. Destroy the KSPs (after this the solver is unusable)."""
        for obj in (self.ksp, self._ksp_T, self._matT, *self._shells.values()):
            if obj is not None:
                obj.destroy()
        self._shells = {}
        self.ksp = self._ksp_T = self._matT = None


_VERIFY_ROUNDS = 20


@functools.lru_cache(maxsize=None)
def _cg_single_reduction_fn():
    """Local. ``KSPCGUseSingleReduction(ksp_handle, flag)`` of this process's ``libpetsc``
    (``ctypes``; not wrapped by petsc4py 3.18), or None where it cannot be found."""
    from .._petsc_values import petsc_library
    lib = petsc_library()
    fn = getattr(lib, "KSPCGUseSingleReduction", None) if lib is not None else None
    if fn is None:
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int], ctypes.c_int
    return fn


def _cpu64(t: torch.Tensor) -> torch.Tensor:
    """Local. ``t`` detached as a float64 CPU contiguous tensor (itself when it is one)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype == torch.float64 and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to(device="cpu", dtype=torch.float64).contiguous()


def _sync_solution(X, xn: np.ndarray) -> None:
    """Local. Make sure ``xn`` (the solution tensor's memory) holds the solution: some PCs
    (hypre) swap the array under a Vec created over user memory, leaving the solution in
    PETSc-owned storage."""
    arr = X.getArray(readonly=True)
    if not np.may_share_memory(arr, xn):   # another buffer (a bounds test: no address dicts made)
        xn[...] = arr


def _verify_true_residual(ksp, B, X, transpose, tol, max_it, its, reason, bnorm, pnorm=None, work=None, op=None):
    """Collective. Make "converged" mean ``||b - A x|| <= tol``, whatever PETSc tested (a
    recurrence residual, which can be far off for a singular preconditioned operator; MINRES
    with a preconditioner tests ``||B r||``; options may select ``-ksp_norm_type
    preconditioned/natural/none``): when the true residual is too large,
    continue from ``x`` with a tighter absolute tolerance on PETSc's norm, within the
    remaining ``max_it``; if that does not get there, report ``DIVERGED_ITS``.
    A tolerance below the normwise backward-error floor ``4 eps (||A||_inf ||x|| + ||b||)``
    and under ``sqrt(eps) ||b||`` is met at that floor when the true residual is also at most
    ``1e-5 ||b||`` (``_FLOOR_CAP``, the default rtol; SciPy's CG reports success there too;
    :attr:`SolveInfo.floor`).
    ``work``: two Vecs of ``B``'s layout to use for ``A x`` and the residual (else made here);
    ``op``: the KSP's operator Mat, when the caller has it.
    Returns ``(reason, iterations, true residual norm, floor accepted at or None)``."""
    A = ksp.getOperators()[0] if op is None else op
    AX, R = (B.duplicate(), B.duplicate()) if work is None else work
    backward = accepted = None
    try:
        for rounds in range(_VERIFY_ROUNDS + 1):
            (A.multTranspose if transpose else A.mult)(X, AX)
            R.waxpy(-1.0, AX, B)  # R = B - A X
            # both norms in one reduction (PETSc's split-phase norms)
            AX.normBegin(), R.normBegin()
            ax, true = AX.normEnd(), R.normEnd()
            # below the rounding floor of b - A x nothing more can be attained: a tolerance
            # under it (rtol=1e-14) is met as far as floating point allows
            floor = _ROUNDING_FLOOR * (bnorm + ax)
            if true <= max(tol, floor) or not reason.startswith("CONVERGED"):
                break
            if backward is None:   # only on this rare path: one MatNorm, one VecNorm
                backward = _BACKWARD_FLOOR * (A.norm(PETSc.NormType.INFINITY) * X.norm() + bnorm)
            # the tolerance is below what float64 attains: met at the floor, if that floor is small
            # in the usual sense too (a singular, inconsistent system has a tiny backward error
            # for a huge x: never "converged" there)
            if tol < min(backward, _FLOOR_BELOW * bnorm) and true <= min(backward, _FLOOR_CAP * bnorm):
                accepted = backward
                break
            if rounds == _VERIFY_ROUNDS or its >= max_it or ksp.getNormType() == PETSc.KSP.NormType.NONE:
                reason = "DIVERGED_ITS"
                break
            # PETSc's norm at exit (given for a column solved before other columns)
            pnorm = float(ksp.getResidualNorm()) if rounds or pnorm is None else pnorm
            ksp.setTolerances(rtol=0.0, atol=0.5 * pnorm * tol / true, max_it=max_it - its)
            ksp.setInitialGuessNonzero(True)
            (ksp.solveTranspose if transpose else ksp.solve)(B, X)
            its += int(ksp.getIterationNumber())
            reason = reason_name(ksp.getConvergedReason())
    finally:
        if work is None:
            AX.destroy(), R.destroy()
    return reason, its, float(true), accepted


def _diagonal_error(dA, pc_type: str) -> Optional[ValueError]:
    """Local. The error to raise when ``pc_type`` needs a nonzero diagonal and this rank's rows
    have a zero or missing one (PETSc would fail on this rank only, inside collective set-up)."""
    if pc_type not in _NEEDS_DIAGONAL or not dA.n_local or dA.diagonal_nonzero():
        return None
    zero = torch.nonzero(dA.diagonal().reshape(-1) == 0)
    if not zero.numel():
        return None
    row = int(zero[0, 0]) + dA.row_range[0]
    return ValueError(f"pc {pc_type!r} needs a nonzero diagonal, but row {row} (in the solver's numbering) "
                      "has a zero or missing diagonal entry (an empty row makes the matrix singular); use "
                      "pc='none' or 'jacobi', or fix the matrix")


def _check_diagonal(dA, pc_type: str) -> None:
    err = _diagonal_error(dA, pc_type)
    if err is not None:
        raise err


def _read_overrides(prefix) -> dict:
    db = PETSc.Options(prefix)
    return {key: getattr(db, getter)(name) for name, (getter, key) in _OVERRIDES.items() if db.hasName(name)}


def _petsc_message(e) -> str:
    msg = str(e).strip().splitlines()
    return msg[0] if msg else repr(e)


def _column_norms(comm, T: torch.Tensor) -> np.ndarray:
    """Collective. The 2-norms of the rows of ``T`` (``(k, n_local)`` float64, a distributed
    column each), scaled against under/overflow; two reductions of ``k`` values. NaN stays NaN."""
    from mpi4py import MPI
    k = T.shape[0]
    amax = (T.abs().amax(1) if T.shape[1] else T.new_zeros(k)).numpy().copy()
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, amax, op=MPI.MAX)
    scale = np.where(amax > 0, amax, 1.0)
    ssq = ((T / torch.from_numpy(scale)[:, None]) ** 2).sum(1).numpy().copy()
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, ssq, op=MPI.SUM)
    return scale * np.sqrt(ssq)


def _mat_mat(op, Xs: torch.Tensor, transpose: bool, n_global: int, comm) -> torch.Tensor:
    """Collective. ``A X`` (``A^T X``) for the columns ``Xs`` (``(m, n_local)``, a column per
    row), as ``(m, n_local)``: one sparse-times-dense product (MatMatMult)."""
    m, n = Xs.shape
    Xd = PETSc.Mat().createDense(((n, n_global), (PETSc.DECIDE, m)), array=Xs.numpy().reshape(-1), comm=comm)
    R = None
    try:
        R = op.transposeMatMult(Xd) if transpose else op.matMult(Xd)
        out = torch.from_numpy(np.array(R.getDenseArray(readonly=True)).T.copy())
    finally:
        Xd.destroy()
        if R is not None:
            R.destroy()
    return out.reshape(m, n)


def near_nullspace_of(mat, Z: torch.Tensor, comm):
    """Collective. A ``PETSc.NullSpace`` spanning the columns of ``Z`` (this rank's rows,
    float64), orthonormalised as ``MatNullSpaceCreate`` requires (Cholesky QR twice: one
    ``m x m`` reduction per pass). Numerically dependent columns (condition number of the
    column-scaled ``Z`` above 1e6) raise ``ValueError`` on every rank."""
    import scipy.linalg as sla
    from mpi4py import MPI
    Q, err = Z, None
    for rnd in range(2):
        G = (Q.T @ Q).numpy().copy()
        if comm.Get_size() > 1:
            comm.Allreduce(MPI.IN_PLACE, G, op=MPI.SUM)
        if rnd == 0:
            d = np.sqrt(np.diag(G))
            if not np.all(np.isfinite(G)):
                err = ValueError("near_nullspace contains NaN or infinite values")
            elif not np.all(d > 0):
                err = ValueError(f"near_nullspace column {int(np.flatnonzero(~(d > 0))[0])} is zero")
            else:
                lam = np.linalg.eigvalsh(G / np.outer(d, d))
                if not lam[0] > 1e-12 * lam[-1]:
                    err = ValueError(f"near_nullspace columns are (numerically) linearly dependent (smallest "
                                     f"eigenvalue of their scaled Gram matrix {lam[0]:.1e}); give a basis")
            check_collective(comm, err)
        L = np.linalg.cholesky(G)
        Q = torch.from_numpy(sla.solve_triangular(L, Q.numpy().T, lower=True).T.copy())
    vecs = []
    for j in range(Q.shape[1]):
        v = mat.createVecRight()
        v.getArray()[:] = Q[:, j].numpy()
        vecs.append(v)
    return PETSc.NullSpace().create(constant=False, vectors=vecs, comm=comm)


def _clear_near_nullspace(ksp) -> None:
    """Local. Leave the KSP's operator Mat without a near-nullspace (no state change)."""
    ksp.getOperators()[0].setNearNullSpace(PETSc.NullSpace())
