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
from ..dsparse import DSparseTensor
from .autograd import DEGENERATE_RTOL, EigshFunction, _State
from .info import EigenConvergenceError, EigenInfo
from .torch_methods import fix_signs, lanczos, lobpcg, start_vectors
from ..dtensor import dtensor_entry

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
    larger one falls back to the deflated re-solve. Not re-verified: the
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
        with _log.phase("setup", _log.event("slaEigSetup")):
            if backend == "slepc":
                solver = _SlepcSolver(dA0, dM0, k, which, sigma, tol, maxiter, ncv, options_prefix,
                                      petsc_options, st_solver, printer)
            else:
                solver = _TorchSolver(dA0, dM0, k, which, sigma, tol, maxiter, method, ncv, pc, rs, rm,
                                      row_offset, row_ids, printer)
        try:
            with _log.phase("solve", _log.event("slaEigSolve")):
                w, V, conv, its, solve_t = solver.solve(k, v0, None)
            with _log.phase("post"):
                w, V = w.to(dtype=dt, device=dev), V.to(dtype=dt, device=dev)
                V = _m_orthonormalize(V, dM0, rs)
            refine_rounds = 0
            # generalized problems without shift-invert only: there SLEPc's test on B^{-1} A can
            # pass far above tol (the case found); elsewhere a round costs k solves and rarely helps
            if min(conv, k) >= k and not solver.dense and dM0 is not None and sigma is None:
                with _log.phase("refine"):
                    w, V, refine_rounds = _refine(dA0, dM0, w, V, tol, rs, solver.residual_direction)
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
                    if backend == "slepc" and sigma is not None and dM0 is None and not needs_grad \
                            and dt == torch.float64 and _inertia_verified(dA0, w, V, sigma, rs, rm):
                        info.verify_method = "inertia"
                    else:
                        info.verify_method = "deflation"
                        w, V, info.verify_rounds, w_next, verr = _verify(
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
            res = _residuals(dA0, dM0, w, V, tol, rs)
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


def _m_orthonormalize(V, dM, rs):
    """Loewdin: V (V^T M V)^{-1/2}; ValueError (every rank) when the Gram matrix is
    not positive definite (M indefinite)."""
    if V.shape[1] == 0:
        return V
    MV = dM @ V if dM is not None else V
    G = rs(V.mT @ MV)
    G = 0.5 * (G + G.mT)
    lam, U = torch.linalg.eigh(G)
    if not bool(lam.min() > 1e3 * torch.finfo(V.dtype).eps * lam.max().abs()):
        raise ValueError("M: is not positive definite (the eigenvectors' M-Gram matrix has eigenvalues "
                         f"{lam.tolist()})")
    return V @ (U * torch.rsqrt(lam)[None, :] @ U.mT)


def _residuals(dA, dM, w, V, tol, rs):
    if V.shape[1] == 0:
        return w.new_zeros(0)
    AV = dA @ V
    BV = dM @ V if dM is not None else V
    R = AV - BV * w[None, :]
    s = rs(torch.stack([(R * R).sum(0), (BV * BV).sum(0)]))
    eps = torch.finfo(V.dtype).eps
    floor = max(100 * eps * float(w.abs().max()) / tol, torch.finfo(V.dtype).tiny)
    return torch.sqrt(s[0]) / (torch.clamp(w.abs(), min=floor) * torch.sqrt(torch.clamp(s[1], min=1e-300)))


# --------------------------------------------------------------------------- #
# backends
# --------------------------------------------------------------------------- #
#: most refinement rounds after the solve (each: 2k products with A and M, k solves)
REFINE_ROUNDS = 3


def _refine(dA, dM, w, V, tol, rs, direction):
    """Collective. Make the true residuals meet ``tol`` when the solver's own test did not.

    SLEPc tests convergence on its estimate for the transformed operator
    (``B^{-1} A``, ``(A - sigma B)^{-1} B``); for a generalized problem with an
    ill-conditioned ``M`` the eigenpairs it returns can have true relative residuals
    ``||A v - w M v|| / (|w| ||M v||)`` orders of magnitude above ``tol`` (1.7e-9 for
    ``tol=1e-12`` at cond(M) = 600, the smallest eigenvalues of SciPy's ARPACK test).
    Each round is a Rayleigh-Ritz step on ``span[V, direction(R)]``, ``R = A V - M V W``,
    where ``direction`` applies the solver's own inverse (``M^{-1}``, or ``(A - sigma
    M)^{-1}`` for shift-invert): one step of preconditioned inverse iteration, which
    removes the error components the residual shows. Rounds stop once every residual
    meets ``tol`` or a round fails to halve the largest one; a round that does not
    improve every pair is discarded. Decisions use reduced data: the same on every rank.
    Returns ``(w, V, rounds kept)``.
    """
    res = _residuals(dA, dM, w, V, tol, rs)
    rounds = 0
    for _ in range(REFINE_ROUNDS):
        worst = float(res.max())
        if not worst > tol:
            break
        MV = dM @ V if dM is not None else V
        R = dA @ V - MV * w[None, :]
        Q = _orthonormal(V, rs)
        Z = direction(R).to(V.dtype)
        for _ in range(2):            # the corrections are tiny next to V: project, then scale
            Z = Z - Q @ rs(Q.mT @ Z)
        Q = torch.cat([Q, _orthonormal(Z, rs)], 1)
        H = rs(Q.mT @ (dA @ Q))
        B = rs(Q.mT @ (dM @ Q)) if dM is not None else torch.eye(Q.shape[1], dtype=Q.dtype)
        try:
            L = torch.linalg.cholesky(0.5 * (B + B.mT))
        except RuntimeError:          # M not positive definite on the span: keep the solver's pairs
            break
        Li = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype), upper=False)
        theta, Y = torch.linalg.eigh(Li @ (0.5 * (H + H.mT)) @ Li.mT)
        Y = Li.mT @ Y                 # Y^T B Y = I: the new V is M-orthonormal
        free = list(range(theta.numel()))
        pick = []
        for wi in w.tolist():         # the Ritz value nearest each current one
            j = min(free, key=lambda t: abs(float(theta[t]) - wi))
            free.remove(j)
            pick.append(j)
        w2, V2 = theta[pick], Q @ Y[:, pick]
        V2 = V2 * torch.where(rs((V2 * MV).sum(0)) < 0, -1.0, 1.0)[None, :]
        res2 = _residuals(dA, dM, w2, V2, tol, rs)
        if not bool((res2 <= res).all()):
            break
        w, V, res = w2, V2, res2
        rounds += 1
        if not float(res.max()) < 0.5 * worst:
            break
    return w, V, rounds


