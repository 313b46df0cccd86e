"""``eigsh``: differentiable symmetric (generalized) sparse eigensolver.

See :func:`eigsh`. Backends: :mod:`slasolve.eigen.slepc_backend` (SLEPc's EPS)
and the native kernels of :mod:`slasolve.eigen.torch_methods`; gradients:
:mod:`slasolve.eigen.autograd`.
"""
from __future__ import annotations

import math
import numbers
import time
from typing import Callable, Optional, Union

import torch

from .. import _log
from .._comm import allreduce_max, allreduce_sum, check_collective, options_key
from .autograd import DEGENERATE_RTOL, EigshFunction, _State
from .info import EigenConvergenceError, EigenInfo
from ..dtensor import dtensor_entry
from .solvers import SlepcSolver, TorchSolver
from .subspace import m_orthonormalize, refine, residuals
from .torch_methods import fix_signs, start_vectors
from .verify import inertia_verified, verify

try:  # at import (collective, with slasolve's PETSc start-up), never lazily inside eigsh
    from . import slepc_backend
    _SLEPC_IMPORT_ERROR = None
except ImportError as _e:  # pragma: no cover - machines without slepc4py
    slepc_backend = None
    _SLEPC_IMPORT_ERROR = str(_e)

__all__ = ["eigsh", "default_backend"]

_WHICH = ("LA", "SA", "LM", "SM")
_BACKENDS = ("slepc", "torch")


def default_backend() -> str:
    """Local. ``"slepc"`` when slepc4py imports, else ``"torch"``."""
    return "slepc" if slepc_backend is not None else "torch"


def _as_row_shard(A, name):
    from ..krylov.operator import as_row_shard
    try:
        return as_row_shard(A)
    except (TypeError, ValueError) as e:
        raise type(e)(f"{name}: {e}") from None


def _row_ids(dA):
    """User-numbering global ids of the owned rows when a partitioner renumbered
    them (so results do not depend on the rank count), else None."""
    perm = dA._row_perm()
    if perm is None:
        return None
    a, b = dA.row_range
    return perm[a:b]


