"""Solver result record (:class:`SolveInfo`) and :class:`ConvergenceError`.

Reason strings are the names of PETSc's ``KSPConvergedReason`` values, so a
result reads the same whether it came from the PETSc or the torch backend.
Everything here is local (no communication).
"""
from __future__ import annotations

from dataclasses import dataclass, field

#: converged reasons (PETSc names)
CONVERGED_REASONS = (
    "CONVERGED_RTOL",
    "CONVERGED_ATOL",
    "CONVERGED_ITS",  # unused by the torch kernels (PETSc's KSPPREONLY)
    "CONVERGED_RTOL_NORMAL",
    "CONVERGED_ATOL_NORMAL",
    "CONVERGED_HAPPY_BREAKDOWN",
)
#: diverged reasons (PETSc names)
DIVERGED_REASONS = (
    "DIVERGED_NULL",
    "DIVERGED_ITS",
    "DIVERGED_DTOL",
    "DIVERGED_BREAKDOWN",
    "DIVERGED_BREAKDOWN_BICG",
    "DIVERGED_NONSYMMETRIC",
    "DIVERGED_INDEFINITE_PC",
    "DIVERGED_NANORINF",
    "DIVERGED_INDEFINITE_MAT",
    "DIVERGED_PC_FAILED",
)
#: every reason string a SolveInfo may carry ("CONVERGED_ITERATING" = not finished)
REASONS = CONVERGED_REASONS + DIVERGED_REASONS + ("CONVERGED_ITERATING",)


@dataclass
class SolveInfo:
    """Outcome of one linear solve.

    ``iterations`` counts Krylov iterations as PETSc does (the residual of
    the initial guess is iteration 0 and is not counted).
    ``residual_norm`` is the unpreconditioned 2-norm ``||b - A x||`` (as
    tracked by the method's recurrence) at exit; ``residual_history`` is
    filled when the solver was asked to record it, entry 0 being the initial
    residual and entry ``k`` the residual after iteration ``k``.
    ``setup_time``/``solve_time`` are wall-clock seconds.
    ``times``: this rank's wall-clock seconds per phase of the call (``slasolve.solve``
    fills it): ``"check"`` (argument validation, one reduction), ``"setup"`` (solver
    creation on a cache miss, PETSc Mat creation, preconditioner set-up), ``"refill"``
    (comparing the values with the PETSc Mat's snapshot and refilling it), ``"solve"``
    (the Krylov iteration), ``"verify"`` (the true-residual check), ``"halo"`` (halo
    exchanges outside the phases above: the torch backend's products), each exclusive
    of the others, and ``"total"`` (the whole call; the phases add up to at most it).
    For several right-hand sides the entries are sums over the columns. A backward
    pass through the solve adds ``"adjoint"`` (seconds in the adjoint solves, not part of
    ``"total"``) and sets ``adjoint`` to the adjoint solve's own SolveInfo.
    ``pc_reuse``: for a call with ``reuse_pc`` other than ``False``, the preconditioner
    reuse decision ``{"mode", "rebuilt", "retried", "discarded_iterations"}`` (see
    :func:`slasolve.solve`); ``None`` otherwise. ``per_rhs``: for several right-hand
    sides solved column by column, each column's SolveInfo (this one merges them).
    ``norm``: the residual norm the stopping test used, ``"unpreconditioned"`` or
    ``"preconditioned"`` (``slasolve.solve`` fills it; ``""`` elsewhere).
    ``same_as_forward`` (an adjoint's SolveInfo only): the adjoint system was the forward
    one (same symmetric operator and preconditioner, same right-hand side and initial
    guess: e.g. the compliance ``f . u``), so the forward's solution was returned without
    iterating again (``iterations`` 0; reason and residual are the forward's).
    ``floor``: ``None`` when ``||b - A x|| <= max(rtol ||b||, atol)`` held; else the
    attainable floor the answer was accepted at (petsc backend): the requested tolerance
    lies below ``4 eps (||A||_inf ||x|| + ||b||)`` (a normwise backward error of 4 eps,
    Rigal-Gaches) and below ``sqrt(eps) ||b||``, the method's own test passed, and ``residual_norm`` (the true one) is
    within that floor and at most ``1e-5 ||b||``, the default rtol (so a singular, inconsistent
    system, whose huge ``x`` has a tiny backward error and a residual near ``||b||``, is never
    accepted). SIMP matrices with a 1e-9 void stiffness have ``||A|| ||x||``
    10^5-10^8 times ``||b||``: ``rtol=1e-12`` is then below what float64 can attain, and
    SciPy's CG (which tests its recurrence only) reports success as well.
    ``method``/``pc`` name what actually ran (after ``petsc_options`` / command-line
    ``-ksp_type`` / ``-pc_type``): slasolve's name where there is one (``"bicgstab"``),
    else PETSc's (``"fgmres"``, ``"bjacobi"``); ``pc="callable"`` for a user function.
    """

    converged: bool
    reason: str
    iterations: int
    residual_norm: float
    residual_history: list[float] | None = None
    setup_time: float = 0.0
    solve_time: float = 0.0
    method: str = ""
    backend: str = ""
    rtol: float = 0.0
    atol: float = 0.0
    pc: str = ""
    times: dict = field(default_factory=dict)
    adjoint: "SolveInfo | None" = None
    pc_reuse: dict | None = None
    per_rhs: "list[SolveInfo] | None" = None
    same_as_forward: bool = False
    norm: str = ""
    floor: float | None = None

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"SolveInfo: unknown reason {self.reason!r}")

    def summary(self) -> str:
        """Local. One line: method, backend, reason, iterations, residual."""
        where = f"{self.method}" + (f" ({self.backend})" if self.backend else "")
        return (f"{where or 'solve'}: {self.reason} after {self.iterations} "
                f"iterations, residual norm {self.residual_norm:.3e} "
                f"(rtol={self.rtol:g}, atol={self.atol:g})")


class ConvergenceError(RuntimeError):
    """Raised (on every rank) when a solve did not converge.

    The :class:`SolveInfo` of the failed solve is available as ``.info``.
    """

    def __init__(self, info: SolveInfo, message: str | None = None):
        self.info = info
        if message is None:
            message = (f"{info.method or 'solve'} did not converge: "
                       f"{info.reason} after {info.iterations} iterations, "
                       f"residual norm {info.residual_norm:.3e}"
                       f" (rtol={info.rtol:g}, atol={info.atol:g}"
                       + (f", backend={info.backend}" if info.backend else "")
                       + ")")
        super().__init__(message)

    def __reduce__(self):  # picklable (mpi4py may pickle exceptions)
        return (type(self), (self.info, str(self)))
