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

from .._comm import allreduce_max, allreduce_sum, check_collective
from ..dsparse import DSparseTensor
from .autograd import DEGENERATE_RTOL, EigshFunction, _State
from .info import EigenConvergenceError, EigenInfo
from .torch_methods import fix_signs, lanczos, lobpcg, start_vectors

__all__ = ["eigsh", "default_backend"]

_WHICH = ("LA", "SA", "LM", "SM")
_BACKENDS = ("slepc", "torch")


def default_backend() -> str:
    """Local. ``"slepc"`` when slepc4py imports, else ``"torch"``."""
    try:
        from . import slepc_backend  # noqa: F401
        return "slepc"
    except ImportError:
        return "torch"


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


def eigsh(A, k: int = 6, M=None, which: str = "LM", sigma: Optional[float] = None,
          v0: Optional[torch.Tensor] = None, tol: float = 1e-8, maxiter: Optional[int] = None, *,
          backend: Optional[str] = None, method: Optional[str] = None, ncv: Optional[int] = None,
          pc: Union[str, Callable, None] = "jacobi", return_info: bool = False,
          raise_on_fail: bool = True, check_input: bool = True,
          petsc_options: Optional[dict] = None, options_prefix: Optional[str] = None,
          st_solver: Optional[str] = None, grad_rtol: float = 1e-10,
          grad_maxiter: Optional[int] = None, degenerate_rtol: float = DEGENERATE_RTOL):
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
        ``maxiter`` SLEPc's; torch: the kernels' relative residual test, on the
        shift-inverted operator when ``sigma`` is used; default ``maxiter`` 5000
        LOBPCG iterations / 1000 Lanczos restarts).
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
        ``k`` pairs converged (default). With ``False`` the pairs are returned
        anyway and ``info.converged`` says how many converged; the SLEPc
        backend then returns only the ``info.converged`` converged pairs.
    check_input : bool
        Cheap collective checks: ``A`` (and ``M``) symmetric (``||A x - A^T x||``
        for a pseudo-random ``x``, relative ``1e2 sqrt(eps)``), ``diag(M) > 0``
        and ``x^T M x > 0``. One reduction.
    petsc_options, options_prefix, st_solver : SLEPc backend
        ``{"eps_type": "lobpcg", ...}`` put into the options database (under
        ``options_prefix``) for this call only; the command line works as
        usual; ``st_solver`` the LU package of shift-invert (default MUMPS when
        available).
    grad_rtol, grad_maxiter, degenerate_rtol : backward
        Tolerance / limit of the projected MINRES solves of eigenvector
        gradients, and the relative eigenvalue gap below which eigenvector
        gradients are refused (see :mod:`slasolve.eigen.autograd`).

    Notes
    -----
    Krylov-Schur (SLEPc), Lanczos (native) and ARPACK (SciPy) build their space
    from one start vector, which has one component per eigenspace: an exactly
    repeated eigenvalue (a square grid, a symmetric domain) is found once and
    the next distinct one takes the second slot, with small residuals. Use the
    block method (``backend="torch"``, ``method="lobpcg"``, or SLEPc's
    ``petsc_options={"eps_type": "lobpcg"}``) with a block larger than the
    multiplicity for such spectra.

    Returns
    -------
    w : ``(k,)`` eigenvalues, ascending, identical on every rank.
    V : ``(n_local, k)`` owned rows of the M-orthonormal eigenvectors
        (``V^T M V = I``), sign convention: each column's first dominant entry
        (largest magnitude; ties within a relative ``eps**(1/3)`` go to the
        smallest global index, in the user's numbering when a partitioner
        renumbered the rows) is positive -- the same for every rank count and
        backend.
    info : :class:`EigenInfo` (when ``return_info``). ``residual_norms`` are always
        explicit residuals of the *original* problem on the returned pairs,
        ``||A v - w M v|| / (max(|w|, 100 eps max|w| / tol) ||M v||)``;
        ``converged`` is the backend's own count (SLEPc's ``nconv``; torch: the
        kernel's test).

    Gradients flow to ``A``'s values (and ``M``'s) when they require grad;
    backward is collective. See :mod:`slasolve.eigen.autograd` for the formulas,
    the symmetrisation convention and degenerate eigenvalues.

    Errors (raised on every rank): ``TypeError`` / ``ValueError`` naming the
    argument; ``ValueError`` for a nonsymmetric ``A`` or ``M``, and for an ``M``
    that is not positive definite (cheap checks, or detected by the solver);
    :class:`EigenConvergenceError` on non-convergence.
    """
    t_start = time.perf_counter()
    dA = _as_row_shard(A, "A")
    comm = dA.comm
    dM = None
    err = None
    try:
        if M is not None:
            dM = _as_row_shard(M, "M")
    except (TypeError, ValueError) as e:
        err = e
    check_collective(comm, err)
    n = int(dA.global_shape[0]) * (dA.block_shape[0] if dA.block_shape else 1)
    err = None
    try:
        if dA.global_shape[0] != dA.global_shape[1]:
            raise ValueError(f"A: must be square, got global shape {dA.global_shape}")
        if not dA.dtype.is_floating_point or dA.dtype.is_complex:
            raise TypeError(f"A: real floating dtype required, got {dA.dtype}")
        if isinstance(k, bool) or not isinstance(k, numbers.Integral):
            raise TypeError(f"k: must be an int, got {type(k).__name__}")
        k = int(k)
        if not (1 <= k < n):
            raise ValueError(f"k: need 1 <= k < n = {n} (use a dense solver for all eigenpairs), got k={k}")
        if which not in _WHICH:
            raise ValueError(f"which: expected one of {_WHICH}, got {which!r}")
        if sigma is not None:
            if not isinstance(sigma, numbers.Real) or not math.isfinite(float(sigma)):
                raise ValueError(f"sigma: must be a finite real number or None, got {sigma!r}")
            sigma = float(sigma)
            if which != "LM":
                raise ValueError(f"which: with sigma only 'LM' (eigenvalues nearest sigma) is supported, "
                                 f"got {which!r}")
        if not (isinstance(tol, numbers.Real) and tol > 0):
            raise ValueError(f"tol: must be a positive number, got {tol!r}")
        if maxiter is not None and (not isinstance(maxiter, numbers.Integral) or maxiter < 1):
            raise ValueError(f"maxiter: must be a positive int or None, got {maxiter!r}")
        if backend is None:
            backend = default_backend()
        if backend not in _BACKENDS:
            raise ValueError(f"backend: expected one of {_BACKENDS}, got {backend!r}")
        if method is not None and method not in ("lobpcg", "lanczos"):
            raise ValueError(f"method: expected 'lobpcg', 'lanczos' or None, got {method!r}")
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
    except (TypeError, ValueError) as e:
        err = e
    check_collective(comm, err)
    if backend == "slepc":
        err = None
        try:
            from . import slepc_backend  # noqa: F401
        except ImportError as e:
            err = e
        check_collective(comm, err)

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
        if check_input:
            _check_operators(dA0, dM0, rs, row_offset, row_ids)
        if v0 is None:
            v0 = _default_v0(dA, row_offset, row_ids)
        else:
            v0 = v0.detach().reshape(-1).to(dtype=dt, device=dev)
        t_setup = time.perf_counter() - t_start
        if backend == "slepc":
            w, V, conv, its, setup, solve_t, method_name = _run_slepc(
                dA0, dM0, k, which, sigma, v0, tol, maxiter, ncv, options_prefix, petsc_options, st_solver)
            V = V.to(dtype=dt, device=dev)
            w = w.to(dtype=dt, device=dev)
            V = _m_orthonormalize(V, dM0, rs)
        else:
            w, V, conv, its, setup, solve_t, method_name = _run_torch(
                dA0, dM0, k, which, sigma, v0, tol, maxiter, method, ncv, pc, rs, rm, row_offset, row_ids)
        order = torch.argsort(w)
        w, V = w[order].contiguous(), V[:, order].contiguous()
        V = fix_signs(V, reduce_max=rm, row_offset=row_offset, row_ids=row_ids)
        res = _residuals(dA0, dM0, w, V, tol, rs)
        info = EigenInfo(converged=int(min(conv, k)), k=k, iterations=int(its),
                         residual_norms=[float(r) for r in res], method=method_name, backend=backend,
                         setup_time=t_setup + setup, solve_time=solve_t, matvecs=0)
    if info.converged < k and raise_on_fail:
        raise EigenConvergenceError(
            f"eigsh ({backend}, {method_name}): only {info.converged} of the k={k} requested eigenpairs "
            f"converged after {info.iterations} iterations (tol={tol:g}); residuals "
            f"{[f'{r:.2e}' for r in info.residual_norms]}. Raise maxiter / ncv, loosen tol, use shift-"
            "invert (sigma) for clustered small eigenvalues, or pass raise_on_fail=False.", info)

    needs_grad = torch.is_grad_enabled() and (
        dA.values.requires_grad or (dM is not None and dM.values.requires_grad))
    if needs_grad:
        state = _State(dA0, dM0, grad_rtol, grad_maxiter, degenerate_rtol)
        w, V = EigshFunction.apply(dA.values, dM.values if dM is not None else None, w, V, state)
    if return_info:
        return w, V, info
    return w, V


# --------------------------------------------------------------------------- #
# checks and post-processing
# --------------------------------------------------------------------------- #
def _default_v0(dA, row_offset, row_ids):
    """The deterministic start vector, cached on the layout (it depends only on the rows)."""
    L = dA._layout
    cache = L.__dict__.setdefault("_eigsh_v0", {})
    key = (dA.dtype, str(dA.device))
    if key not in cache:
        cache[key] = start_vectors(dA.n_local, 1, row_offset=row_offset, row_ids=row_ids, seed=0,
                                   dtype=dA.dtype, device=dA.device)[:, 0]
    return cache[key]


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
def _run_slepc(dA, dM, k, which, sigma, v0, tol, maxiter, ncv, options_prefix, petsc_options, st_solver):
    from .slepc_backend import slepc_eigsh, PETSc
    err = None
    out = None
    try:
        out = slepc_eigsh(dA, dM, k, which=which, sigma=sigma, v0=v0, tol=tol, maxiter=maxiter, ncv=ncv,
                          options_prefix=options_prefix, petsc_options=petsc_options, st_solver=st_solver)
    except PETSc.Error as e:
        msg = f"SLEPc failed: {e}"
        if dM is not None:
            msg += " (for a generalized problem this usually means M is not positive definite)"
        err = ValueError(msg) if dM is not None else RuntimeError(msg)
    check_collective(dA.comm, err)
    w, V, nconv, its, setup, solve_t, _reason = out
    return w, V, nconv, its, setup, solve_t, "krylovschur" + ("+sinvert" if sigma is not None else "")


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


def _run_torch(dA, dM, k, which, sigma, v0, tol, maxiter, method, ncv, pc, rs, rm, row_offset, row_ids):
    t0 = time.perf_counter()
    comm = dA.comm
    n_local = dA.n_local
    dt, dev = dA.dtype, dA.device
    n_global = int(dA.global_shape[0])

    def Aop(X):
        return dA @ X

    Bop = (lambda X: dM @ X) if dM is not None else None
    if sigma is None and which == "SM":
        sigma = 0.0
    kw = dict(reduce_sum=rs, reduce_max=rm, row_offset=row_offset, row_ids=row_ids)
    if sigma is None:
        if method is None:
            method = "lobpcg" if which == "SA" else "lanczos"
        if method == "lobpcg":
            if which == "LM":
                raise ValueError("method: 'lobpcg' computes 'LA' or 'SA' eigenvalues, not which='LM'")
            m = min(max(2 * k, k + 4), n_global)
            X0 = start_vectors(n_local, m, row_offset=row_offset, row_ids=row_ids, seed=1, dtype=dt,
                               device=dev)
            X0[:, 0] = v0
            T = _build_pc(dA, pc, comm) if which == "SA" else None
            setup = time.perf_counter() - t0
            t1 = time.perf_counter()
            w, V, inf = lobpcg(Aop, X0, B=Bop, T=T, k=k, largest=(which == "LA"), tol=tol,
                               maxiter=maxiter if maxiter is not None else 5000, **kw)
        else:
            Bs = _mass_solver(dM, tol, rs) if dM is not None else None
            setup = time.perf_counter() - t0
            t1 = time.perf_counter()
            w, V, inf = lanczos(Aop, v0, k, which=which, B=Bop, B_solve=Bs, tol=tol,
                                maxiter=maxiter if maxiter is not None else 1000, ncv=ncv, **kw)
        return w, V, inf.converged, inf.iterations, setup, time.perf_counter() - t1, inf.method
    # shift-and-invert Lanczos on (A - sigma M)^{-1} M, M-inner product; the inner
    # solves go through slasolve.solve (native MINRES: A - sigma M is indefinite)
    from ..krylov import solve as _solve
    dK = _shifted(dA, dM, sigma)
    T = _build_pc(dK, pc, comm)
    inner_rtol = min(1e-2 * tol, 1e-10)

    def Kinv(X):
        with torch.no_grad():
            Y, inf = _solve(dK, X.contiguous(), "minres", backend="torch", M=T, rtol=inner_rtol,
                            maxiter=max(20 * n_global, 1000), raise_on_fail=False, return_info=True)
        if not inf.converged:
            raise EigenConvergenceError(
                f"eigsh (torch, shift-invert): the inner MINRES solve with A - sigma M failed "
                f"({inf.reason} after {inf.iterations} iterations); is sigma={sigma} an eigenvalue?")
        return Y

    if dM is None:
        OPA, B, Bs = Kinv, None, None
    else:
        def OPA(X):
            return Bop(Kinv(Bop(X)))
        B, Bs = Bop, _mass_solver(dM, tol, rs)
    setup = time.perf_counter() - t0
    t1 = time.perf_counter()
    theta, V, inf = lanczos(OPA, v0, k, which="LM", B=B, B_solve=Bs, tol=tol,
                            maxiter=maxiter if maxiter is not None else 1000, ncv=ncv, **kw)
    w = sigma + 1.0 / theta
    return w, V, inf.converged, inf.iterations, setup, time.perf_counter() - t1, "lanczos+sinvert"
