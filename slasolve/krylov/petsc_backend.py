"""KSP backend: slasolve's solve options mapped onto PETSc KSP/PC.

Tolerances: PETSc's default convergence test ``||r|| <= max(rtol ||b||, atol)``
on the *unpreconditioned* residual norm (CG: left preconditioning with
``KSP_NORM_UNPRECONDITIONED``; GMRES/BiCGStab: right preconditioning), so
``rtol`` means what it means in SciPy. MINRES in PETSc 3.18 supports only the
preconditioned norm: with a preconditioner its ``rtol`` applies to ``||B r||``
(``SolveInfo.norm`` says which norm was tested).

The KSP is cached on the operator's layout and reused while only the right-hand
side changes; when the values change, the same Mat is refilled in place and PETSc
rebuilds the preconditioner on the next solve (it tracks the Mat's state).
"""
from __future__ import annotations

import time
from typing import Optional

import torch

from ..petsc import PETSc, set_options, tensor_to_vec
from .info import REASONS, SolveInfo

__all__ = ["PetscKrylov", "reason_name"]

_KSP_TYPES = {"cg": "cg", "gmres": "gmres", "minres": "minres", "bicgstab": "bcgs"}
_SYMMETRIC = {"cg", "minres"}

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


def _configure_pc(pc, name: Optional[str], comm_size: int) -> None:
    name = "none" if name is None else name
    if name in ("none", "jacobi", "asm", "gamg"):
        pc.setType(name)
    elif name == "bjacobi":
        pc.setType("bjacobi")
    elif name in ("ilu", "icc"):
        if comm_size == 1:
            pc.setType(name)
        else:  # PETSc's parallel ILU/ICC is block Jacobi with ILU/ICC sub-solves
            pc.setType("bjacobi")
            opts = PETSc.Options(pc.getOptionsPrefix())
            opts["sub_pc_type"] = name
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
    """A user callable ``z = fn(r)`` as a PETSc ``python`` PC."""

    def __init__(self, fn, n_local, dtype):
        self.fn, self.n, self.dtype = fn, n_local, dtype

    def apply(self, pc, x, y):
        r = torch.from_numpy(x.getArray(readonly=True).copy()).to(self.dtype)
        z = self.fn(r)
        y.setArray(z.detach().cpu().to(torch.float64).numpy())

    applyTranspose = apply