@dtensor_entry("eigsh")
def eigsh(A, k: int = 6, M=None, which: str = "LM", sigma: Optional[float] = None,
          v0: Optional[torch.Tensor] = None, tol: float = 1e-8, maxiter: Optional[int] = None, *,
          backend: Optional[str] = None, method: Optional[str] = None, ncv: Optional[int] = None,
          pc: Union[str, Callable, None] = "jacobi", return_info: bool = False,
          raise_on_fail: bool = True, check_input: bool = True,
          petsc_options: Optional[dict] = None, options_prefix: Optional[str] = None,
          st_solver: Optional[str] = None, grad_rtol: float = 1e-10,
          grad_maxiter: Optional[int] = None, degenerate_rtol: float = DEGENERATE_RTOL,
          progress: Union[bool, int] = False):
    """Collective. ``k`` eigenpairs of the symmetric ``A v = w v`` or ``A v = w M v``.

    In the spirit of :func:`scipy.sparse.linalg.eigsh`, distributed and
    differentiable.

    Parameters
    ----------
    A : DSparseTensor (row shard), SparseTensor, scipy.sparse or torch sparse
        Symmetric matrix. Local inputs (the last three) are one-rank problems
        (``MPI.COMM_SELF``) even under ``mpirun``.
    k : int
        Number of eigenpairs, ``1 <= k < n``.
    M : same kinds as ``A``, optional
        SPD mass matrix of the generalized problem, same layout (global shape and
        row ownership) as ``A`` -- e.g. an FEM mass matrix.
    which : {"LM", "LA", "SA", "SM"}
        Without ``sigma``: largest magnitude, largest / smallest algebraic,
        smallest magnitude. With ``sigma`` only ``"LM"`` (the default) is
        accepted: the eigenvalues nearest ``sigma`` (shift-and-invert, SciPy's
        ``mode="normal"``).
    sigma : float, optional
        Shift for shift-and-invert.
    v0 : tensor ``(n_local,)``, optional
        Starting vector (owned rows). Default: a deterministic pseudo-random
        vector that depends only on the global row index, so the iteration is
        the same for every rank count.
    tol, maxiter :
        Relative tolerance and iteration limit of the backend's own convergence
        test (SLEPc: ``EPSSetTolerances`` with ``EPS_CONV_REL``, default
        ``maxiter`` ARPACK's ``10 n`` restarts, so a problem SciPy's ``eigsh`` solves
        with its defaults is not cut short; torch: the kernels' relative residual test, on the
        shift-inverted operator when ``sigma`` is used; default ``maxiter`` 5000
        LOBPCG iterations / 1000 Lanczos restarts). The backend's test is on
        its own estimate for the transformed operator; when the explicit
        residuals of the returned pairs (``info.residual_norms``) of a
        generalized problem without ``sigma`` exceed ``tol`` (typical of an
        ill-conditioned ``M``), up to three Rayleigh-Ritz refinement steps on
        ``[V, M^{-1} R]`` follow (``R`` the residuals), each kept only if it
        lowers every residual.
    backend : {"slepc", "torch"}, optional
        Default ``"slepc"`` when slepc4py imports.
    method : {"lobpcg", "lanczos"}, optional (torch backend)
        Default: LOBPCG (preconditioned by ``pc``) for ``"SA"``, thick-restart
        Lanczos otherwise and for shift-invert (``"SM"`` without ``sigma`` means
        shift-invert at ``sigma = 0`` in the torch backend).
    ncv : int, optional
        Basis size (SLEPc ``ncv``, Lanczos ``ncv``).
    pc : "jacobi" | "none" | "icc" | "ilu" | callable (torch backend)
        LOBPCG preconditioner on the rank's diagonal block (block Jacobi across
        ranks); ``"jacobi"`` divides by ``|diag(A)|``. For shift-invert the same
        choice preconditions the inner MINRES (``"jacobi"`` = ``|diag(A - sigma M)|``).
    return_info : bool
        Also return an :class:`EigenInfo`.
    raise_on_fail : bool
        Raise :class:`EigenConvergenceError` on every rank when fewer than
        ``k`` pairs converged or the multiplicity verification (Notes) could not
        confirm them (default). With ``False`` the pairs are returned anyway,
        ``info.converged`` says how many converged and ``info.verified`` whether
        they were confirmed; the SLEPc backend then returns only the
        ``info.converged`` converged pairs.
    check_input : bool
        Cheap collective checks: ``A`` (and ``M``) symmetric (``||A x - A^T x||``
        for a pseudo-random ``x``, relative ``1e2 sqrt(eps)``), ``diag(M) > 0``
        and ``x^T M x > 0``. One reduction.
    petsc_options, options_prefix, st_solver : SLEPc backend
        ``{"eps_type": "lobpcg", ...}`` put into the options database (under
        ``options_prefix``) while the EPS is configured, for this call only (the
        previous database entries are restored, also when the call fails); the
        command line works as usual. Whatever EPS type runs, the verification
        (Notes) runs with it; an EPS type without deflation-space support
        raises. A value SLEPc rejects (unknown type, missing required option)
        raises ``ValueError`` on every rank; an option *name* PETSc does not know
        is ignored, as by PETSc itself. ``st_solver`` the LU package of
        shift-invert (default MUMPS when available).
    grad_rtol, grad_maxiter, degenerate_rtol : backward
        Tolerance / limit of the projected MINRES solves of eigenvector
        gradients, and the relative eigenvalue gap below which eigenvector
        gradients are refused (see :mod:`slasolve.eigen.autograd`).
    progress : bool or int
        Print on rank 0 every ``progress`` (default 10) outer iterations (LOBPCG
        iterations, Lanczos restarts, SLEPc's EPS iterations through an EPS monitor)
        the number of converged wanted pairs and the largest residual estimate of the
        wanted ones, for the first solve and each verification round.

    Notes
    -----
    The result is the ``k`` wanted eigenvalues *counted with multiplicity*, as
    SciPy's and LAPACK's. Single-vector methods (SLEPc's Krylov-Schur and the
    other iterative EPS types, native Lanczos, shift-invert) build their space
    from one start vector, which has one component per eigenspace: an exactly
    repeated eigenvalue (square grids, symmetric domains) is found once. So
    after the first solve eigsh *verifies*: it solves again in the
    (M-)orthogonal complement of the found eigenvectors (SLEPc
    ``EPSSetDeflationSpace`` on the same EPS, which keeps the Mats and the
    shift-invert factorisation; native kernels: ``deflate=``) from a new start
    vector, for the 2 most wanted eigenvalues left. Any converged one more
    wanted than the current k-th (by more than ``10 tol`` relative) was missed:
    the sets are merged, the ``k`` most wanted kept, and the check repeats
    until a round finds nothing better -- at most ``k + 2`` rounds, else
    :class:`EigenConvergenceError`. The check relies on what the solver itself
    relies on (the start vector meets every eigenspace), at the same ``tol``.
    Cost: one extra solve when nothing was missed, one more per round that
    found missed copies; measured on the 5-point Poisson matrix (k=6): with
    ``sigma`` 1.6-1.9x the triangular solves, the factorisation reused (wall
    1.4-1.6x), without ``sigma`` 1.6-2.2x the matvecs. Cheaper where it
    applies (SLEPc backend, ``sigma`` given, standard float64 problem, no
    gradient needed): Sylvester's law of inertia. One MUMPS LDL^T of
    ``A - (sigma + rho) I`` (and of ``A - (sigma - rho) I`` when ``sigma`` lies
    inside the spectrum), ``rho`` just past the ``k``-th distance plus the
    residuals' bound, counts the eigenvalues within ``rho`` of ``sigma``; a count
    of ``k`` proves none was missed (``info.verify_method == "inertia"``), a
    larger one falls back to the deflated re-solve. For an exactly symmetric
    ``A`` storing its diagonal, the shift-invert factorisation is then MUMPS'
    LDL^T too (of a private copy of ``A - sigma I``), and each count is a numeric
    refactorisation of it with the shifted diagonal, reusing its ordering and
    analysis (on the 2-D Poisson matrix about a fifth of the CPU time of an LU
    set-up, which LDL^T itself undercuts by as much). Not re-verified: the
    native LOBPCG, whose block of ``max(2k, k + 4) >= k`` vectors has a
    projection of full rank ``min(dim, block)`` onto every eigenspace, so it
    cannot lose copies (verified anyway when gradients are needed, which use
    the next eigenvalue to detect an eigenspace cut by ``k``), and SLEPc's
    dense types (``lapack``: the whole spectrum). ``info.verified`` and
    ``info.verify_rounds`` report it. Eigenvectors of a repeated eigenvalue
    are an M-orthonormal basis of its eigenspace; the basis (unlike the
    subspace) depends on the backend and the rank count.

    Returns
    -------
    w : ``(k,)`` eigenvalues, ascending, identical on every rank.
    V : ``(n_local, k)`` owned rows of the M-orthonormal eigenvectors
        (``V^T M V = I``), sign convention: each column's first dominant entry
        (largest magnitude; ties within a relative ``eps**(1/3)`` go to the
        smallest global index, in the user's numbering when a partitioner
        renumbered the rows) is positive -- the same for every rank count and
        backend for simple eigenvalues. For a repeated eigenvalue only the
        eigenspace is determined: its columns are an M-orthonormal basis of it,
        which depends on the backend and the rank count.
    info : :class:`EigenInfo` (when ``return_info``). ``method`` names what ran
        (SLEPc: ``eps.getType()`` after the options, plus the ST, e.g.
        ``"krylovschur+sinvert"``); ``residual_norms`` are always
        explicit residuals of the *original* problem on the returned pairs,
        ``||A v - w M v|| / (max(|w|, 100 eps max|w| / tol) ||M v||)``;
        ``converged`` is the backend's own count (SLEPc's ``nconv``; torch: the
        kernel's test).

    Gradients flow to ``A``'s values (and ``M``'s) when they require grad;
    backward is collective. See :mod:`slasolve.eigen.autograd` for the formulas,
    the symmetrisation convention and degenerate eigenvalues.

    Errors (raised on every rank): ``TypeError`` / ``ValueError`` naming the
    argument; ``ValueError`` when a setting that must be identical on every rank
    (``k``, ``which``, ``sigma``, ``tol``, ``maxiter``, ``backend``, ``method``,
    ``ncv``, ``pc``, whether ``M`` / ``v0`` are given, dtype, ``return_info``,
    ``raise_on_fail``, ``petsc_options``, ``options_prefix``, ...) differs
    (checked in the same single reduction as the arguments); ``ValueError``
    for a nonsymmetric ``A`` or ``M``, for an ``M`` that is not positive
    definite (cheap checks, or detected by the solver) and for
    ``petsc_options`` SLEPc rejects; :class:`EigenConvergenceError` on
    non-convergence or a failed verification, its message naming the method
    that ran (``info.method``). ``info.times`` gives the seconds per phase.

    Examples
    --------
    The smallest eigenvalues of the 1-D Laplacian ``tridiag(-1, 2, -1)``, known in
    closed form:

    >>> import numpy as np, scipy.sparse as sp
    >>> import slasolve
    >>> n = 50
    >>> A = slasolve.DSparseTensor.from_global(sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n),
    ...                                                format="csr"))
    >>> w, V = slasolve.eigsh(A, k=3, which="SA")
    >>> exact = 2 - 2 * np.cos(np.pi * np.arange(1, 4) / (n + 1))
    >>> np.allclose(w.numpy(), exact, rtol=1e-6, atol=1e-9)
    True
    >>> V.shape == (A.n_local, 3)        # this rank's rows of the eigenvectors
    True
    """
    with _log.stage("slaEigsh"), _log.event("slaEigsh"), _log.collect() as times:
        return _eigsh(A, k, M, which, sigma, v0, tol, maxiter, backend, method, ncv, pc, return_info,
                      raise_on_fail, check_input, petsc_options, options_prefix, st_solver, grad_rtol,
                      grad_maxiter, degenerate_rtol, progress, times)


