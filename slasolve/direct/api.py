"""``spsolve`` and ``factorized``: distributed, differentiable sparse direct solves.

See the package docstring (:mod:`slasolve.direct`) for the contract.
"""
from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch

from .. import _log
from .._comm import check_collective, options_key
from ..autograd import AdjointFunction, matvec_value_grad
from ..registry import default_backend, register_solve_method
from ..settings import SettingsSchema
from ..krylov.info import SolveInfo
from .info import FactorizationError, FactorizationInfo, failed_info
from ..dtensor import dtensor_entry

__all__ = ["spsolve", "factorized", "Factorization", "solve_direct", "BACKWARD_ERROR_TOL", "DIRECT_CACHE_SIZE"]

#: a solution whose normwise backward error ``||b - A x||_inf / (||A||_inf ||x||_inf + ||b||_inf)``
#: exceeds this raises :class:`FactorizationError` (a broken-down factorisation, e.g. a
#: nearly singular matrix MUMPS / SuperLU did not flag); sqrt(float64 eps)
BACKWARD_ERROR_TOL = math.sqrt(2.220446049250313e-16)
#: factorisations ``spsolve`` keeps per operator layout (least recently used dropped first)
DIRECT_CACHE_SIZE = 2

_FACTORIZATIONS = (None, "auto", "lu", "cholesky")


def _backend_name(backend) -> Optional[str]:
    return default_backend() if backend is None else backend


#: the settings of one direct solve: the keyed ones select the cached factorisation, all must agree
DIRECT_SETTINGS = SettingsSchema(keyed=("path", "factorization", "petsc_options"),
                                 agreed=("backend", "b columns", "dtype", "return_info",
                                         "A's values require grad", "b requires grad"))


def _validate(A, b, *, backend, factorization, petsc_options, return_info, what="spsolve"):
    """Collective. ``(dA, settings)`` after ONE check_collective of every argument; the
    settings' ``path`` is ``"petsc"`` or ``"scipy"``. ``b=None`` (factorized) skips the
    right-hand side."""
    from mpi4py import MPI
    from ..dsparse import DSparseTensor
    from ..krylov.operator import as_row_shard
    from ..krylov.operator import needs_grad, operator_error, rhs_error
    dA, err = None, None
    try:
        dA = as_row_shard(A)
    except (TypeError, ValueError) as e:
        err = e
    comm = A.comm if isinstance(A, DSparseTensor) else (dA.comm if dA is not None else MPI.COMM_SELF)
    path = None
    if err is None:
        if backend not in ("petsc", "torch", "scipy"):
            err = ValueError(f"backend must be 'petsc', 'torch' or 'scipy', got {backend!r}")
        elif factorization not in _FACTORIZATIONS:
            err = ValueError(f"factorization must be None, 'lu' or 'cholesky', got {factorization!r}")
        elif petsc_options is not None and not isinstance(petsc_options, dict):
            err = TypeError(f"petsc_options must be a dict or None, got {type(petsc_options).__name__}")
        elif backend == "petsc":
            try:
                from . import petsc_backend  # noqa: F401
                path = "petsc"
            except ImportError as e:
                err = ImportError(f"{what}: backend='petsc' needs petsc4py (MUMPS): {e}")
        elif comm.Get_size() > 1:
            err = ValueError(f"{what} on {comm.Get_size()} ranks needs PETSc (MUMPS): the "
                             f"{backend!r} backend (SciPy SuperLU) runs on one rank only; install "
                             "petsc4py or use backend='petsc'")
        else:
            path = "scipy"
    if err is None:
        err = operator_error(dA)
    if err is None and b is not None:
        err = rhs_error(dA, b, None)
        if err is None and not bool(torch.isfinite(b).all()):
            err = ValueError(f"{what}: b has NaN or infinite entries")
    settings = DIRECT_SETTINGS.bind(
        path=path, factorization="auto" if factorization is None else factorization,
        petsc_options=options_key(petsc_options), backend=backend, return_info=bool(return_info),
        dtype=str(b.dtype) if isinstance(b, torch.Tensor) else None,
        **{"b columns": (b.shape[1] if b.dim() == 2 else None) if isinstance(b, torch.Tensor) else None,
           "A's values require grad": needs_grad(dA.values if dA is not None else None),
           "b requires grad": needs_grad(b)})
    check_collective(comm, err, agree=settings.agree())
    return dA, settings


