"""Nonlinear solve result record (:class:`NonlinearInfo`) and :class:`NonlinearConvergenceError`.

Reason strings are the names of PETSc's ``SNESConvergedReason`` values, so a result
reads the same whether it came from the PETSc (SNES) or the torch backend.
Everything here is local (no communication).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..krylov.info import ConvergenceError

#: converged reasons (PETSc names)
CONVERGED_REASONS = ("CONVERGED_FNORM_ABS", "CONVERGED_FNORM_RELATIVE", "CONVERGED_SNORM_RELATIVE")
#: diverged reasons (PETSc names)
DIVERGED_REASONS = (
    "DIVERGED_FUNCTION_DOMAIN",
    "DIVERGED_FUNCTION_COUNT",
    "DIVERGED_LINEAR_SOLVE",
    "DIVERGED_FNORM_NAN",
    "DIVERGED_MAX_IT",
    "DIVERGED_LINE_SEARCH",
    "DIVERGED_INNER",
    "DIVERGED_LOCAL_MIN",
    "DIVERGED_DTOL",
    "DIVERGED_JACOBIAN_DOMAIN",
    "DIVERGED_TR_DELTA",
)
#: every reason a NonlinearInfo may carry
REASONS = CONVERGED_REASONS + DIVERGED_REASONS + ("CONVERGED_ITERATING", "CONVERGED_ITS")


@dataclass
class NonlinearInfo:
    """Outcome of one nonlinear solve (identical on every rank).

    ``iterations`` counts Newton steps; ``residual_history[k]`` is the global 2-norm
    ``||F(u_k)||`` (entry 0: the initial guess), always recorded; ``residual_norm`` is
    ``||F(u)||`` of the returned ``u``. ``linear_iterations`` is the total number of
    Krylov iterations, ``linear_iterations_per_step`` one entry per Newton step.
    ``function_evaluations`` / ``jacobian_evaluations`` count calls of ``residual`` /
    ``jacobian`` made by the solve (line search and matrix-free products included).
    ``method`` names what ran (``"newtonls"``, or the SNES type the options chose),
    ``linear_method`` / ``pc`` the inner solver. Times are wall-clock seconds.
    """

    converged: bool
    reason: str
    iterations: int
    residual_norm: float
    residual_history: list = field(default_factory=list)
    linear_iterations: int = 0
    linear_iterations_per_step: list = field(default_factory=list)
    function_evaluations: int = 0
    jacobian_evaluations: int = 0
    method: str = "newtonls"
    backend: str = ""
    line_search: str = ""
    linear_method: str = ""
    pc: str = ""
    rtol: float = 0.0
    atol: float = 0.0
    stol: float = 0.0
    setup_time: float = 0.0
    solve_time: float = 0.0

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"NonlinearInfo: unknown reason {self.reason!r}")

    def summary(self) -> str:
        """Local. One line: method, backend, reason, iterations, residual."""
        first = self.residual_history[0] if self.residual_history else float("nan")
        return (f"{self.method} ({self.backend}, line search {self.line_search}): {self.reason} after "
                f"{self.iterations} Newton iterations ({self.linear_iterations} linear), residual norm "
                f"{self.residual_norm:.3e} (initial {first:.3e}, rtol={self.rtol:g}, atol={self.atol:g})")


class NonlinearConvergenceError(ConvergenceError):
    """Raised on every rank when a nonlinear solve did not converge; ``.info`` is the
    :class:`NonlinearInfo` (reason: a PETSc ``SNESConvergedReason`` name)."""

    def __init__(self, info: NonlinearInfo, message: str | None = None):
        if message is None:
            message = "nonlinear_solve did not converge: " + info.summary()
        super().__init__(info, message)

    def __reduce__(self):
        return (type(self), (self.info, str(self)))