class PetscKrylov:
    """Collective (constructor). A cached KSP for one operator layout and method."""

    backend = "petsc"

    def __init__(self, dA, method: str, pc, *, restart: int = 30, options_prefix: Optional[str] = None,
                 petsc_options: Optional[dict] = None):
        if method not in _KSP_TYPES:
            raise ValueError(f"method must be one of {sorted(_KSP_TYPES)}, got {method!r}")
        self.method = method
        self.comm = dA.comm
        self._dA = dA
        t0 = time.perf_counter()
        # block tensors go to KSP as AIJ with the block size set: every PC accepts
        # that (GAMG and hypre do not take BAIJ in PETSc 3.18)
        mat = dA.to_petsc(mat_type="aij")
        ksp = PETSc.KSP().create(comm=self.comm)
        ksp.setOperators(mat)
        ksp.setType(_KSP_TYPES[method])
        if options_prefix:
            ksp.setOptionsPrefix(options_prefix)
        if method == "gmres":
            ksp.setGMRESRestart(int(restart))
        pcobj = ksp.getPC()
        if callable(pc):
            pcobj.setType("python")
            pcobj.setPythonContext(_PyPC(pc, dA.n_local, dA.dtype))
        else:
            _configure_pc(pcobj, pc, self.comm.Get_size())
        if method in ("gmres", "bicgstab"):
            ksp.setPCSide(PETSc.PC.Side.RIGHT)
        if method != "minres":
            ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        self.norm = "unpreconditioned" if method != "minres" or pc in (None, "none") else "preconditioned"
        set_options(petsc_options, options_prefix)
        ksp.setFromOptions()
        self.ksp = ksp
        self.setup_time = time.perf_counter() - t0
        self._ksp_T = None
        self._history = None
        self._callback = None
        ksp.setMonitor(self._monitor)

    def _monitor(self, ksp, its, rnorm):
        if self._history is not None:
            self._history.append(float(rnorm))
        if self._callback is not None and its > 0:
            self._callback(int(its), float(rnorm))

    def _run(self, ksp, b: torch.Tensor, x0: Optional[torch.Tensor], transpose: bool, *, rtol, atol,
             maxiter, callback, record_history, reset_operators: bool = True) -> tuple:
        if reset_operators:
            ksp.setOperators(self._dA.to_petsc(mat_type="aij"))  # the Mat is refilled in place when values changed
        kw = {"rtol": rtol, "atol": atol}
        if maxiter is not None:
            kw["max_it"] = int(maxiter)
        ksp.setTolerances(**kw)
        x = torch.zeros(b.shape[0], dtype=torch.float64) if x0 is None else \
            x0.detach().to(device="cpu", dtype=torch.float64).clone()
        ksp.setInitialGuessNonzero(x0 is not None)
        B = tensor_to_vec(b, self.comm)
        X = tensor_to_vec(x, self.comm)
        self._history = [] if record_history else None
        self._callback = callback
        t0 = time.perf_counter()
        ksp.setUp()
        t1 = time.perf_counter()
        if transpose:
            ksp.solveTranspose(B, X)
        else:
            ksp.solve(B, X)
        t2 = time.perf_counter()
        B.destroy(), X.destroy()
        reason = reason_name(ksp.getConvergedReason())
        info = SolveInfo(converged=reason.startswith("CONVERGED") and reason != "CONVERGED_ITERATING",
                         reason=reason, iterations=int(ksp.getIterationNumber()),
                         residual_norm=float(ksp.getResidualNorm()), residual_history=self._history,
                         setup_time=t1 - t0, solve_time=t2 - t1, method=self.method, backend="petsc",
                         rtol=rtol, atol=atol)
        self._history = self._callback = None
        return x.to(device=b.device, dtype=b.dtype), info

    def solve(self, dA, b, x0=None, **kw):
        """Collective. Solve ``A x = b`` for one right-hand side ``(n_local,)``.

        ``dA`` shares this solver's layout; its values are written into the cached
        Mat (in place) when they differ from the last solve's.
        """
        self._dA = dA
        return self._run(self.ksp, b, x0, False, **kw)

    def solve_transpose(self, dA, b, **kw):
        """Collective. Solve ``A^T x = b`` reusing the operator and preconditioner.

        CG and MINRES use the same KSP (``A`` is symmetric). GMRES/BiCGStab use
        ``KSPSolveTranspose``; preconditioners without a transpose apply (hypre)
        get a second KSP on the explicit transpose, built once and cached.
        """
        self._dA = dA
        if self.method in _SYMMETRIC:
            return self._run(self.ksp, b, None, False, **kw)
        if self._ksp_T is None and self.ksp.getPC().getType() not in ("hypre", "python"):
            try:
                return self._run(self.ksp, b, None, True, **kw)
            except PETSc.Error:
                pass
        if self._ksp_T is None:
            kspT = PETSc.KSP().create(comm=self.comm)
            kspT.setType(self.ksp.getType())
            kspT.setOptionsPrefix(self.ksp.getOptionsPrefix())
            kspT.getPC().setType(self.ksp.getPC().getType())
            if self.ksp.getPC().getType() == "hypre":
                kspT.getPC().setHYPREType("boomeramg")
            kspT.setPCSide(self.ksp.getPCSide())
            kspT.setNormType(self.ksp.getNormType())
            kspT.setMonitor(self._monitor)
            self._ksp_T = kspT
            self._ksp_T_state = None
        mat = self._dA.to_petsc(mat_type="aij")
        state = mat.stateGet() if hasattr(mat, "stateGet") else None
        if self._ksp_T_state is None or state != self._ksp_T_state:
            self._matT = mat.transpose()
            self._ksp_T.setOperators(self._matT)
            self._ksp_T_state = state
        return self._run(self._ksp_T, b, None, False, reset_operators=False, **kw)
