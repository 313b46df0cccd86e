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

The KSP is cached (see ``solve._solver``) and reused while only the right-hand
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
  (:func:`slasolve.petsc.temporary_options`); entries of the options database
  (``petsc_options`` or the command line) for ``ksp_rtol``, ``ksp_atol``,
  ``ksp_max_it`` and ``ksp_divtol`` take precedence over the keyword arguments,
  as in PETSc (``setFromOptions`` after the programmatic settings);
* new values are written into the same Mat (:func:`slasolve.petsc.to_petsc_mat`
  compares them with what the Mat holds), which changes the Mat's state, and
  PETSc rebuilds the preconditioner on the next solve. For GAMG slasolve sets
  ``-pc_gamg_reuse_interpolation false`` (unless the options database says
  otherwise): PETSc 3.18 otherwise keeps the old prolongators *and* the
  Chebyshev eigenvalue estimates made for the old matrix, which can give
  ``DIVERGED_INDEFINITE_PC`` after large value changes (SIMP densities).
"""
from __future__ import annotations

import math
import time
from typing import Optional

import torch

from .. import _log
from .._comm import check_collective
from ..petsc import PETSc, option_entries, temporary_options
from .info import REASONS, SolveInfo
from .torch_methods import default_maxiter

__all__ = ["PetscKrylov", "reason_name", "ksp_method_name"]

_KSP_TYPES = {"cg": "cg", "gmres": "gmres", "minres": "minres", "bicgstab": "bcgs"}
_FROM_KSP = {v: k for k, v in _KSP_TYPES.items()}
_SYMMETRIC = {"cg", "minres"}
# KSP types that keep the last nonzero initial guess and add it to later solutions
_GUESS_STATE = {"bcgs", "fbcgs", "fbcgsr", "pipebcgs"}
# option defaults slasolve sets (only where the options database has no entry)
_DEFAULT_ENTRIES = {"pc_gamg_reuse_interpolation": "false"}
# preconditioners whose PETSc set-up fails (on the ranks holding it, inside collective
# set-up) or divides by a zero diagonal entry
_ROUNDING_FLOOR = 1e3 * 2.220446049250313e-16  # x eps (||b|| + ||A x||)
_NEEDS_DIAGONAL = ("gamg", "ilu", "icc", "bjacobi", "asm", "sor")
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


def ksp_method_name(ksp_type: str) -> str:
    """Local. slasolve's name of a KSP type (``"bcgs"`` -> ``"bicgstab"``), else PETSc's."""
    return _FROM_KSP.get(ksp_type, ksp_type)


def _pc_entries(name: Optional[str], comm_size: int) -> dict:
    """Option entries a named preconditioner needs (applied with the call's options)."""
    if name in ("ilu", "icc") and comm_size > 1:
        # PETSc's parallel ILU/ICC is block Jacobi with ILU/ICC sub-solves
        return {"sub_pc_type": name}
    return {}


def _configure_pc(pc, name: Optional[str], comm_size: int) -> None:
    name = "none" if name is None else name
    if name in ("none", "jacobi", "asm", "gamg", "bjacobi"):
        pc.setType(name)
    elif name in ("ilu", "icc"):
        pc.setType(name if comm_size == 1 else "bjacobi")
    elif name == "hypre":
        pc.setType("hypre")
        pc.setHYPREType("boomeramg")
    elif name in ("lu", "cholesky"):
        pc.setType(name)
        pc.setFactorSolverType("mumps")
    else:
        raise ValueError(f"pc {name!r} is not known to the petsc backend; use one of none, jacobi, "
                         "bjacobi, ilu, icc, asm, gamg, hypre, lu, cholesky or a callable")


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


class PetscKrylov:
    """Collective (constructor). A cached KSP for one operator layout and method.

    Configuration errors (unknown ``ksp_type`` in the options, a preconditioner PETSc
    cannot set up) raise ``ValueError`` from the constructor, which the caller combines
    across ranks.
    """

    backend = "petsc"

    def __init__(self, dA, method: str, pc, *, restart: int = 30, options_prefix: Optional[str] = None,
                 petsc_options: Optional[dict] = None):
        if method not in _KSP_TYPES:
            raise ValueError(f"method must be one of {sorted(_KSP_TYPES)}, got {method!r}")
        self.method = method
        self.comm = dA.comm
        self.n_global = dA.global_shape[0] * (dA.local.block_shape[0] if dA.local.is_block else 1)
        t0 = time.perf_counter()
        # block tensors go to KSP as AIJ with the block size set: every PC accepts
        # that (GAMG and hypre do not take BAIJ in PETSc 3.18)
        mat = dA.to_petsc(mat_type="aij")
        ksp = PETSc.KSP().create(comm=self.comm)
        self.ksp, self._ksp_T, self._matT = ksp, None, None
        self._monitor = _Monitor()
        self._pyctx = None
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
        ksp.setType(_KSP_TYPES[method])
        if options_prefix:
            ksp.setOptionsPrefix(options_prefix)
        if method == "gmres":
            ksp.setGMRESRestart(int(restart))
        pcobj = ksp.getPC()
        if callable(pc):
            pcobj.setType("python")
            self._pyctx = _PyPC(pc, dA.n_local, dA.dtype)
            pcobj.setPythonContext(self._pyctx)
        else:
            _configure_pc(pcobj, pc, self.comm.Get_size())
        if method in ("gmres", "bicgstab"):
            ksp.setPCSide(PETSc.PC.Side.RIGHT)
        if method != "minres":
            ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        ksp.setMonitor(self._monitor)
        self._entries = self._option_entries(pc if isinstance(pc, str) else None, options_prefix,
                                             petsc_options)
        self._prefix = options_prefix
        with temporary_options(self._entries, options_prefix):
            ksp.setFromOptions()
            self._overrides = _read_overrides(options_prefix)
        check_collective(self.comm, _diagonal_error(dA, ksp.getPC().getType()))  # before the collective set-up
        ksp.setUp()  # configuration errors surface here, inside the collective check
        self.ksp_type = ksp.getType()
        self.pc_type = ksp.getPC().getType()
        self.norm = ("preconditioned" if ksp.getNormType() == PETSc.KSP.NormType.PRECONDITIONED
                     and self.pc_type != "none" else "unpreconditioned")

    def _option_entries(self, pc_name, prefix, petsc_options) -> dict:
        user = option_entries(petsc_options)
        db = PETSc.Options(prefix)
        entries = {k: v for k, v in {**_DEFAULT_ENTRIES, **_pc_entries(pc_name, self.comm.Get_size())}.items()
                   if not db.hasName(k)}
        entries.update(user)
        return entries

    def set_callable(self, fn) -> None:
        """Local. Use ``fn`` as the (python) preconditioner from now on."""
        if self._pyctx is not None:
            self._pyctx.fn = fn

    def _run(self, ksp, dA, b: torch.Tensor, x0: Optional[torch.Tensor], transpose: bool, *, rtol, atol,
             maxiter, callback, record_history, reuse_pc: bool = False,
             reset_operators: bool = True) -> tuple:
        if reset_operators:
            ksp.setOperators(dA.to_petsc(mat_type="aij"))  # refilled in place when the values changed
        bb = b.detach().to(device="cpu", dtype=torch.float64).contiguous()
        B = _vec(bb, self.n_global, self.comm)
        bnorm = B.norm()
        if bnorm == 0.0:  # SciPy: x = 0 whatever x0
            B.destroy()
            return torch.zeros_like(b), self._info("CONVERGED_ATOL", 0, 0.0, [0.0] if record_history else None,
                                                   0.0, 0.0, rtol, atol)
        ov = self._overrides
        r, a = ov.get("rtol", rtol), ov.get("atol", atol)
        absolute = r >= 1.0  # PETSc requires rtol < 1; SciPy's test is max(rtol ||b||, atol)
        if absolute:
            r, a = 0.0, max(r * bnorm, a)
        max_it = ov.get("max_it", default_maxiter(self.n_global) if maxiter is None else int(maxiter))
        ksp.setTolerances(rtol=r, atol=a, divtol=ov.get("divtol", math.inf), max_it=max_it)
        x = torch.zeros(b.shape[0], dtype=torch.float64) if x0 is None else \
            x0.detach().to(device="cpu", dtype=torch.float64).clone()
        if max_it == 0:  # PETSc's KSPs still take one step; test the initial guess only (torch backend)
            return self._initial_guess_only(ksp, B, x, b, r, a, bnorm, rtol, atol, record_history, transpose)
        ksp.setInitialGuessNonzero(x0 is not None or ksp.getType() in _GUESS_STATE)
        ksp.getPC().setReusePreconditioner(bool(reuse_pc))
        X = _vec(x, self.n_global, self.comm)
        mon = self._monitor
        mon.history = [] if record_history else None
        mon.callback = callback
        t0 = time.perf_counter()
        try:
            with _log.phase("setup", _log.event("slaPCSetUp")):
                self._set_up(ksp, dA)
        except ValueError:
            B.destroy(), X.destroy()
            raise
        t1 = time.perf_counter()
        try:
            with _log.phase("solve"):
                if transpose:
                    ksp.solveTranspose(B, X)
                else:
                    ksp.solve(B, X)
            reason = reason_name(ksp.getConvergedReason())
            its, rnorm = int(ksp.getIterationNumber()), float(ksp.getResidualNorm())
            if reason.startswith("CONVERGED"):
                # PETSc tests a recurrence (GMRES: the least-squares residual) or another norm;
                # "converged" must mean the true residual passes (GMRES + GAMG on a singular,
                # inconsistent system reported 1e-9 for a true residual of 1). One MatMult.
                tol = a if absolute else max(r * bnorm, a)
                with _log.phase("verify", _log.event("slaSolveVerify")):
                    reason, its, rnorm = _verify_true_residual(ksp, B, X, transpose, tol, max_it, its,
                                                                reason, float(bnorm))
            _sync_solution(X, x)
            t2 = time.perf_counter()
            history = mon.history
        finally:
            mon.history = mon.callback = None
            B.destroy(), X.destroy()
        if absolute and reason == "CONVERGED_ATOL" and not (atol > 0 and rnorm <= atol):
            reason = "CONVERGED_RTOL"
        info = self._info(reason, its, rnorm, history, t1 - t0, t2 - t1, rtol, atol, ksp)
        return x.to(device=b.device, dtype=b.dtype), info

    def _set_up(self, ksp, dA) -> None:
        """Collective. Set up the KSP and the preconditioner's local blocks now, and raise on
        every rank if PETSc failed on any. Block-Jacobi/ASM sub-solvers are otherwise set up
        lazily inside ``KSPSolve``, where an error on one rank (ILU of a block with a missing
        diagonal entry) leaves the others waiting in the iteration's reductions. GAMG and
        the factorisations need a nonzero diagonal; PETSc fails on the ranks that hold a zero
        one inside its collective set-up, so that is checked first, on every rank."""
        err = None
        try:
            _check_diagonal(dA, ksp.getPC().getType())
            ksp.setUp()
            ksp.setUpOnBlocks()
        except ValueError as e:
            err = e
        except PETSc.Error as e:
            sub = ksp.getPC().getType()
            hint = (" (ILU/ICC factorisations need a stored diagonal entry in every row; empty rows "
                    "make the matrix singular)" if e.ierr == 73 and sub in ("bjacobi", "asm", "ilu", "icc") else "")
            err = ValueError(f"PETSc could not set up the preconditioner {sub!r} for this matrix: "
                             f"{_petsc_message(e)}{hint}")
        check_collective(self.comm, err)

    def _initial_guess_only(self, ksp, B, x, b, r, a, bnorm, rtol, atol, record_history, transpose):
        X = _vec(x, self.n_global, self.comm)
        R = B.duplicate()
        op = ksp.getOperators()[0]
        (op.multTranspose if transpose else op.mult)(X, R)
        R.aypx(-1.0, B)  # R = B - A X
        rnorm = R.norm()
        R.destroy(), X.destroy(), B.destroy()
        tol = max(r * bnorm, a)
        reason = ("DIVERGED_ITS" if not rnorm <= tol else
                  "CONVERGED_ATOL" if atol > 0 and rnorm <= atol else "CONVERGED_RTOL")
        info = self._info(reason, 0, rnorm, [rnorm] if record_history else None, 0.0, 0.0, rtol, atol)
        return x.to(device=b.device, dtype=b.dtype), info

    def _info(self, reason, its, rnorm, history, setup, solve, rtol, atol, ksp=None):
        ksp = self.ksp if ksp is None else ksp
        return SolveInfo(converged=reason.startswith("CONVERGED") and reason != "CONVERGED_ITERATING",
                         reason=reason, iterations=its, residual_norm=rnorm, residual_history=history,
                         setup_time=setup, solve_time=solve, method=ksp_method_name(self.ksp_type),
                         backend="petsc", rtol=rtol, atol=atol,
                         pc="callable" if self.pc_type == "python" else self.pc_type)

    def solve(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A x = b`` for one right-hand side ``(n_local,)``.

        ``dA`` shares this solver's layout; its values are written into the cached
        Mat (in place) when they differ from the values the Mat holds.
        """
        return self._run(self.ksp, dA, b, x0, False, **kw)

    def solve_transpose(self, dA, b, **kw):
        """Collective. Solve ``A^T x = b`` reusing the operator and preconditioner.

        CG and MINRES use the same KSP (``A`` is symmetric). GMRES/BiCGStab use
        ``KSPSolveTranspose``; preconditioners without a transpose apply (hypre)
        get a second KSP on the explicit transpose, rebuilt when the values change.
        """
        if self.method in _SYMMETRIC:
            return self._run(self.ksp, dA, b, None, False, **kw)
        if self._ksp_T is None and self.pc_type not in ("hypre", "python"):
            try:
                return self._run(self.ksp, dA, b, None, True, **kw)
            except PETSc.Error:
                pass
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
            kspT.setMonitor(self._monitor)
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
        return self._run(self._ksp_T, dA, b, None, False, reset_operators=False, **kw)

    def destroy(self) -> None:
        """Collective. Destroy the KSPs (after this the solver is unusable)."""
        for obj in (self.ksp, self._ksp_T, self._matT):
            if obj is not None:
                obj.destroy()
        self.ksp = self._ksp_T = self._matT = None


_VERIFY_ROUNDS = 20


def _sync_solution(X, x: torch.Tensor) -> None:
    """Local. Make sure ``x`` holds the solution: some PCs (hypre) swap the array under a
    Vec created over user memory, leaving the solution in PETSc-owned storage."""
    arr = X.getArray(readonly=True)
    xn = x.numpy()
    if arr.__array_interface__["data"][0] != xn.__array_interface__["data"][0]:
        xn[...] = arr


def _verify_true_residual(ksp, B, X, transpose, tol, max_it, its, reason, bnorm):
    """Collective. Make "converged" mean ``||b - A x|| <= tol``, whatever PETSc tested (a
    recurrence residual, which can be far off for a singular preconditioned operator; MINRES
    with a preconditioner tests ``||B r||``; options may select ``-ksp_norm_type
    preconditioned/natural/none``): when the true residual is too large,
    continue from ``x`` with a tighter absolute tolerance on PETSc's norm, within the
    remaining ``max_it``; if that does not get there, report ``DIVERGED_ITS``.
    Returns ``(reason, iterations, true residual norm)``."""
    A = ksp.getOperators()[0]
    R = B.duplicate()
    try:
        for rounds in range(_VERIFY_ROUNDS + 1):
            (A.multTranspose if transpose else A.mult)(X, R)
            ax = R.norm()
            R.aypx(-1.0, B)  # R = B - A X
            true = R.norm()
            # below the rounding floor of b - A x nothing more can be attained: a tolerance
            # under it (rtol=1e-14) is met as far as floating point allows
            floor = _ROUNDING_FLOOR * (bnorm + ax)
            if true <= max(tol, floor) or not reason.startswith("CONVERGED"):
                break
            if rounds == _VERIFY_ROUNDS or its >= max_it or ksp.getNormType() == PETSc.KSP.NormType.NONE:
                reason = "DIVERGED_ITS"
                break
            pnorm = float(ksp.getResidualNorm())
            ksp.setTolerances(rtol=0.0, atol=0.5 * pnorm * tol / true, max_it=max_it - its)
            ksp.setInitialGuessNonzero(True)
            (ksp.solveTranspose if transpose else ksp.solve)(B, X)
            its += int(ksp.getIterationNumber())
            reason = reason_name(ksp.getConvergedReason())
    finally:
        R.destroy()
    return reason, its, float(true)


def _diagonal_error(dA, pc_type: str) -> Optional[ValueError]:
    """Local. The error to raise when ``pc_type`` needs a nonzero diagonal and this rank's rows
    have a zero or missing one (PETSc would fail on this rank only, inside collective set-up)."""
    if pc_type not in _NEEDS_DIAGONAL or not dA.n_local:
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