def _orthonormal(X, rs):
    """Collective. An orthonormal basis of the columns of ``X`` (each scaled to unit
    norm first; directions below 1e-10 of the largest are dropped)."""
    nrm = torch.sqrt(rs((X * X).sum(0)))
    X = X[:, nrm > 0] / nrm[nrm > 0][None, :]
    G = rs(X.mT @ X)
    lam, U = torch.linalg.eigh(0.5 * (G + G.mT))
    keep = lam > 1e-10 * lam.max()
    return X @ (U[:, keep] * torch.rsqrt(lam[keep])[None, :])


def _abs_diag_pc(d):
    d = d.reshape(-1).abs()
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, torch.ones_like(d)), torch.ones_like(d))

    def apply(r):
        return r * (inv if r.dim() == 1 else inv[:, None])
    return apply


def _build_pc(dK, pc, comm):
    """Local preconditioner on the diagonal block of dK; collective error check."""
    from ..krylov import torch_pc
    err = None
    T = None
    try:
        if pc is None or pc == "none":
            T = None
        elif callable(pc):
            T = torch_pc.from_callable(pc)
        elif pc == "jacobi":
            T = _abs_diag_pc(dK.diagonal())
        elif pc in ("icc", "ilu", "bjacobi"):
            D = dK.diag
            T = torch_pc.block_jacobi_ilu(D.indptr, D.indices, D.values.detach(), D.M,
                                          kind="ic0" if pc == "icc" else "ilu0")
        else:
            raise ValueError(f"pc: expected 'jacobi', 'none', 'icc', 'ilu' or a callable, got {pc!r}")
    except (ValueError, TypeError) as e:
        err = e
    check_collective(comm, err)
    return T