def _new_factor(dA, path, factorization, petsc_options):
    kind = "auto" if factorization in (None, "auto") else factorization
    if path == "petsc":
        from .petsc_backend import PetscFactor
        return PetscFactor(dA, kind, petsc_options)
    from .scipy_backend import SuperLUFactor
    return SuperLUFactor(dA, kind)


def _cached_factor(dA, settings, petsc_options):
    """Collective (settings agree on every rank, so every rank hits / misses together)."""
    s = settings.values
    return dA._layout.cached("factorizations", settings.key(),
                             lambda: _new_factor(dA, s["path"], s["factorization"], petsc_options),
                             DIRECT_CACHE_SIZE)


def _refresh(fac, dA) -> None:
    """Collective. Factors of ``dA``'s current values, and the norms the backward-error
    check needs (recomputed only when it refactored)."""
    from ._common import raise_factor_error_collective
    err = None
    if fac.backend == "scipy":
        try:
            refactored = fac.ensure(dA)
        except (FactorizationError, ValueError) as e:
            err, refactored = e, False
        raise_factor_error_collective(fac.comm, err, "scipy", "lu")
    else:
        refactored = fac.ensure(dA)
    if refactored or getattr(fac, "norms", None) is None:
        with torch.no_grad():
            a = dA.detach().to(torch.float64)
            absA = a.with_values(a.values.abs())
            ones = torch.ones(dA.n_local, dtype=torch.float64)
            rows = absA.matvec(ones)
            cols = absA.rmatvec(ones)
            loc = torch.stack([rows.max() if rows.numel() else rows.new_zeros(()),
                               cols.max() if cols.numel() else cols.new_zeros(())])
            from .._comm import allreduce_max
            glob = allreduce_max(dA.comm, loc)
            fac.norms = (float(glob[0]), float(glob[1]))  # ||A||_inf, ||A||_1


def _checked_solve(fac, dA, b: torch.Tensor, transpose: bool) -> torch.Tensor:
    """Collective. ``x = A^{-1} b`` (``A^{-T} b``) with the current factors (refreshed
    first), checked: non-finite entries or a backward error above
    :data:`BACKWARD_ERROR_TOL` raise FactorizationError on every rank."""
    _refresh(fac, dA)
    b64 = b.detach().to(torch.float64)
    x = fac.solve(b64, transpose).to(b64.device)  # the backends work on CPU float64
    with torch.no_grad():
        a = dA.detach().to(torch.float64)
        Ax = a.rmatvec(x) if transpose else a.matvec(x)
        r = b64 - Ax
        cols = 1 if x.dim() == 1 else x.shape[1]

        def colmax(t):
            t = t.reshape(t.shape[0], cols).abs()  # (not -1: a rank may own no rows)
            return t.max(0).values if t.shape[0] else t.new_zeros(cols)
        bad = torch.tensor([0.0 if bool(torch.isfinite(x).all()) else 1.0], dtype=torch.float64)
        loc = torch.cat([bad, colmax(r), colmax(x), colmax(b64)])
        loc = torch.nan_to_num(loc, nan=math.inf)
        from .._comm import allreduce_max
        glob = allreduce_max(dA.comm, loc)
    anorm = fac.norms[1] if transpose else fac.norms[0]
    rn, xn, bn = glob[1:1 + cols], glob[1 + cols:1 + 2 * cols], glob[1 + 2 * cols:]
    denom = anorm * xn + bn
    berr = torch.where(denom > 0, rn / torch.where(denom > 0, denom, torch.ones_like(denom)),
                       torch.where(rn > 0, torch.full_like(rn, math.inf), torch.zeros_like(rn)))
    worst = float(berr.max())
    fac.info.backward_error = worst
    if float(glob[0]) > 0 or not worst <= BACKWARD_ERROR_TOL:
        # every rank holds the same reduced numbers, so every rank raises together
        what = "non-finite entries" if float(glob[0]) > 0 else f"backward error {worst:.3e}"
        raise FactorizationError(failed_info(fac.backend, fac.kind or ""),
                                 f"direct solve: the {fac.kind} factorisation ({fac.info.solver}) gave a "
                                 f"solution with {what} (> {BACKWARD_ERROR_TOL:.1e}): A is singular or "
                                 "too ill-conditioned for this factorisation")
    return x.to(dA.dtype)


