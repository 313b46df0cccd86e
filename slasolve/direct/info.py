"""Record of a factorisation (:class:`FactorizationInfo`) and :class:`FactorizationError`.

Everything here is local (no communication).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from ..krylov.info import ConvergenceError, SolveInfo

__all__ = ["FactorizationInfo", "FactorizationError", "MUMPS_ERRORS"]

#: MUMPS INFOG(1) error codes (MUMPS users' guide, section "Error diagnostics")
MUMPS_ERRORS = {
    -5: "not enough memory during analysis",
    -6: "matrix is structurally singular (INFOG(2) = structural rank)",
    -7: "not enough memory during analysis",
    -8: "main integer workspace too small for factorization (raise ICNTL(14), "
        "petsc_options={'mat_mumps_icntl_14': 100})",
    -9: "main real workspace too small (raise ICNTL(14), petsc_options={'mat_mumps_icntl_14': 100})",
    -10: "matrix is numerically singular",
    -11: "internal real workspace too small for the solve",
    -12: "internal real workspace too small for iterative refinement",
    -13: "memory allocation failed (problem of size too large for the available memory)",
    -14: "integer workspace too small for the solve",
    -15: "integer workspace too small for iterative refinement",
    -16: "N is out of range",
    -17: "internal send buffer too small (raise ICNTL(14))",
    -19: "the working memory allowed by ICNTL(23) is too small (INFOG(2): needed)",
    -20: "internal reception buffer too small (raise ICNTL(14))",
    -40: "the matrix was indicated positive definite but a negative or null pivot was met",
}


@dataclass
class FactorizationInfo:
    """What a direct solve ran, identical on every rank.

    ``backend``: ``"petsc"`` (MUMPS through PETSc) or ``"scipy"`` (SuperLU, one rank);
    ``solver``: ``"mumps"`` / ``"superlu"``; ``factorization``: ``"lu"`` or ``"cholesky"``
    (MUMPS LDL^T for symmetric, possibly indefinite, matrices); ``symmetric``: the result
    of the exact symmetry test (``None`` when not tested). ``n``: global scalar rows;
    ``nnz``: stored scalar nonzeros of ``A`` (global); ``factor_nnz``: entries in the
    factors (MUMPS INFOG(29), SuperLU ``L.nnz + U.nnz``); ``fill = factor_nnz / nnz``;
    ``memory_mb``: memory MUMPS used for the factorisation, summed over ranks (INFOG(22),
    MB), ``None`` for SuperLU. Counters: ``symbolic_factorizations`` (analyses),
    ``numeric_factorizations``, ``solves`` and ``transpose_solves`` (backend solve calls;
    a ``(n, k)`` right-hand side is one call). Times are cumulative wall-clock seconds.
    ``backward_error``: the largest normwise backward error
    ``||b - A x||_inf / (||A||_inf ||x||_inf + ||b||_inf)`` of the last solve's columns.
    """

    backend: str = ""
    solver: str = ""
    factorization: str = ""
    symmetric: Optional[bool] = None
    n: int = 0
    nnz: int = 0
    factor_nnz: Optional[int] = None
    fill: Optional[float] = None
    memory_mb: Optional[float] = None
    symbolic_factorizations: int = 0
    numeric_factorizations: int = 0
    solves: int = 0
    transpose_solves: int = 0
    analysis_time: float = 0.0
    factor_time: float = 0.0
    solve_time: float = 0.0
    backward_error: float = 0.0

    def count_solve(self, transpose: bool, seconds: float) -> None:
        """Local. Count one solve (with the transposed factors when ``transpose``) of ``seconds``."""
        if transpose:
            self.transpose_solves += 1
        else:
            self.solves += 1
        self.solve_time += seconds

    def copy(self) -> "FactorizationInfo":
        """Local. A snapshot (the live record keeps counting)."""
        return dataclasses.replace(self)

    def summary(self) -> str:
        """Local. One line: what ran and how much it cost."""
        fill = f", fill {self.fill:.2f}" if self.fill is not None else ""
        mem = f", {self.memory_mb:.1f} MB" if self.memory_mb is not None else ""
        return (f"{self.factorization} ({self.solver}, {self.backend}): n={self.n}, nnz={self.nnz}, "
                f"factor nnz={self.factor_nnz}{fill}{mem}; {self.symbolic_factorizations} analyses, "
                f"{self.numeric_factorizations} factorisations, {self.solves} solves, "
                f"{self.transpose_solves} transpose solves")


class FactorizationError(ConvergenceError):
    """Raised on every rank when a direct factorisation or solve fails: a (numerically
    or structurally) singular matrix, a MUMPS workspace / memory error, or a solution
    whose backward error shows the factorisation broke down.

    A :class:`ConvergenceError` (so ``except ConvergenceError`` catches failed Krylov
    and direct solves alike): ``.info`` is a :class:`SolveInfo` with
    ``reason="DIVERGED_PC_FAILED"``; ``.code`` is MUMPS' INFOG(1) (``None`` for SuperLU
    and the backward-error check).
    """

    def __init__(self, info, message: Optional[str] = None, code: Optional[int] = None):
        if isinstance(info, str):  # FactorizationError("message") for convenience
            info, message = None, info
        if info is None:
            info = SolveInfo(converged=False, reason="DIVERGED_PC_FAILED", iterations=0,
                             residual_norm=float("nan"), method="direct")
        self.code = code
        super().__init__(info, message)

    def __reduce__(self):
        return (type(self), (self.info, str(self), self.code))


def failed_info(backend: str, factorization: str) -> SolveInfo:
    """Local. The SolveInfo a FactorizationError carries."""
    return SolveInfo(converged=False, reason="DIVERGED_PC_FAILED", iterations=0,
                     residual_norm=float("nan"), method="direct", backend=backend, pc=factorization)