def _eigsh(A, k, M, which, sigma, v0, tol, maxiter, backend, method, ncv, pc, return_info, raise_on_fail,
           check_input, petsc_options, options_prefix, st_solver, grad_rtol, grad_maxiter, degenerate_rtol,
           progress, times):
    """Collective. :func:`eigsh` (phase times into ``times``)."""
    t_start = time.perf_counter()
    dA = _as_row_shard(A, "A")
    comm = dA.comm
    dM = None
    n = int(dA.global_shape[0]) * (dA.block_shape[0] if dA.block_shape else 1)
    err = None
    try:
        if M is not None:
            dM = _as_row_shard(M, "M")
        if backend is None:
            backend = default_backend()
        k, sigma = _validate(dA, dM, comm, n, k, which, sigma, tol, maxiter, backend, method, ncv, v0,
                             petsc_options, options_prefix)
        if not (isinstance(progress, bool) or isinstance(progress, numbers.Integral) and progress > 0):
            raise ValueError(f"progress: must be a bool or a positive int, got {progress!r}")
    except (TypeError, ValueError, ImportError) as e:
        err = e
    with _log.phase("check"):
        check_collective(comm, err, agree=_agreed_settings(
            k=k, which=which, sigma=sigma, tol=tol, maxiter=maxiter, backend=backend, method=method, ncv=ncv,
            pc=pc, M=M is not None, v0=v0 is not None, dtype=str(dA.dtype), return_info=return_info,
            raise_on_fail=raise_on_fail, check_input=check_input, petsc_options=petsc_options,
            options_prefix=options_prefix, st_solver=st_solver, grad_rtol=grad_rtol,
            grad_maxiter=grad_maxiter, degenerate_rtol=degenerate_rtol,
            progress=_progress_every(progress),
            # a graph on some ranks only would leave those ranks alone in the backward
            A_values_require_grad=torch.is_grad_enabled() and dA.values.requires_grad,
            M_values_require_grad=torch.is_grad_enabled() and dM is not None and dM.values.requires_grad))
    printer = _ProgressPrinter(comm, _progress_every(progress), k) if progress else None

    needs_grad = torch.is_grad_enabled() and (
        dA.values.requires_grad or (dM is not None and dM.values.requires_grad))
    dt = dA.dtype
    dev = dA.device
    dA0 = dA.detach()
    dM0 = dM.detach() if dM is not None else None
    row_offset = dA.row_range[0]
    row_ids = _row_ids(dA)

    def rs(t):
        return allreduce_sum(comm, t)

    def rm(t):
        return allreduce_max(comm, t)

    with torch.no_grad():
        with _log.phase("check"):
            if check_input:
                _check_operators(dA0, dM0, rs, row_offset, row_ids)
            if v0 is None:
                v0 = _default_v0(dA, row_offset, row_ids)
            else:
                v0 = v0.detach().reshape(-1).to(dtype=dt, device=dev)
        t_setup = time.perf_counter() - t_start
        # the multiplicity check by Sylvester inertia (Notes) applies
        by_inertia = backend == "slepc" and sigma is not None and dM0 is None and not needs_grad \
            and dt == torch.float64
        with _log.phase("setup", _log.event("slaEigSetup")):
            if backend == "slepc":
                solver = SlepcSolver(dA0, dM0, k, which, sigma, tol, maxiter, ncv, options_prefix,
                                      petsc_options, st_solver, printer, inertia=by_inertia)
            else:
                solver = TorchSolver(dA0, dM0, k, which, sigma, tol, maxiter, method, ncv, pc, rs, rm,
                                      row_offset, row_ids, printer)
        try:
            with _log.phase("solve", _log.event("slaEigSolve")):
                w, V, conv, its, solve_t = solver.solve(k, v0, None)
            with _log.phase("post"):
                w, V = w.to(dtype=dt, device=dev), V.to(dtype=dt, device=dev)
                V = m_orthonormalize(V, dM0, rs)
            refine_rounds = 0
            # generalized problems without shift-invert only: there SLEPc's test on B^{-1} A can
            # pass far above tol (the case found); elsewhere a round costs k solves and rarely helps
            if min(conv, k) >= k and not solver.dense and dM0 is not None and sigma is None:
                with _log.phase("refine"):
                    w, V, refine_rounds = refine(dA0, dM0, w, V, tol, rs, solver.residual_direction)
            method_name = solver.method
            info = EigenInfo(converged=int(min(conv, k)), k=k, iterations=int(its), residual_norms=[],
                             method=method_name, backend=backend, setup_time=t_setup + solver.setup_time,
                             solve_time=solve_t, matvecs=0, times=times, refine_rounds=refine_rounds)
            w_next = None
            info.verified = False
            if info.converged >= k and solver.block_safe and (not needs_grad or solver.dense):
                info.verified = True    # block method with block >= k, or dense: no lost copies (Notes)
                info.verify_method = "dense" if solver.dense else "block"
            elif info.converged >= k:
                t1 = time.perf_counter()
                if printer is not None:
                    printer.label = "eigsh verify"
                with _log.phase("verify", _log.event("slaEigVerify")):
                    verr = None
                    if by_inertia and inertia_verified(dA0, w, V, sigma, rs, rm, count=solver.shifted_inertia):
                        info.verify_method = "inertia"
                    else:
                        info.verify_method = "deflation"
                        w, V, info.verify_rounds, w_next, verr = verify(
                            solver, w, V, k, which, sigma, tol, n, dM0, rs, row_offset, row_ids)
                info.verify_time = time.perf_counter() - t1
                info.solve_time += info.verify_time
                info.verified = verr is None
                if verr is not None and raise_on_fail:
                    raise EigenConvergenceError(f"eigsh ({backend}, {method_name}): {verr}", info)
        finally:
            solver.close()
        with _log.phase("post"):
            order = torch.argsort(w)
            w, V = w[order].contiguous(), V[:, order].contiguous()
            V = fix_signs(V, reduce_max=rm, row_offset=row_offset, row_ids=row_ids)
            res = residuals(dA0, dM0, w, V, tol, rs)
            info.residual_norms = [float(r) for r in res]
    if info.converged < k and raise_on_fail:
        raise EigenConvergenceError(
            f"eigsh ({backend}, {method_name}): only {info.converged} of the k={k} requested eigenpairs "
            f"converged after {info.iterations} iterations (tol={tol:g}); residuals "
            f"{[f'{r:.2e}' for r in info.residual_norms]}. Raise maxiter / ncv, loosen tol, use shift-"
            "invert (sigma) for clustered small eigenvalues, or pass raise_on_fail=False.", info)

    if needs_grad:
        state = _State(dA0, dM0, grad_rtol, grad_maxiter, degenerate_rtol, w_next=w_next)
        state.info = info      # the backward adds info.times["backward"]
        w, V = EigshFunction.apply(dA.values, dM.values if dM is not None else None, w, V, state)
    if return_info:
        return w, V, info
    return w, V