def _mass_solver(dM, tol, rs):
    """x -> M^{-1} x by Jacobi-preconditioned CG (M SPD, well conditioned)."""
    from ..krylov.torch_methods import cg
    jac = _abs_diag_pc(dM.diagonal())
    rtol = min(1e-3 * tol, 1e-12)

    def solve(X):
        cols = []
        for j in range(X.shape[1]):
            y, inf = cg(lambda z: dM @ z, X[:, j].contiguous(), rtol=rtol, M=jac, reduce_sum=rs)
            if not inf.converged:
                raise ValueError(f"M: CG on the mass matrix failed ({inf.reason}); M must be SPD")
            cols.append(y)
        return torch.stack(cols, 1)
    return solve


def _shifted(dA, dM, sigma):
    """Collective. The row shard ``A - sigma M`` (pattern union)."""
    if dA.block_shape:
        raise ValueError("sigma: shift-invert in the torch backend needs a scalar (non-block) matrix")
    LA = dA.local
    rows = [LA.row_indices(), ]
    cols = [LA.indices]
    vals = [LA.values]
    if dM is not None:
        LM = dM.local
        rows.append(LM.row_indices())
        cols.append(LM.indices)
        vals.append(-sigma * LM.values)
    else:
        r0 = dA.row_range[0]
        i = torch.arange(dA.n_local, dtype=torch.int64)
        rows.append(i)
        cols.append(i + r0)
        vals.append(torch.full((dA.n_local,), -sigma, dtype=dA.dtype))
    r = torch.cat(rows)
    order = torch.argsort(r, stable=True)
    r, c, v = r[order], torch.cat(cols)[order], torch.cat(vals)[order]
    indptr = torch.zeros(dA.n_local + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(r, minlength=dA.n_local), 0)
    return DSparseTensor.from_local_rows(indptr, c, v, dA.global_shape, dA.comm, n_local_cols=dA.n_local)


# --------------------------------------------------------------------------- #
# multiplicity verification
# --------------------------------------------------------------------------- #
#: candidates asked from each deflated verification solve (at most k)
VERIFY_NEV = 2


def _want_key(w, which, sigma):
    """Smaller key = more wanted."""
    if sigma is not None:
        return (w - sigma).abs()
    return {"SA": w, "LA": -w, "LM": -w.abs(), "SM": w.abs()}[which]


