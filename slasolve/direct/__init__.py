"""Sparse direct solves: ``spsolve`` and ``factorized`` (SciPy's names), distributed
and differentiable.

``x = spsolve(A, b)`` factorises ``A`` (cached on its layout) and solves;
``F = factorized(A)`` keeps the factors: ``F(b)``, ``F.solve(b, transpose=True)``,
``F.info``. ``b`` is this rank's owned rows, ``(n_local,)`` or ``(n_local, k)``; the
``k`` columns go to the backend in one call. ``solve(A, b, method="direct")`` is
``spsolve`` returning a :class:`~slasolve.SolveInfo` (``pc`` names the factorisation).

Backends
--------
``"petsc"`` (default when petsc4py imports): MUMPS through PETSc on any number of
ranks. Cholesky (MUMPS LDL^T, symmetric indefinite included) when ``A`` is exactly
symmetric (``MatIsSymmetric(A, 0)``, retested when the values change), LU otherwise;
``factorization="lu"|"cholesky"`` overrides (Cholesky on a nonsymmetric ``A`` raises
ValueError). Block tensors go to MUMPS as AIJ with the block size set.
``"torch"`` / ``"scipy"`` (and the default without petsc4py): SciPy SuperLU
(``splu``), one rank only; at more than one rank every rank raises ValueError.

Live values
-----------
The answer follows the values ``A`` holds at call time: the values are compared
with a snapshot of the last factorised ones (``torch.equal``, all ranks agree by one
Allreduce) and, when they differ, refactorised. With MUMPS the refactorisation is
numeric only: PETSc reuses the symbolic analysis (``SAME_NONZERO_PATTERN``; the log
events ``MatLUFactorSym``/``MatCholFctrSym`` stay put while ``MatLUFactorNum`` /
``MatCholFctrNum`` count). SuperLU refactorises fully.

Gradients
---------
Adjoint: the backward does ONE transposed solve with the same factors (no
refactorisation; MatSolveTranspose, or MUMPS ICNTL(9)=0 for several columns;
SuperLU ``trans="T"``), then ``dL/db = lam`` and ``dL/dvalues = -lam[row] x[col]``
on the stored nonzeros. ``create_graph=True`` raises RuntimeError.

Errors
------
:class:`FactorizationError` (a :class:`~slasolve.ConvergenceError`; ``.code`` =
MUMPS INFOG(1)) on every rank for singular / structurally singular matrices
(INFOG(1) -10 / -6, SuperLU "exactly singular"), MUMPS workspace and memory errors
(-8, -9, -13, ...) and for a solution with non-finite entries or a normwise backward
error above :data:`BACKWARD_ERROR_TOL` (a nearly singular matrix the factorisation
did not flag). NaN/inf in ``A`` or ``b`` and bad arguments raise ValueError /
TypeError on every rank.
"""
from .api import BACKWARD_ERROR_TOL, DIRECT_CACHE_SIZE, Factorization, factorized, spsolve
from .info import FactorizationError, FactorizationInfo

__all__ = ["spsolve", "factorized", "Factorization", "FactorizationInfo", "FactorizationError",
           "BACKWARD_ERROR_TOL", "DIRECT_CACHE_SIZE"]