def _progress_every(progress) -> object:
    """Print every this many iterations (0: never); the argument's repr when invalid."""
    if isinstance(progress, bool):
        return 10 if progress else 0
    return int(progress) if isinstance(progress, numbers.Integral) else repr(progress)


class _ProgressPrinter:
    """Local. ``progress=``: called by the kernels / the EPS monitor on every rank with
    ``(iteration, converged, residual estimates of the wanted pairs)``; prints on rank 0."""

    def __init__(self, comm, every: int, k: int):
        self.rank0 = comm.Get_rank() == 0
        self.every, self.k = every, k
        self.label = "eigsh"
        self.last = None

    def __call__(self, it: int, nconv: int, res) -> None:
        if not self.rank0 or it % self.every or (self.label, it) == self.last:
            return
        self.last = (self.label, it)
        want = len(res) or self.k
        worst = max(res) if len(res) else float("nan")
        print(f"  {self.label} iteration {it:5d}  converged {min(nconv, want)}/{want}  "
              f"max residual estimate {worst:.3e}", flush=True)


def _agreed_settings(**kw):
    """Settings that must be identical on every rank, as values with a stable repr."""
    pc = kw["pc"]
    kw["pc"] = "<callable>" if callable(pc) else pc
    kw["petsc_options"] = options_key(kw["petsc_options"])
    for name in ("k", "which", "sigma", "tol", "maxiter", "ncv", "options_prefix", "st_solver",
                 "grad_rtol", "grad_maxiter", "degenerate_rtol", "backend", "method"):
        v = kw[name]
        if not isinstance(v, (int, float, str, type(None))):
            kw[name] = repr(v)
    return kw