def _verify(solver, w, V, k, which, sigma, tol, n, dM, rs, row_offset, row_ids):
    """Collective. Make ``(w, V)`` the ``k`` wanted eigenpairs counted with multiplicity.

    A single-vector method finds one copy of each repeated eigenvalue (its start
    vector has one component per eigenspace). Each round re-solves in the
    M-orthogonal complement of ``span(V)`` (``solver.solve(..., deflate=V)``) from a
    new start vector; every converged eigenvalue of the deflated problem more
    wanted than the current k-th (by more than ``delta``) was missed: merge, keep
    the ``k`` most wanted, repeat. A round that finds nothing better proves the set
    (the deflated problem's most wanted eigenvalue is the best one left out).

    Returns ``(w, V, rounds, w_next, error)``: ``w_next`` the most wanted eigenvalue
    left out (None when unknown), ``error`` a message when the verification could not
    be completed (None on success). All decisions use reduced data: identical on
    every rank.
    """
    max_rounds = k + 2
    eps = torch.finfo(w.dtype).eps
    for rnd in range(1, max_rounds + 1):
        MV = dM @ V if dM is not None else V
        n_rest = n - V.shape[1]
        nev = min(VERIFY_NEV, k)
        v0 = start_vectors(V.shape[0], 1, row_offset=row_offset, row_ids=row_ids, seed=1000 + rnd,
                           dtype=V.dtype, device=V.device)[:, 0]
        if n_rest <= max(2 * nev + 8, 16):
            wc, Vc = _complement_rr(solver, V, MV, n_rest, row_offset, row_ids, rs, dM)
            nconv = wc.numel()
        else:
            wc, Vc, nconv, _its, _t = solver.solve(nev, v0, (V, MV))
            wc, Vc = wc.to(w.dtype), Vc.to(V.dtype)
        if nconv < 1 or wc.numel() < 1:
            return w, V, rnd, None, (
                f"the deflated verification solve (round {rnd}) did not converge, so the {k} eigenvalues "
                "cannot be confirmed to be the wanted ones counted with multiplicity; raise maxiter / ncv "
                "or loosen tol")
        wc, Vc = wc[:nconv], Vc[:, :nconv]
        key, keyc = _want_key(w, which, sigma), _want_key(wc, which, sigma)
        kth = float(key.max())
        scale = max(float(w.abs().max()), float(wc.abs().max()))
        delta = 10 * tol * (max(abs(kth), float(keyc.abs().min())) + (abs(sigma) if sigma is not None else 0)) \
            + 100 * eps * scale
        better = keyc < kth - delta
        best = int(torch.argmin(keyc))
        if not bool(better.any()):
            return w, V, rnd, float(wc[best]), None
        # the candidates are M-orthogonal to V up to the deflation accuracy
        cross = rs(Vc.mT @ MV).abs().max() if V.shape[1] else torch.zeros(())
        if not float(cross) < 1e-6:
            return w, V, rnd, None, (
                f"the deflated verification solve returned vectors not M-orthogonal to the found ones "
                f"(|V^T M v| = {float(cross):.2e}: this method seems to ignore the deflation space); cannot "
                "confirm the eigenvalue multiplicities. Use the default Krylov-Schur")
        pool_w = torch.cat([w, wc[better]])
        pool_V = torch.cat([V, Vc[:, better]], 1)
        order = torch.sort(_want_key(pool_w, which, sigma), stable=True).indices[:k]
        w, V = pool_w[order], pool_V[:, order]
        V = _m_orthonormalize(V, dM, rs)
    return w, V, max_rounds, None, (
        f"the multiplicity verification did not settle after {max_rounds} deflated solves")


#: Sylvester inertia counts are trusted for eigenvalues farther than this many ``eps ||A||`` from
#: the shift (the backward error of MUMPS' LDL^T with threshold pivoting, with room)
INERTIA_BAND = 1e4


def _inertia_verified(dA, w, V, sigma, rs, rm) -> bool:
    """Collective. Prove, without another eigensolve, that the ``k`` orthonormal pairs
    ``(w, V)`` found nearest ``sigma`` of a standard problem are the ``k`` nearest eigenvalues
    counted with multiplicity (up to their residuals).

    With ``R = A V - V diag(w)`` there are ``k`` eigenvalues within ``||R||_F`` of the ``w``
    (Kahan). Sylvester's law of inertia: the LDL^T factorisation of ``A - tau I`` has as many
    negative pivots as ``A`` has eigenvalues below ``tau``. With ``rho = kth + 2 (||R||_F +
    band)`` (``kth`` the largest ``|w - sigma|``, ``band`` the rounding band of the counts)
    one factorisation at ``sigma + rho`` (a second at ``sigma - rho`` only when the first
    count exceeds ``k``) counts the eigenvalues in ``(sigma - rho, sigma + rho)``: a count of
    ``k`` means these are the ``k`` matched ones, so none nearer than the ``k``-th was
    missed. False (then :func:`_verify` runs) when the count is larger (missed copies, or an
    eigenvalue within ``rho - kth`` of the ``k``-th) or when no LDL^T inertia can be had
    (MUMPS missing, ``A`` not exactly symmetric, a diagonal entry not stored, ``tau`` within
    rounding of an eigenvalue). Decisions use reduced data only."""
    from ..direct.petsc_backend import shifted_inertia
    eps = torch.finfo(torch.float64).eps
    k = int(w.numel())
    w64, V64 = w.to(torch.float64), V.to(torch.float64)
    row_sums = dA.with_values(dA.values.abs()) @ V64.new_ones(V64.shape[0])
    local = row_sums.max() if row_sums.numel() else row_sums.new_zeros(())
    norm_a = float(rm(local.reshape(1))[0])   # ||A||_inf
    R = dA @ V64 - V64 * w64[None, :]
    err = float(torch.sqrt(rs((R ** 2).sum().reshape(1))[0]))
    kth = float((w64 - sigma).abs().max())
    band = INERTIA_BAND * eps * (norm_a + abs(sigma) + kth)
    rho = kth + 2 * (err + band)
    hi = shifted_inertia(dA, sigma + rho)
    if hi is None or hi[1] > 0:
        return False
    if hi[0] <= k:
        return True
    lo = shifted_inertia(dA, sigma - rho)
    return lo is not None and lo[1] == 0 and hi[0] - lo[0] <= k