class _DirectSolve(AdjointFunction):
    @staticmethod
    def forward(ctx, values, b, fac, dA, transpose):
        x = _checked_solve(fac, dA, b, transpose)
        ctx.fac, ctx.dA, ctx.transpose = fac, dA, transpose
        # values saved too: changing them in place before backward is torch's error, not
        # a gradient silently taken at other values
        ctx.save_for_backward(x, values)
        return x

    name = "slasolve.spsolve"

    @staticmethod
    def adjoint(ctx, saved, g):
        x, _ = saved
        # ONE solve with the transposed operator and the same factors (refactorised only
        # if A's values were changed in place since the forward)
        lam = _checked_solve(ctx.fac, ctx.dA, g.contiguous(), not ctx.transpose)
        gv = None
        if ctx.needs_input_grad[0]:
            # A x = b: dL/dA_ij = -lam_i x_j;  A^T x = b: dL/dA_ij = -x_i lam_j
            gv = matvec_value_grad(ctx.dA, -lam, x) if not ctx.transpose else matvec_value_grad(ctx.dA, -x, lam)
        gb = lam if ctx.needs_input_grad[1] else None
        return gv, gb, None, None, None


@_log.logged("slaSolve", "slaDirect")
@dtensor_entry("spsolve")
def spsolve(A, b: torch.Tensor, *, backend: Optional[str] = None, factorization: Optional[str] = None,
            return_info: bool = False, petsc_options: Optional[dict] = None
            ) -> Union[torch.Tensor, Tuple[torch.Tensor, FactorizationInfo]]:
    """Collective. Solve ``A x = b`` with a sparse direct (LU / Cholesky) factorisation;
    differentiable in ``b`` and ``A``'s values (adjoint).

    Parameters
    ----------
    A : DSparseTensor (row shard), SparseTensor, scipy.sparse matrix or torch sparse tensor
        The last three are single-rank operators. Block (BSR) tensors work.
    b : torch.Tensor
        This rank's owned rows, ``(n_local,)`` or ``(n_local, k)`` (one backend call for
        all ``k`` columns); dtype of ``A``.
    backend : {"petsc", "torch", "scipy"}, optional
        ``"petsc"`` (default when petsc4py imports): MUMPS through PETSc, any number of
        ranks. ``"torch"``/``"scipy"``: SciPy SuperLU, one rank only (more ranks raise
        ValueError on every rank).
    factorization : {None, "lu", "cholesky"}
        ``None``: Cholesky (MUMPS LDL^T, so symmetric indefinite matrices are fine) when
        ``A`` is exactly symmetric (``MatIsSymmetric(A, 0)``, retested whenever the
        values change), LU otherwise. ``"cholesky"`` on a nonsymmetric matrix raises
        ValueError. SuperLU always runs LU.
    return_info : bool
        Also return a snapshot of the :class:`FactorizationInfo`.
    petsc_options : dict, optional
        PETSc options for the factorisation under the prefix ``direct_`` (e.g.
        ``{"mat_mumps_icntl_14": 100}``), present only while the factorisation is set up.

    Returns
    -------
    x : torch.Tensor (and FactorizationInfo with ``return_info``).

    Raises
    ------
    FactorizationError (a ConvergenceError), on every rank
        Singular or structurally singular ``A`` (MUMPS INFOG(1) -10 / -6, SuperLU
        "exactly singular"), MUMPS workspace / memory errors (-8, -9, -13, ...), or a
        solution with non-finite entries or backward error above ``BACKWARD_ERROR_TOL``.
    ValueError / TypeError, on every rank
        Bad arguments, NaN/inf in ``A`` or ``b``, settings differing between ranks.

    Notes
    -----
    The factorisation is cached on ``A``'s layout (``DIRECT_CACHE_SIZE`` per layout): a
    later call with new values of the same pattern refactorises numerically and
    reuses MUMPS' analysis. The answer always follows the values ``A`` holds at call
    time. The backward is one transposed solve with the same factors.

    Examples
    --------
    >>> import scipy.sparse as sp, torch, slasolve
    >>> A = sp.csr_matrix([[4.0, 1.0], [1.0, 3.0]])
    >>> slasolve.spsolve(A, torch.tensor([1.0, 2.0], dtype=torch.float64))
    tensor([0.0909, 0.6364], dtype=torch.float64)
    >>> S = slasolve.SparseTensor.from_scipy(A)
    >>> v = S.values.clone().requires_grad_()
    >>> x = slasolve.spsolve(S.with_values(v), torch.tensor([1.0, 2.0], dtype=torch.float64))
    >>> x.sum().backward()          # adjoint: one transposed solve, same factors
    >>> v.grad.shape
    torch.Size([4])
    """
    backend = _backend_name(backend)
    dA, settings = _validate(A, b, backend=backend, factorization=factorization, petsc_options=petsc_options,
                             return_info=return_info)
    fac = _cached_factor(dA, settings, petsc_options)
    x = _DirectSolve.apply(dA.values, b, fac, dA, False)
    return (x, fac.info.copy()) if return_info else x