def _validate(dA, dM, comm, n, k, which, sigma, tol, maxiter, backend, method, ncv, v0, petsc_options,
              options_prefix):
    """Local checks of the arguments (raise TypeError/ValueError); returns ``(k, sigma)``."""
    if dA.global_shape[0] != dA.global_shape[1]:
        raise ValueError(f"A: must be square, got global shape {dA.global_shape}")
    if not dA.dtype.is_floating_point or dA.dtype.is_complex:
        raise TypeError(f"A: real floating dtype required, got {dA.dtype}")
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise TypeError(f"k: must be an int, got {type(k).__name__}")
    k = int(k)
    if not (1 <= k < n):
        raise ValueError(f"k: need 1 <= k < n = {n} (use a dense solver for all eigenpairs), got k={k}")
    if not isinstance(which, str) or which not in _WHICH:
        raise ValueError(f"which: expected one of {_WHICH}, got {which!r}")
    if sigma is not None:
        if isinstance(sigma, bool) or not isinstance(sigma, numbers.Real) or not math.isfinite(float(sigma)):
            raise ValueError(f"sigma: must be a finite real number or None, got {sigma!r}")
        sigma = float(sigma)
        if which != "LM":
            raise ValueError(f"which: with sigma only 'LM' (eigenvalues nearest sigma) is supported, "
                             f"got {which!r}")
    if isinstance(tol, bool) or not (isinstance(tol, numbers.Real) and tol > 0):
        raise ValueError(f"tol: must be a positive number, got {tol!r}")
    if maxiter is not None and (isinstance(maxiter, bool) or not isinstance(maxiter, numbers.Integral)
                                or maxiter < 1):
        raise ValueError(f"maxiter: must be a positive int or None, got {maxiter!r}")
    if ncv is not None and (isinstance(ncv, bool) or not isinstance(ncv, numbers.Integral) or not k < ncv <= n):
        raise ValueError(f"ncv: must be an int with k < ncv <= n = {n}, or None; got {ncv!r}")
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
    if backend == "slepc" and _SLEPC_IMPORT_ERROR is not None:
        raise ImportError(f"backend='slepc': {_SLEPC_IMPORT_ERROR}")
    if method is not None and method not in ("lobpcg", "lanczos"):
        raise ValueError(f"method: expected 'lobpcg', 'lanczos' or None, got {method!r}")
    if petsc_options is not None and not isinstance(petsc_options, dict):
        raise TypeError(f"petsc_options: must be a dict or None, got {type(petsc_options).__name__}")
    if options_prefix is not None and not isinstance(options_prefix, str):
        raise TypeError(f"options_prefix: must be a str or None, got {type(options_prefix).__name__}")
    if dM is not None:
        if dM.comm is not comm and comm.Compare(dM.comm) not in (0, 1):  # IDENT, CONGRUENT
            raise ValueError("M: must live on A's communicator")
        if tuple(dM.global_shape) != tuple(dA.global_shape):
            raise ValueError(f"M: global shape {dM.global_shape} differs from A's {dA.global_shape}")
        if dM.row_range != dA.row_range:
            raise ValueError(f"M: owns rows {dM.row_range} on this rank, A owns {dA.row_range}; "
                             "M needs A's layout")
        if dM.dtype != dA.dtype:
            raise TypeError(f"M: dtype {dM.dtype} differs from A's {dA.dtype}")
    if v0 is not None:
        if not isinstance(v0, torch.Tensor):
            raise TypeError(f"v0: must be a torch.Tensor, got {type(v0).__name__}")
        if v0.reshape(-1).shape[0] != dA.n_local or v0.dim() > 2 or (v0.dim() == 2 and v0.shape[1] != 1):
            raise ValueError(f"v0: must hold this rank's {dA.n_local} owned rows, got shape "
                             f"{tuple(v0.shape)}")
    return k, sigma