def _complement_rr(solver, V, MV, n_rest, row_offset, row_ids, rs, dM):
    """Collective. All eigenpairs of the (small, ``n_rest``-dimensional, invariant)
    M-orthogonal complement of ``span(V)``: Rayleigh-Ritz on a random block
    projected into it (no global arrays; for ``k`` close to ``n``)."""
    Z = start_vectors(V.shape[0], n_rest, row_offset=row_offset, row_ids=row_ids, seed=777,
                      dtype=V.dtype, device=V.device)
    for _ in range(2):
        Z = Z - V @ rs(MV.mT @ Z)
    Z = _m_orthonormalize(Z, dM, rs)
    AZ = solver.dA @ Z
    H = rs(Z.mT @ AZ)
    theta, C = torch.linalg.eigh(0.5 * (H + H.mT))
    return theta, Z @ C


# --------------------------------------------------------------------------- #
# backends: one solver object per call, reused by the verification rounds
# --------------------------------------------------------------------------- #
class _SlepcSolver:
    """Collective. ``solve(nev, v0, deflate)`` on one configured EPS (SlepcSession);
    PETSc errors become ValueError (bad options, indefinite M) / RuntimeError, on
    every rank."""

    def __init__(self, dA, dM, k, which, sigma, tol, maxiter, ncv, options_prefix, petsc_options,
                 st_solver, progress=None):
        self.dA, self.dM = dA, dM
        err = None
        self.session = None
        try:
            self.session = slepc_backend.SlepcSession(
                dA, dM, k, which=which, sigma=sigma, tol=tol, maxiter=maxiter, ncv=ncv,
                options_prefix=options_prefix, petsc_options=petsc_options, st_solver=st_solver,
                monitor=progress)
        except slepc_backend.PETSc.Error as e:
            msg = f"SLEPc rejected the configuration ({e})"
            if petsc_options or options_prefix:
                msg = f"petsc_options / options_prefix {options_prefix!r}: " + msg
            if dM is not None:
                msg += " (for a generalized problem this may also mean M is not positive definite)"
            err = ValueError(msg)
        check_collective(dA.comm, err)
        self.method = self.session.method
        self.setup_time = self.session.setup_time
        # dense EPS types compute the whole spectrum (with multiplicity) and ignore a
        # deflation space: nothing to verify
        self.block_safe = self.dense = self.method.split("+")[0] in ("lapack", "scalapack", "elpa",
                                                                      "elemental")

    def solve(self, nev, v0, deflate):
        err = out = None
        try:
            if deflate is not None:
                deflate = deflate[0].to(torch.float64)
            out = self.session.solve(nev, v0, deflate)
        except slepc_backend.PETSc.Error as e:
            msg = f"SLEPc ({self.method}) failed: {e}"
            if deflate is not None:
                msg += " (in the deflated multiplicity verification; this EPS type may not support a " \
                       "deflation space -- use the default Krylov-Schur)"
                err = RuntimeError(msg)
            elif self.dM is not None:
                err = ValueError(msg + " (for a generalized problem this usually means M is not positive "
                                 "definite)")
            else:
                err = RuntimeError(msg)
        check_collective(self.dA.comm, err)
        return out

    def residual_direction(self, R):
        """Collective. The refinement direction for residuals ``R`` (:func:`_refine`):
        the spectral transformation's own solve (``M^{-1} R``, ``(A - sigma M)^{-1} R``)
        where the EPS has one, else ``R``."""
        err = out = None
        try:
            out = self.session.st_solve(R)
        except slepc_backend.PETSc.Error as e:
            err = RuntimeError(f"SLEPc ({self.method}): the refinement solve failed: {e}")
        check_collective(self.dA.comm, err)
        return R if out is None else out

    def close(self):
        if self.session is not None:
            self.session.close()
            self.session = None