class Factorization:
    """Collective (calls). The factors of one sparse matrix, from :func:`factorized`.

    ``F(b)`` / ``F.solve(b)`` solve ``A x = b``, ``F.solve(b, transpose=True)`` solves
    ``A^T x = b`` with the same factors; ``b`` is ``(n_local,)`` or ``(n_local, k)``
    (one backend call for all columns). Differentiable in ``b`` and ``A``'s values.
    Live values: when ``A``'s values change in place, the next call refactorises
    (numerically only with MUMPS) before solving. ``F.info`` is the live
    :class:`FactorizationInfo` (counters, fill, memory, times).
    """

    def __init__(self, dA, fac, path: str):
        self._dA, self._fac, self._path = dA, fac, path

    @property
    def info(self) -> FactorizationInfo:
        """Local. The live record (see :class:`FactorizationInfo`)."""
        return self._fac.info

    @property
    def shape(self) -> Tuple[int, int]:
        """Local. Global scalar shape of ``A``."""
        return (self._fac.info.n, self._fac.info.n)

    @_log.logged("slaSolve", "slaDirect")
    def solve(self, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """Collective. ``A^{-1} b`` (``A^{-T} b`` with ``transpose=True``)."""
        dA = self._dA
        err = None
        from ..krylov.operator import needs_grad, rhs_error
        err = rhs_error(dA, b, None)
        if err is None and not bool(torch.isfinite(b).all()):
            err = ValueError("Factorization.solve: b has NaN or infinite entries")
        if err is None and not isinstance(transpose, bool):
            err = TypeError(f"transpose must be a bool, got {type(transpose).__name__}")
        check_collective(dA.comm, err, agree={
            "transpose": bool(transpose) if isinstance(transpose, bool) else repr(transpose),
            "b columns": (b.shape[1] if b.dim() == 2 else None) if isinstance(b, torch.Tensor) else None,
            "dtype": str(b.dtype) if isinstance(b, torch.Tensor) else None,
            "A's values require grad": needs_grad(dA.values), "b requires grad": needs_grad(b)})
        return _DirectSolve.apply(dA.values, b, self._fac, dA, bool(transpose))

    __call__ = solve

    def solve_unchecked(self, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """Collective. The backend's solve with the factors as they are, and nothing else.

        No argument checks, no refactorisation when ``A``'s values changed since the last
        factorisation, no backward-error check, no autograd. For callers that own ``A``'s
        values and check the solutions themselves (the time steppers of
        :mod:`slasolve.timestepping` batch the backward-error checks of a sweep into one
        reduction, with :attr:`operator_norms` and :data:`BACKWARD_ERROR_TOL`). ``b``: this
        rank's owned rows, ``(n_local,)`` or ``(n_local, k)``, identical dtype on every rank.
        """
        x = self._fac.solve(b.detach().to(torch.float64), bool(transpose))
        return x.to(device=b.device, dtype=self._dA.dtype)

    @property
    def operator_norms(self) -> Tuple[float, float]:
        """Local. ``(||A||_inf, ||A||_1)`` of the factorised values (the scale of the
        backward-error check; the same on every rank)."""
        return self._fac.norms

    def __repr__(self) -> str:
        return f"Factorization({self._fac.info.summary()})"


@_log.logged("slaSolve", "slaDirect")
def factorized(A, *, backend: Optional[str] = None, factorization: Optional[str] = None,
               petsc_options: Optional[dict] = None) -> Factorization:
    """Collective. Factorise ``A`` now and return a :class:`Factorization` (``F(b)``).

    Arguments as in :func:`spsolve`. The factorisation is private to the returned object
    (not shared with ``spsolve``'s cache). Singular ``A`` raises FactorizationError on
    every rank here. A SciPy / torch sparse ``A`` is copied at this call; the live-value
    rule covers slasolve tensors (``SparseTensor`` / ``DSparseTensor`` values changed in
    place are seen by the next ``F(b)``).

    Examples
    --------
    >>> import scipy.sparse as sp, torch, slasolve
    >>> F = slasolve.factorized(sp.csr_matrix([[4.0, 1.0], [2.0, 3.0]]))
    >>> F(torch.tensor([1.0, 2.0], dtype=torch.float64))
    tensor([0.1000, 0.6000], dtype=torch.float64)
    >>> I = torch.eye(2, dtype=torch.float64)
    >>> F.solve(I, transpose=True)  # A^{-T}: both columns in one backend call
    tensor([[ 0.3000, -0.2000],
            [-0.1000,  0.4000]], dtype=torch.float64)
    >>> F.info.numeric_factorizations, F.info.solves, F.info.transpose_solves
    (1, 1, 1)
    """
    backend = _backend_name(backend)
    dA, settings = _validate(A, None, backend=backend, factorization=factorization,
                             petsc_options=petsc_options, return_info=False, what="factorized")
    path = settings.values["path"]
    fac = _new_factor(dA, path, factorization, petsc_options)
    _refresh(fac, dA)
    return Factorization(dA, fac, path)


def solve_direct(A, b, *, backend=None, pc=None, return_info=False, petsc_options=None, **ignored):
    """Collective. ``slasolve.solve(A, b, method="direct")``: :func:`spsolve` with
    ``pc`` as the factorisation (``None``, ``"lu"``, ``"cholesky"``) and a SolveInfo."""
    x, finfo = spsolve(A, b, backend=backend, factorization=pc, return_info=True,
                       petsc_options=petsc_options)
    rnorm = float("nan")
    if return_info:
        from ..krylov.operator import as_row_shard
        with torch.no_grad():
            dA = as_row_shard(A).detach().to(torch.float64)
            r = b.detach().to(torch.float64) - dA.matvec(x.detach().to(torch.float64))
            from .._comm import allreduce_sum
            rnorm = math.sqrt(float(allreduce_sum(dA.comm, (r * r).sum().reshape(1))[0]))
    info = SolveInfo(converged=True, reason="CONVERGED_ITS", iterations=1,
                     residual_norm=rnorm, solve_time=finfo.solve_time,
                     setup_time=finfo.analysis_time + finfo.factor_time, method="direct",
                     backend=finfo.backend, pc=finfo.factorization)
    info.factorization = finfo
    info.backward_error = finfo.backward_error
    return (x, info) if return_info else x


register_solve_method("direct", solve_direct)
