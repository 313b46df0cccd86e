"""The one registry of slasolve's Krylov methods and preconditioners.

Every family reads these tables: :func:`slasolve.solve` and the SciPy-signature
functions (which names exist), the PETSc backend (KSP type, preconditioning side,
norm; PC type and the option entries it needs), the torch backend (which kernel),
:func:`slasolve.nonlinear_solve`'s inner solver, :func:`slasolve.show_config` and
the error messages. Adding a Krylov method is one :class:`KrylovMethod`
registration here (plus, for the torch backend, its kernel in
:mod:`slasolve.krylov.torch_methods`); adding a PETSc preconditioner is one
:class:`Preconditioner` registration. docs/internals.md has the recipe.

Local; imports neither PETSc nor torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

__all__ = ["KrylovMethod", "Preconditioner", "KRYLOV_METHODS", "PRECONDITIONERS", "krylov_method",
           "preconditioner", "petsc_method_name", "BACKENDS", "default_backend", "register_solve_method",
           "solve_method", "solve_method_names"]

#: backends of the linear solvers (``backend=``)
BACKENDS: Tuple[str, ...] = ("petsc", "torch")


_DEFAULT_BACKEND: list = []


def default_backend() -> str:
    """Local. ``"petsc"`` when petsc4py imports, else ``"torch"`` (tried once per process:
    an import that failed does not succeed later, and one that succeeded stays loaded)."""
    if not _DEFAULT_BACKEND:
        try:
            from petsc4py import PETSc  # noqa: F401 (imports: PETSc loads)
            _DEFAULT_BACKEND.append("petsc")
        except ImportError:
            _DEFAULT_BACKEND.append("torch")
    return _DEFAULT_BACKEND[0]


@dataclass(frozen=True)
class KrylovMethod:
    """A Krylov method: its name (SciPy's), its PETSc KSP type and how it is run.

    ``symmetric``: meant for symmetric operators (the adjoint solve reuses the forward
    solver when the matrix is symmetric, checked in the backward). ``pc_side``: PETSc's
    preconditioning side; ``"right"`` keeps the unpreconditioned residual norm, which
    slasolve's ``rtol`` means, at no extra cost. ``unpreconditioned_norm``: whether
    PETSc's KSP supports that norm (MINRES does not: its true residual is checked after
    the solve). ``torch_kernel``: the function of :mod:`slasolve.krylov.torch_methods`,
    None when the method runs on the petsc backend only. ``restart``: takes ``restart``.
    """
    name: str
    petsc_type: str
    symmetric: bool = False
    pc_side: str = "left"
    unpreconditioned_norm: bool = True
    torch_kernel: Optional[str] = None
    restart: bool = False
    description: str = ""


@dataclass(frozen=True)
class Preconditioner:
    """A named preconditioner and what each backend makes of it.

    ``petsc_type``: PETSc's PC type on one rank (None: not on the petsc backend);
    ``parallel_petsc_type`` where it differs on several ranks (ILU/ICC: block Jacobi
    with ILU/ICC sub-solves, ``sub_pc_type``). ``factor_solver``: PCFactor's solver
    package. ``hypre_type``: ``PCHYPRESetType``. ``symmetric_entries``: option entries
    for the symmetric methods (CG/MINRES need a symmetric preconditioner).
    ``needs_diagonal``: its set-up reads every main-diagonal entry (checked before the
    collective set-up, so a missing or zero one raises on every rank instead of failing
    inside PETSc on one). ``uses_near_nullspace``: reads the operator's near-nullspace.
    ``torch``: built by the torch backend (on each rank's diagonal block).
    """
    name: str
    petsc_type: Optional[str] = None
    parallel_petsc_type: Optional[str] = None
    factor_solver: Optional[str] = None
    hypre_type: Optional[str] = None
    symmetric_entries: Dict[str, str] = field(default_factory=dict)
    needs_diagonal: bool = False
    uses_near_nullspace: bool = False
    torch: bool = False
    description: str = ""

    def petsc_entries(self, comm_size: int, method: str) -> Dict[str, str]:
        """Local. Option entries this preconditioner needs for ``method`` on ``comm_size`` ranks."""
        entries = {}
        if comm_size > 1 and self.parallel_petsc_type is not None:
            entries["sub_pc_type"] = self.petsc_type
        if krylov_method(method).symmetric:
            entries.update(self.symmetric_entries)
        return entries


KRYLOV_METHODS: Dict[str, KrylovMethod] = {m.name: m for m in (
    KrylovMethod("cg", "cg", symmetric=True, torch_kernel="cg",
                 description="conjugate gradients (symmetric positive definite A)"),
    KrylovMethod("gmres", "gmres", pc_side="right", torch_kernel="gmres", restart=True,
                 description="restarted GMRES (general A)"),
    KrylovMethod("minres", "minres", symmetric=True, unpreconditioned_norm=False, torch_kernel="minres",
                 description="MINRES (symmetric, possibly indefinite A)"),
    KrylovMethod("bicgstab", "bcgs", pc_side="right", torch_kernel="bicgstab",
                 description="BiCGStab (general A)"),
    KrylovMethod("cgs", "cgs", pc_side="right", torch_kernel="cgs",
                 description="conjugate gradients squared (general A)"),
    KrylovMethod("tfqmr", "tfqmr", pc_side="right", torch_kernel="tfqmr",
                 description="transpose-free QMR (general A)"),
)}

PRECONDITIONERS: Dict[str, Preconditioner] = {p.name: p for p in (
    Preconditioner("none", "none", torch=True, description="no preconditioner"),
    Preconditioner("jacobi", "jacobi", torch=True, description="point Jacobi (main diagonal)"),
    Preconditioner("bjacobi", "bjacobi", needs_diagonal=True, torch=True,
                   description="block Jacobi, ILU(0) on each rank's diagonal block"),
    Preconditioner("ilu", "ilu", parallel_petsc_type="bjacobi", needs_diagonal=True, torch=True,
                   description="ILU(0) (block Jacobi with ILU(0) blocks on several ranks)"),
    Preconditioner("icc", "icc", parallel_petsc_type="bjacobi", needs_diagonal=True, torch=True,
                   description="IC(0) (block Jacobi with IC(0) blocks on several ranks)"),
    Preconditioner("sor", "sor", needs_diagonal=True,
                   description="symmetric SOR sweeps on each rank's rows (PETSc's local SSOR)"),
    # PETSc's default restricted ASM is not symmetric: CG/MINRES stall with it
    Preconditioner("asm", "asm", symmetric_entries={"pc_asm_type": "basic"}, needs_diagonal=True,
                   description="additive Schwarz, overlap 1, ILU(0) subdomain solves"),
    Preconditioner("gamg", "gamg", needs_diagonal=True, uses_near_nullspace=True,
                   description="smoothed-aggregation algebraic multigrid (PETSc GAMG)"),
    Preconditioner("hypre", "hypre", hypre_type="boomeramg",
                   description="hypre BoomerAMG (when PETSc has hypre)"),
    Preconditioner("lu", "lu", factor_solver="mumps", description="MUMPS LU (exact)"),
    Preconditioner("cholesky", "cholesky", factor_solver="mumps", description="MUMPS Cholesky (exact)"),
)}


def krylov_method(name) -> KrylovMethod:
    """Local. The registered method ``name``; ``ValueError`` naming the known ones otherwise."""
    method = KRYLOV_METHODS.get(name) if isinstance(name, str) else None
    if method is None:
        raise ValueError(f"method must be one of {tuple(KRYLOV_METHODS)}, got {name!r}")
    return method


def preconditioner(name, backend: str) -> Preconditioner:
    """Local. The registered preconditioner ``name`` (None: ``"none"``) available on ``backend``;
    ``ValueError`` naming the ones that are otherwise."""
    pc = PRECONDITIONERS.get("none" if name is None else name) if isinstance(name, (str, type(None))) \
        else None
    ok = pc is not None and (pc.torch if backend == "torch" else pc.petsc_type is not None)
    if not ok:
        names = ", ".join(p.name for p in PRECONDITIONERS.values()
                          if (p.torch if backend == "torch" else p.petsc_type is not None))
        hint = " (or backend='petsc' for the others)" if backend == "torch" else ""
        raise ValueError(f"pc {name!r} is not available in the {backend} backend; use one of {names} or "
                         f"a callable{hint}")
    return pc


def petsc_method_name(ksp_type: str) -> str:
    """Local. slasolve's name of a PETSc KSP type (``"bcgs"`` -> ``"bicgstab"``), else PETSc's."""
    for m in KRYLOV_METHODS.values():
        if m.petsc_type == ksp_type:
            return m.name
    return ksp_type


#: ``slasolve.solve(A, b, method)`` for methods that are not Krylov methods, registered by the
#: family implementing them when it is imported (:mod:`slasolve.direct`: ``"direct"``), so the
#: Krylov family dispatches to them without importing them
_SOLVE_METHODS: Dict[str, Callable] = {}


def register_solve_method(name: str, fn: Callable) -> None:
    """Local. Make ``slasolve.solve(A, b, name, **kw)`` call ``fn(A, b, **kw)``."""
    if name in KRYLOV_METHODS:
        raise ValueError(f"{name!r} is a Krylov method")
    _SOLVE_METHODS[name] = fn


def solve_method(name) -> Optional[Callable]:
    """Local. The function registered for the non-Krylov method ``name``, else None."""
    return _SOLVE_METHODS.get(name) if isinstance(name, str) else None


def solve_method_names() -> Tuple[str, ...]:
    """Local. Every method name ``slasolve.solve`` accepts."""
    return tuple(KRYLOV_METHODS) + tuple(_SOLVE_METHODS)
