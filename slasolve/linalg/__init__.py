"""``slasolve.linalg``: a drop-in for :mod:`scipy.sparse.linalg`'s solvers.

``from slasolve.linalg import cg, gmres, minres, bicgstab, cgs, tfqmr, spsolve, eigsh,
LinearOperator, aslinearoperator`` in place of the same names from
``scipy.sparse.linalg``: SciPy 1.10's signatures (``inspect.signature`` matches,
positional order included) and return types (``(x, info)`` with ``info`` an int,
NumPy arrays of SciPy's result dtype), computed by slasolve (PETSc KSP / SLEPc or the
native torch kernels). See the module docstrings of :mod:`._iterative`,
:mod:`._direct`, :mod:`._eigen` and README "Porting from SciPy".

Keywords added after SciPy's (keyword-only): ``rtol`` (SciPy >= 1.12's name for
``tol``; with ``rtol`` the default ``atol`` is 0 as in SciPy >= 1.12, with ``tol``
SciPy 1.10's ``'legacy'`` default and DeprecationWarning), ``comm``, ``local``,
``backend``.

Where the data lives (``comm``):

* ``comm=None`` (default) and ``A`` not a DSparseTensor: exactly SciPy, on this
  process (under ``mpirun`` every rank solves its own problem).
* ``comm`` with more than one rank, ``A`` a scipy.sparse matrix / NumPy array /
  ``LinearOperator`` / callable *replicated*: every rank passes the same full ``A``,
  ``b``, ``x0`` (checked by a digest for matrices and vectors) and gets the same
  full ``x`` back. A matrix is distributed (each rank keeps its contiguous block of
  rows) and solved in parallel; a ``LinearOperator`` is applied on every rank to the
  gathered vector. Convenient for porting, not scalable (every rank holds all of
  ``A``).
* ``A`` a row-sharded :class:`~slasolve.DSparseTensor` (any communicator), or
  ``local=True`` with a ``LinearOperator`` / callable mapping this rank's rows of
  ``x`` to this rank's rows of ``A x``: ``b``, ``x0``, ``x``, ``M``'s vectors and
  the callback's ``xk`` are this rank's rows. The scalable mode.

Complex input raises ``TypeError`` (slasolve is real). ``info``: 0 converged,
``maxiter`` (SciPy's count) when the limit was reached, ``-10`` on a breakdown
(indefinite matrix or preconditioner in CG, BiCGStab breakdown, GMRES singular
least-squares, NaN/Inf). Illegal input raises (``ValueError``/``TypeError``, on every
rank), as SciPy does for shapes.
"""
from scipy.sparse.linalg import LinearOperator, aslinearoperator

from ._direct import spsolve
from ._eigen import eigsh
from ._iterative import bicgstab, cg, cgs, gmres, minres, tfqmr

__all__ = ["cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "spsolve", "eigsh", "LinearOperator", "aslinearoperator"]
