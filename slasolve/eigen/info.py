"""Result record and error type of the eigensolvers (local, no communication)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

__all__ = ["EigenInfo", "EigenConvergenceError"]


@dataclass
class EigenInfo:
    """What an eigensolve did.

    Attributes
    ----------
    converged:
        Number of the ``k`` requested eigenpairs whose relative residual (below)
        is ``<= tol``.
    k:
        Number of eigenpairs requested (and returned).
    iterations:
        Outer iterations: LOBPCG iterations, or Lanczos restarts (one restart =
        one fill of the ``ncv``-vector basis).
    residual_norms:
        One value per returned pair, in the order of the returned eigenvalues
        (ascending), computed from explicitly applied operators on the returned
        vectors::

            res_j = ||A v_j - w_j B v_j||_2 / (max(|w_j|, floor) * ||B v_j||_2)

        with ``B = I`` for standard problems and
        ``floor = 100 * eps * anorm / tol`` (``anorm`` = largest ``|Ritz value|``
        seen, an estimate of ``||B^{-1} A||``). The ratio is invariant under
        scaling of ``A``, of ``B`` and of ``v_j``; the floor keeps (near-)zero
        eigenvalues from demanding a residual below rounding level, i.e. a pair
        is converged when ``||r|| <= max(tol*|w|, 100*eps*anorm) * ||B v||``.
    method, backend:
        What actually ran, e.g. ``"lobpcg"`` / ``"torch"``; for SLEPc the EPS type
        after ``setFromOptions`` plus the ST type unless it is the plain (zero)
        shift: ``"krylovschur"``, ``"krylovschur+sinvert"``, ``"lanczos"``.
    setup_time, solve_time:
        Seconds (wall clock, this rank).
    matvecs:
        Number of columns the operator ``A`` was applied to.
    verified:
        :func:`slasolve.eigsh`: True when its multiplicity verification (Notes
        there) confirmed that the ``k`` eigenvalues are the wanted ones counted
        with multiplicity, False when it failed or did not run (unconverged);
        None for the bare kernels of :mod:`slasolve.eigen.torch_methods`.
    refine_rounds:
        :func:`slasolve.eigsh`: Rayleigh-Ritz refinement steps kept after the solve
        because the explicit residuals exceeded ``tol`` (0: none needed).
    verify_rounds, verify_time:
        Number of deflated verification solves, and their seconds (included in
        ``solve_time``).
    verify_method:
        :func:`slasolve.eigsh`: how the multiplicity was verified: ``"inertia"``
        (Sylvester inertia counts of LDL^T factorisations of ``A - tau I``: SLEPc
        backend, ``sigma`` given, standard float64 problem, no gradient needed),
        ``"deflation"`` (deflated re-solves), ``"block"`` / ``"dense"`` (a block or
        dense method cannot lose copies), ``""`` when not verified.
    times:
        :func:`slasolve.eigsh`: this rank's wall-clock seconds per phase, each exclusive
        of the others: ``"check"`` (argument and symmetry checks, start vector),
        ``"setup"`` (EPS / preconditioner / shift-invert set-up, PETSc Mat creation),
        ``"refill"`` (values into the cached PETSc Mats), ``"solve"`` (the first
        eigensolve), ``"refine"`` (the refinement steps and the residual check that
        decides them), ``"verify"`` (the multiplicity verification), ``"post"``
        (M-orthonormalisation, signs, explicit residuals), ``"halo"`` (halo
        exchanges outside those phases) and ``"total"`` (the whole call; the phases
        add up to at most it). A backward pass through the eigenpairs adds
        ``"backward"`` (its seconds; not part of ``"total"``). Empty for the bare kernels.
    """

    converged: int
    k: int
    iterations: int
    residual_norms: list = field(default_factory=list)
    method: str = ""
    backend: str = ""
    setup_time: float = 0.0
    solve_time: float = 0.0
    matvecs: int = 0
    verified: Optional[bool] = None
    refine_rounds: int = 0
    verify_rounds: int = 0
    verify_time: float = 0.0
    verify_method: str = ""
    times: dict = field(default_factory=dict)

    @property
    def success(self) -> bool:
        """True when all ``k`` requested pairs converged and (eigsh) were verified."""
        return self.converged >= self.k and self.verified is not False


class EigenConvergenceError(RuntimeError):
    """Raised (by the caller, on every rank) when an eigensolve did not converge.

    The :class:`EigenInfo` of the failed solve is available as ``.info``.
    """

    def __init__(self, message: str, info: EigenInfo | None = None):
        super().__init__(message)
        self.info = info