class _TorchSolver:
    """Collective. The native kernels behind ``solve(nev, v0, deflate)`` (the
    operators, preconditioners and shift-invert solver are built once)."""

    def __init__(self, dA, dM, k, which, sigma, tol, maxiter, method, ncv, pc, rs, rm, row_offset, row_ids,
                 progress=None):
        t0 = time.perf_counter()
        self.dA, self.dM = dA, dM
        self.Kinv = None
        self.progress = progress
        self.tol, self.ncv, self.k = tol, ncv, k
        self.rs = rs
        self.n_global = int(dA.global_shape[0]) * (dA.block_shape[0] if dA.block_shape else 1)  # scalar rows
        self.kw = dict(reduce_sum=rs, reduce_max=rm, row_offset=row_offset, row_ids=row_ids)
        self.row_offset, self.row_ids = row_offset, row_ids
        comm = dA.comm
        self.Bop = (lambda X: dM @ X) if dM is not None else None
        if sigma is None and which == "SM":
            sigma = 0.0
        self.sigma, self.which = sigma, which
        err = None
        if sigma is None:
            if method is None:
                method = "lobpcg" if which == "SA" else "lanczos"
            if method == "lobpcg" and which not in ("SA", "LA"):
                err = ValueError("method: 'lobpcg' computes 'LA' or 'SA' eigenvalues, not which='LM'")
        else:
            if method == "lobpcg":
                err = ValueError("method: shift-invert (sigma, or which='SM' in the torch backend) runs "
                                 "Lanczos; method='lobpcg' is not available there")
            method = "lanczos"
        check_collective(comm, err)
        self.kind = method
        self.method = method + ("+sinvert" if sigma is not None else "")
        # native LOBPCG iterates a block of m >= k vectors (solve()): it cannot lose copies
        self.block_safe = method == "lobpcg"
        self.dense = False
        self.maxiter = maxiter if maxiter is not None else (5000 if method == "lobpcg" else 1000)
        if sigma is None:
            self.T = _build_pc(dA, pc, comm) if (method == "lobpcg" and which == "SA") else None
            self.Bs = _mass_solver(dM, tol, rs) if (dM is not None and method == "lanczos") else None
            self.OP = lambda X: dA @ X
        else:
            self.OP, self.Bs = self._shift_invert(dA, dM, sigma, pc, comm, tol, rs)
        self.setup_time = time.perf_counter() - t0

    def _shift_invert(self, dA, dM, sigma, pc, comm, tol, rs):
        # Lanczos on (A - sigma M)^{-1} M in the M-inner product; the inner solves go
        # through slasolve.solve (native MINRES: A - sigma M is indefinite)
        from ..krylov import solve as _solve
        dK = _shifted(dA, dM, sigma)
        T = _build_pc(dK, pc, comm)
        inner_rtol = min(1e-2 * tol, 1e-10)
        n_global = self.n_global

        def Kinv(X):
            with torch.no_grad():
                Y, inf = _solve(dK, X.contiguous(), "minres", backend="torch", M=T, rtol=inner_rtol,
                                maxiter=max(20 * n_global, 1000), raise_on_fail=False, return_info=True)
            if not inf.converged:
                raise EigenConvergenceError(
                    f"eigsh (torch, shift-invert): the inner MINRES solve with A - sigma M failed "
                    f"({inf.reason} after {inf.iterations} iterations); is sigma={sigma} an eigenvalue?")
            return Y

        self.Kinv = Kinv
        if dM is None:
            return Kinv, None
        Bop = self.Bop
        return (lambda X: Bop(Kinv(Bop(X)))), _mass_solver(dM, tol, rs)

    def solve(self, nev, v0, deflate):
        t1 = time.perf_counter()
        dA = self.dA
        n_local = dA.n_local
        defl = None if deflate is None else (deflate[0], deflate[1])
        nd = 0 if defl is None else defl[0].shape[1]
        if self.sigma is None and self.kind == "lobpcg":
            m = min(max(2 * nev, nev + 4), self.n_global - nd)
            X0 = start_vectors(n_local, m, row_offset=self.row_offset, row_ids=self.row_ids,
                               seed=1 + (0 if deflate is None else 17 * nd), dtype=dA.dtype, device=dA.device)
            X0[:, 0] = v0
            w, V, inf = lobpcg(self.OP, X0, B=self.Bop, T=self.T, k=nev, largest=(self.which == "LA"),
                               tol=self.tol, maxiter=self.maxiter, deflate=defl, callback=self.progress,
                               **self.kw)
        elif self.sigma is None:
            # the verification keeps the first solve's basis size: a smaller one converges
            # much slower on clustered extreme eigenvalues
            ncv = self.ncv if self.ncv is not None else max(2 * self.k + 1, 20)
            ncv = min(self.n_global - nd, max(ncv, 2 * nev + 1))
            w, V, inf = lanczos(self.OP, v0, nev, which=self.which, B=self.Bop, B_solve=self.Bs,
                                tol=self.tol, maxiter=self.maxiter, ncv=ncv, deflate=defl,
                                callback=self.progress, **self.kw)
        else:
            # shift-invert: every basis vector costs an inner solve and convergence takes a
            # restart or two, so the verification uses a small basis
            ncv = self.ncv if deflate is None else None
            if ncv is None:
                ncv = min(self.n_global - nd, max(2 * nev + 1, 20 if deflate is None else 12))
            theta, V, inf = lanczos(self.OP, v0, nev, which="LM", B=self.Bop, B_solve=self.Bs,
                                    tol=self.tol, maxiter=self.maxiter, ncv=ncv, deflate=defl,
                                    callback=self.progress, **self.kw)
            w = self.sigma + 1.0 / theta
        if deflate is not None:
            # candidates for the verification: the converged prefix in wanted order (a
            # converged pair behind an unconverged more wanted one proves nothing)
            ok = torch.tensor([r <= self.tol for r in inf.residual_norms], dtype=torch.bool)
            order = torch.argsort(_want_key(w, self.which, self.sigma), stable=True)
            okw = ok[order]
            nconv = int(okw.numel() if bool(okw.all()) else int(torch.nonzero(~okw)[0]))
            order = order[:nconv]
            return w[order], V[:, order], nconv, inf.iterations, time.perf_counter() - t1
        return w, V, inf.converged, inf.iterations, time.perf_counter() - t1

    def residual_direction(self, R):
        """Collective. The refinement direction for residuals ``R`` (:func:`_refine`):
        ``(A - sigma M)^{-1} R`` with shift-invert, ``M^{-1} R`` for a generalized
        problem, else ``R``."""
        if self.Kinv is not None:
            return self.Kinv(R)
        if self.dM is not None:
            if self.Bs is None:
                self.Bs = _mass_solver(self.dM, self.tol, self.rs)
            return self.Bs(R)
        return R

    def close(self):
        pass