# --------------------------------------------------------------------------- #
# checks and post-processing
# --------------------------------------------------------------------------- #
def _default_v0(dA, row_offset, row_ids):
    """The deterministic start vector, cached on the layout (it depends only on the rows)."""
    return dA._layout.cached("eigsh_v0", (dA.dtype, str(dA.device)), lambda: start_vectors(
        dA.n_local, 1, row_offset=row_offset, row_ids=row_ids, seed=0, dtype=dA.dtype, device=dA.device)[:, 0])


def _sym_rtol(dtype) -> float:
    return 1e2 * math.sqrt(torch.finfo(dtype).eps)


def _check_operators(dA, dM, rs, row_offset, row_ids):
    """Collective (one reduction of a few scalars): symmetry of A and M, M > 0."""
    n_local = dA.n_local
    x = start_vectors(n_local, 1, row_offset=row_offset, row_ids=row_ids, seed=4242,
                      dtype=dA.dtype, device=dA.device)[:, 0]
    parts = []
    for d in (dA, dM):
        if d is None:
            parts += [torch.zeros((), dtype=dA.dtype)] * 2
            continue
        y1, y2 = d @ x, d.T @ x
        parts += [((y1 - y2) ** 2).sum(), (y1 ** 2).sum() + (y2 ** 2).sum()]
    if dM is not None:
        Mx = dM @ x
        dg = dM.diagonal().reshape(-1)
        parts += [(x * Mx).sum(), (dg <= 0).sum().to(dA.dtype)]
    else:
        parts += [torch.ones((), dtype=dA.dtype), torch.zeros((), dtype=dA.dtype)]
    s = rs(torch.stack([p.to(dA.dtype).reshape(()) for p in parts]).cpu()).tolist()
    thr = _sym_rtol(dA.dtype) ** 2
    err = None
    if not all(math.isfinite(v) for v in s):
        err = ValueError("A or M contains NaN/Inf values")
    elif s[0] > thr * s[1]:
        err = ValueError(f"A: matrix is not symmetric (||A x - A^T x|| / ||A x|| ~ "
                         f"{math.sqrt(s[0] / max(s[1] / 2, 1e-300)):.2e} for a random x); eigsh needs a "
                         "symmetric matrix")
    elif s[2] > thr * s[3]:
        err = ValueError(f"M: matrix is not symmetric (||M x - M^T x|| / ||M x|| ~ "
                         f"{math.sqrt(s[2] / max(s[3] / 2, 1e-300)):.2e}); eigsh needs a symmetric positive "
                         "definite M")
    elif s[5] > 0:
        err = ValueError(f"M: is not positive definite ({int(s[5])} diagonal entries <= 0)")
    elif not s[4] > 0:
        err = ValueError("M: is not positive definite (x^T M x <= 0 for a random x)")
    if err is not None:
        raise err   # every rank computed the same reduced numbers
