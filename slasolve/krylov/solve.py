"""``solve``, ``cg``, ``gmres``, ``minres``, ``bicgstab``, ``cgs``, ``tfqmr``: differentiable
distributed Krylov solves.

``x = solve(A, b)`` is differentiable with respect to ``b`` and ``A``'s values by
the adjoint method: the backward solves ``A^T lam = dL/dx`` with the same
solver (and preconditioner), then ``dL/db = lam`` and
``dL/dvalues[k] = -lam[row_k] x[col_k]`` on the stored nonzeros only.
"""
from __future__ import annotations

from collections import OrderedDict
from numbers import Integral, Real
from typing import Callable, Optional, Tuple, Union

import torch
from mpi4py import MPI

from .. import _log
from ..dsparse import DSparseTensor
from .._comm import agree_digest, check_collective, options_key, user_code
from ..registry import BACKENDS, KRYLOV_METHODS, default_backend, solve_method, solve_method_names
from .adjoint import AdjointSolve, forward_solve
from .info import SolveInfo
from .reuse import check_reuse, resolve_reuse
from ..settings import SettingsSchema
from .runs import merge_infos
from .torch_methods import default_maxiter
from ..sparse import SparseTensor
from .operator import as_row_shard, needs_grad, operator_error, rhs_error
from ..dtensor import dtensor_entry

__all__ = ["solve", "cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "default_backend"]


#: KSPs / native solvers kept per operator layout (least recently used evicted first)
SOLVER_CACHE_SIZE = 8


def _pc_key(pc):
    return "callable" if callable(pc) else pc


#: the settings of one solve: the keyed ones select the cached solver, all must agree across ranks
SOLVE_SETTINGS = SettingsSchema(
    keyed=("backend", "method", "pc", "restart", "options_prefix", "petsc_options", "reuse interpolation"),
    agreed=("rtol", "atol", "maxiter", "b columns", "x0 given", "dtype", "return_info", "raise_on_fail",
            "reuse_pc", "near_nullspace columns", "A's values require grad", "b requires grad"))


def _solver(dA, settings, pc, petsc_options, **replace):
    """Collective. The cached solver for ``settings`` (a keyed setting replaced by ``replace``,
    e.g. ``method="gmres"``) on ``dA``'s layout; ``pc``, ``petsc_options``: the call's own.

    The cache is a small LRU (``SOLVER_CACHE_SIZE``): every setting in the key agrees
    across ranks (checked by ``solve``), so every rank hits, misses and evicts at the
    same call. Evicted solvers are dropped, not destroyed (an autograd graph may still
    hold one for its backward); PETSc destroys them at the next
    ``PETSc.garbage_cleanup``, which runs (collectively) whenever a solver is created.
    A user callable preconditioner is keyed as ``"callable"`` and swapped in per call.
    ``reuse_pc="interpolation"`` configures GAMG differently: a KSP of its own, never shared.
    """
    key = settings.key(**replace)
    s = dict(zip(settings.keyed, key))
    backend = s["backend"]

    def build():
        err = solver = None
        with _log.phase("setup", _log.event("slaSolverSetup")):
            if backend == "petsc":
                from ..petsc import garbage_cleanup
                garbage_cleanup(dA.comm)
            try:
                if backend == "petsc":
                    from .petsc_backend import PetscKrylov
                    solver = PetscKrylov(dA, s["method"], pc, restart=s["restart"],
                                         options_prefix=s["options_prefix"], petsc_options=petsc_options,
                                         reuse_interpolation=s["reuse interpolation"])
                else:
                    from .torch_backend import TorchKrylov
                    solver = TorchKrylov(dA, s["method"], pc, restart=s["restart"])
            except (ValueError, TypeError, ImportError) as e:
                err = e
            check_collective(dA.comm, err)
        return solver

    solver = dA._layout.cached("solvers", key, build, SOLVER_CACHE_SIZE)
    if callable(pc):
        solver.set_callable(pc)
    return solver


def _is_int(v) -> bool:
    return type(v) is int or isinstance(v, Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    # float and int first: the ABC checks cost a Python-level __instancecheck__ each
    return type(v) is float or type(v) is int or isinstance(v, Real) and not isinstance(v, bool) or \
        (isinstance(v, torch.Tensor) and v.numel() == 1 and not v.is_complex())


def _check_settings(method, backend, pc, M, rtol, atol, maxiter, restart, petsc_options, options_prefix):
    """Local. The first problem with the scalar settings, or None."""
    if method not in KRYLOV_METHODS:
        return ValueError(f"method must be one of {solve_method_names()}, got {method!r}")
    if backend not in BACKENDS:
        return ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if M is not None and pc is not None:
        return ValueError("give the preconditioner as pc or as M, not both")
    p = M if M is not None else pc
    if p is not None and not callable(p) and not isinstance(p, str):
        return TypeError(f"pc must be a name, a callable or None, got {type(p).__name__}")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not _is_real(v):
            return TypeError(f"{name} must be a real number, got {type(v).__name__}")
        if not float(v) >= 0:
            return ValueError(f"{name} must be >= 0, got {v}")
    if maxiter is not None and not _is_int(maxiter):
        return TypeError(f"maxiter must be an int or None, got {type(maxiter).__name__}")
    if maxiter is not None and maxiter < 0:
        return ValueError(f"maxiter must be >= 0 (or None for the default), got {maxiter}")
    if not _is_int(restart) or restart <= 0:
        return ValueError(f"restart must be a positive int, got {restart!r}")
    if petsc_options is not None and not isinstance(petsc_options, dict):
        return TypeError(f"petsc_options must be a dict or None, got {type(petsc_options).__name__}")
    if options_prefix is not None and not isinstance(options_prefix, str):
        return TypeError(f"options_prefix must be a str or None, got {type(options_prefix).__name__}")
    return None


def near_nullspace_error(n: int, Z) -> Optional[Exception]:
    """Local. The first problem with ``near_nullspace`` for ``n`` owned rows, or None."""
    if Z is None:
        return None
    if not isinstance(Z, torch.Tensor):
        return TypeError(f"near_nullspace must be a torch.Tensor (n_local, m), got {type(Z).__name__}")
    if Z.is_complex() or not Z.dtype.is_floating_point:
        return TypeError(f"near_nullspace must have a real floating dtype, got {Z.dtype}")
    if Z.dim() != 2 or Z.shape[0] != n or Z.shape[1] == 0:
        return ValueError(f"near_nullspace must have shape ({n}, m) with m >= 1 (this rank's owned rows of "
                          f"m vectors), got {tuple(Z.shape)}")
    if not bool(torch.isfinite(Z.detach()).all()):
        return ValueError("near_nullspace contains NaN or infinite values")
    return None


def _validate(A, b, x0, *, method, backend, pc, M, rtol, atol, maxiter, restart, petsc_options,
              options_prefix, return_info, raise_on_fail, reuse_pc, near_nullspace=None):
    """Collective. Normalise ``A`` and check every argument with ONE check_collective,
    whose ``agree`` part makes every rank raise when the settings differ between ranks."""
    dA, err = None, None
    try:
        dA = as_row_shard(A)
    except (TypeError, ValueError) as e:
        err = e
    comm = A.comm if isinstance(A, DSparseTensor) else (dA.comm if dA is not None else MPI.COMM_SELF)
    err = err or _check_settings(method, backend, pc, M, rtol, atol, maxiter, restart, petsc_options,
                                 options_prefix) or check_reuse(reuse_pc)
    if err is None:
        err = operator_error(dA) or rhs_error(dA, b, x0) or near_nullspace_error(dA.n_local, near_nullspace)
    p = M if M is not None else pc
    values = {
        "method": method, "backend": backend, "pc": _pc_key(p), "restart": restart, "options_prefix": options_prefix,
        "petsc_options": options_key(petsc_options),
        # GAMG configured to keep its prolongators: a KSP of its own
        "reuse interpolation": check_reuse(reuse_pc) is None and backend == "petsc"
        and resolve_reuse(reuse_pc, backend, p) == "interpolation",
        # + 0.0: -0.0 and 0.0 are one setting (and one cache key below)
        "rtol": float(rtol) + 0.0 if _is_real(rtol) else repr(rtol),
        "atol": float(atol) + 0.0 if _is_real(atol) else repr(atol),
        "maxiter": maxiter, "return_info": bool(return_info), "raise_on_fail": bool(raise_on_fail),
        "reuse_pc": reuse_pc if isinstance(reuse_pc, (bool, str)) else repr(reuse_pc),
        "dtype": str(b.dtype) if isinstance(b, torch.Tensor) else None,
        "b columns": (b.shape[1] if b.dim() == 2 else None) if isinstance(b, torch.Tensor) else None,
        "x0 given": x0 if isinstance(x0, str) else x0 is not None,
        "near_nullspace columns": None if near_nullspace is None else
        (near_nullspace.shape[-1] if isinstance(near_nullspace, torch.Tensor) else "given"),
        # a graph on some ranks only would leave those ranks alone in the backward's adjoint
        "A's values require grad": needs_grad(dA.values if dA is not None else None),
        "b requires grad": needs_grad(b)}
    settings, digest = _bind(values)
    check_collective(comm, err, agree=settings.agree(), digest=digest)
    return dA, settings


#: bound settings seen recently: key -> (Settings, digest of the settings every rank must agree on)
_BOUND: "OrderedDict[tuple, tuple]" = OrderedDict()
_BOUND_SIZE = 32


def _bind(values: dict) -> tuple:
    """Local. ``(SOLVE_SETTINGS.bind(**values), its agree digest)``, kept for settings seen again
    (a loop's calls): the digest hashes the settings' ``repr``, so the key holds each value with
    its type (``1`` and ``1.0``, ``True`` and ``1`` are other settings); unhashable values are
    bound afresh."""
    try:
        key = tuple(values.values()) + tuple(map(type, values.values()))
        hit = _BOUND.get(key)
    except TypeError:
        key = hit = None
    if hit is None:
        settings = SOLVE_SETTINGS.bind(**values)
        hit = (settings, agree_digest(settings.agree()))
        if key is not None:
            _BOUND[key] = hit
            if len(_BOUND) > _BOUND_SIZE:
                _BOUND.popitem(last=False)
    return hit


def _progress_callback(comm, every: int, user_cb):
    def cb(it, rnorm):
        if comm.Get_rank() == 0 and it % every == 0:
            print(f"  iteration {it:6d}  residual {rnorm:.3e}", flush=True)
        if user_cb is not None:
            user_cb(it, rnorm)
    return cb


@dtensor_entry("solve")
def solve(A, b: torch.Tensor, method: str = "cg", *, backend: Optional[str] = None, rtol: float = 1e-5,
          atol: float = 0.0, maxiter: Optional[int] = None, x0: Union[torch.Tensor, str, None] = None,
          pc: Union[str, Callable, None] = None, M: Optional[Callable] = None, restart: int = 30,
          callback: Optional[Callable[[int, float], None]] = None, return_info: bool = False,
          raise_on_fail: bool = True, petsc_options: Optional[dict] = None,
          options_prefix: Optional[str] = None, record_history: bool = False,
          progress: Union[bool, int] = False, reuse_pc: Union[bool, str] = "auto",
          near_nullspace: Optional[torch.Tensor] = None
          ) -> Union[torch.Tensor, Tuple[torch.Tensor, SolveInfo]]:
    """Collective. Solve ``A x = b`` with a Krylov method; differentiable (adjoint).

    Parameters
    ----------
    A : DSparseTensor (row shard), SparseTensor, scipy.sparse matrix or torch sparse tensor
        The last three are single-rank operators.
    b : torch.Tensor
        This rank's owned rows, ``(n_local,)`` or ``(n_local, k)``. With ``k`` columns
        every column is a solve of its own (its tolerance ``max(rtol ||b_j||, atol)``,
        its ``x0`` column, its convergence decision; ``info.per_rhs`` holds one
        SolveInfo per column, ``info`` merges them: converged if all are, the worst
        reason, the largest iteration count and residual). The petsc backend solves the
        columns in one call (set-up, checks and the true-residual verification once for
        all; the adjoint too); the torch backend loops over them.
    method : {"cg", "gmres", "minres", "bicgstab", "cgs", "tfqmr", "direct"}
        The Krylov methods of :data:`slasolve.registry.KRYLOV_METHODS`. ``"direct"``: sparse LU / Cholesky (:func:`slasolve.spsolve`; ``pc`` = None, ``"lu"``
        or ``"cholesky"`` picks the factorisation; tolerances, ``x0`` are ignored).
    backend : {"petsc", "torch"}, optional
        Default ``"petsc"`` when petsc4py imports.
    rtol, atol, maxiter, x0
        As in SciPy: stop when ``||b - A x|| <= max(rtol ||b||, atol)`` (unpreconditioned
        residual; see the backend modules for MINRES with a preconditioner). ``rtol >= 1``
        is allowed; ``b == 0`` returns zeros (0 iterations) whatever ``x0``; there is no
        divergence test (a far-away ``x0`` is fine). ``maxiter`` counts Krylov iterations
        (PETSc's count; for GMRES inner iterations, not restart cycles); ``None`` means
        ``max(10 n, 10000)`` for ``n`` global unknowns on both backends, the larger of
        SciPy's and PETSc's defaults (for GMRES ``max(10 n restart, 10000)``: SciPy counts
        ``10 n`` restart cycles), so no solve either finishes by default is cut short; ``0`` only tests
        the initial guess. With the petsc backend, ``-ksp_rtol``, ``-ksp_atol``,
        ``-ksp_max_it``, ``-ksp_divtol`` in the options database (``petsc_options`` or the
        command line) take precedence, as in PETSc.
        ``x0="previous"`` (warm start, opt-in): start from the solution of the previous
        ``x0="previous"`` solve with the same cached solver (same layout, method, pc,
        options) and the same shape of ``b``, zeros when there is none; the adjoint solve
        of the backward likewise starts from the previous adjoint solution. The stopping
        test is unchanged, so the answer differs from a cold start only within tolerance.
    pc, M
        Preconditioner name (:data:`slasolve.registry.PRECONDITIONERS`: ``none, jacobi,
        bjacobi, ilu, icc, sor, asm, gamg, hypre, lu, cholesky``; the torch backend has
        ``none, jacobi, bjacobi, ilu, icc``) or a callable
        ``z = M(r)`` on owned rows. ``M`` is SciPy's name for the same argument.
    callback : callable(iteration, residual_norm), optional
        Called on every rank after each iteration.
    return_info, raise_on_fail
        Non-convergence raises :class:`ConvergenceError` on every rank unless
        ``raise_on_fail=False``; ``return_info=True`` returns ``(x, SolveInfo)``.
    petsc_options, options_prefix
        Entries for the PETSc options database (``{"ksp_monitor": None}``) under the
        prefix, present only while this solve's KSP is configured (they never reach a
        later call); command-line ``-ksp_*`` / ``-pc_*`` options apply too. A bad entry
        (unknown ``ksp_type``, ...) raises ``ValueError`` on every rank.
    reuse_pc : {"auto", False, True, "lagged", "interpolation"}
        What to keep of the preconditioner when ``A``'s values change between calls (an
        optimisation loop). Whatever the mode, the solve runs on the current values and
        "converged" means the true residual ``||b - A x||`` passes, so reuse changes
        iteration counts and set-up time, never the answer; and a reusing solve that does
        not converge is solved again (same ``x0``) with the preconditioner built from
        scratch before anything is reported or raised (``info.pc_reuse["retried"]``).

        * ``"auto"`` (default): ``"interpolation"`` for ``pc="gamg"`` on the petsc backend
          (PETSc's own default for GAMG, made safe by the rules below), ``False`` otherwise.
        * ``False``: rebuilt whenever the values change (GAMG included:
          prolongators and smoother eigenvalue estimates too).
        * ``True``: kept (PETSc's ``KSPSetReusePreconditioner``) until a call without it.
        * ``"lagged"``: kept while the solves need at most ``LAG_GROWTH`` (1.2) times the
          iterations of the solve right after the last build (the solve after one that
          needed more builds it for its values); a solve that has not converged after
          ``LAG_CAP`` (2) times those iterations is stopped there and redone with the
          preconditioner rebuilt (a stale preconditioner costs at most that many), and
          the next 1, 3, 7, ... (consecutive failures; at most ``LAG_BACKOFF_MAX``, 15)
          solves build without trying the kept one.
        * ``"interpolation"`` (petsc backend, ``pc="gamg"``): GAMG keeps its prolongators
          (``-pc_gamg_reuse_interpolation``) and recomputes the coarse operators and the
          Chebyshev smoothers' eigenvalue estimates for the new values; the prolongators
          are rebuilt under the same ``LAG_GROWTH`` / ``LAG_CAP`` / back-off rules. A KSP
          of its own, never shared with calls in another mode. With other preconditioners
          the preconditioner is rebuilt for new values (as ``False``); on the torch
          backend it is ``False``.

        The adjoint solve of the backward always reuses the forward's set-up (same values:
        nothing is set up again, in every mode; hypre with GMRES/BiCGStab needs ``A^T``
        explicitly and sets up on it). For a reusing call ``info.pc_reuse`` is
        ``{"mode", "rebuilt" (built for this call's values), "retried", "discarded_iterations"
        (of the failed attempt)}``; ``info`` describes the solve whose answer is returned.
    record_history : bool
        Fill ``SolveInfo.residual_history``.
    progress : bool or int
        Print the residual on rank 0 every ``progress`` (default 10) iterations.
    near_nullspace : torch.Tensor, optional
        ``(n_local, m)``: this rank's owned rows of ``m`` vectors spanning the near-nullspace
        of ``A`` (the low-energy modes an algebraic multigrid must reproduce, e.g.
        :func:`slasolve.fem.rigid_body_modes` for elasticity). A hint for the petsc
        backend's smoothed-aggregation AMG (``pc="gamg"``; ``ml`` through ``petsc_options``):
        the vectors are orthonormalised (collectively) and set on the operator for this
        call only (never seen by a later call; a changed ``near_nullspace`` rebuilds the
        preconditioner). Every other preconditioner (``hypre`` included) and the torch
        backend ignore it: the answer is the same, only the iteration count differs.
        Shape, dtype and finiteness are checked on every backend; with GAMG/ML,
        numerically dependent columns raise ``ValueError`` too.

    Returns
    -------
    x : torch.Tensor, the owned rows of the solution (and a SolveInfo with ``return_info``).

    Notes
    -----
    Every argument that must agree across ranks (method, backend, pc, tolerances,
    maxiter, restart, the number of columns of ``b``, whether ``x0`` is given, dtype,
    return_info/raise_on_fail, options) is checked in one reduction; a difference, or a
    bad argument on any rank, raises on every rank. Complex ``A``/``b`` and ``b`` with
    zero columns raise. The result depends only on the arguments and the values ``A``
    holds at call time: cached solvers and PETSc Mats never carry state between calls.
    ``x`` is differentiable once: a backward through the solve with
    ``create_graph=True`` (Hessian-vector products, gradient penalties) raises
    ``RuntimeError`` rather than return second derivatives without the solve's terms.

    Examples
    --------
    >>> import scipy.sparse as sp, torch
    >>> import slasolve
    >>> A_global = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    >>> A = slasolve.DSparseTensor.from_global(A_global)       # given on every rank here
    >>> b = A.scatter(torch.ones(5, dtype=torch.float64), root=None)
    >>> x = slasolve.solve(A, b, "cg", rtol=1e-12)
    >>> A.gather(x, root=None)
    tensor([2.5000, 4.0000, 4.5000, 4.0000, 2.5000], dtype=torch.float64)

    Gradients flow to ``b`` and to the matrix values (one adjoint solve, collective):

    >>> _ = A.values.requires_grad_(), b.requires_grad_()
    >>> x, info = slasolve.solve(A, b, "cg", rtol=1e-12, return_info=True)
    >>> info.converged
    True
    >>> slasolve.global_sum(x.sum()).backward()
    >>> A.gather(b.grad, root=None)          # A^{-T} 1 (A is symmetric: the same x)
    tensor([2.5000, 4.0000, 4.5000, 4.0000, 2.5000], dtype=torch.float64)
    >>> A.values.grad.shape == A.values.shape
    True
    """
    if isinstance(A, SparseTensor) and A.batch_shape:
        return _solve_batched(A, b, method, x0=x0, return_info=return_info, backend=backend, rtol=rtol,
                              atol=atol, maxiter=maxiter, pc=pc, M=M, restart=restart, callback=callback,
                              raise_on_fail=raise_on_fail, petsc_options=petsc_options,
                              options_prefix=options_prefix, record_history=record_history,
                              progress=progress, reuse_pc=reuse_pc, near_nullspace=near_nullspace)
    backend = default_backend() if backend is None else backend
    handler = solve_method(method)   # "direct": slasolve.direct's sparse LU / Cholesky (validates)
    if handler is not None:
        return handler(A, b, backend=backend, pc=M if M is not None else pc, return_info=return_info,
                       petsc_options=petsc_options)
    # stage / event / phase times (slasolve._log): local bookkeeping, no communication
    with _log.stage("slaSolve"), _log.event("slaSolve"), _log.collect() as times:
        with _log.phase("check"):
            dA, settings = _validate(A, b, x0, method=method, backend=backend, pc=pc, M=M, rtol=rtol, atol=atol,
                           maxiter=maxiter, restart=restart, petsc_options=petsc_options,
                           options_prefix=options_prefix, return_info=return_info,
                           raise_on_fail=raise_on_fail, reuse_pc=reuse_pc, near_nullspace=near_nullspace)
        pc = M if M is not None else pc
        # user code raising on some ranks only: every rank leaves the iteration together
        callback = user_code(dA.comm, callback, "callback")
        if callable(pc):
            pc = user_code(dA.comm, pc, "preconditioner")
        if progress:
            callback = _progress_callback(dA.comm, 10 if progress is True else int(progress), callback)
        reuse_pc = resolve_reuse(reuse_pc, backend, pc)
        solver = _solver(dA, settings, pc, petsc_options)
        opts = dict(rtol=float(rtol), atol=float(atol), maxiter=None if maxiter is None else int(maxiter),
                    callback=callback, record_history=record_history, raise_on_fail=raise_on_fail,
                    pc_fn=pc if callable(pc) else None, reuse_pc=reuse_pc, warm=isinstance(x0, str))
        # the iteration limit of this call (maxiter=None: SciPy's or PETSc's default, the larger)
        n_scalar = dA.global_shape[0] * (dA.local.block_shape[0] if dA.local.is_block else 1)
        opts["limit"] = default_maxiter(n_scalar, restart if method == "gmres" else 1) \
            if maxiter is None else int(maxiter)
        opts["maxiter"] = opts["limit"]
        if isinstance(x0, str):
            x0 = None  # the previous solution, looked up in AdjointSolve
        if reuse_pc == "interpolation" and backend == "petsc":  # last resort: the default-mode KSP
            opts["fallback"] = lambda: _solver(dA, settings, pc, petsc_options, **{"reuse interpolation": False})
        if KRYLOV_METHODS[method].symmetric:  # the adjoint of a matrix that turns out nonsymmetric
            opts["transpose_solver"] = lambda: _solver(dA, settings, pc, petsc_options, method="gmres",
                                                       **{"reuse interpolation": False})
        if near_nullspace is not None and backend == "petsc":  # a hint only the petsc backend uses
            opts["near_nullspace"] = near_nullspace
        out: dict = {}
        try:
            if needs_grad(dA.values) or needs_grad(b):
                x = AdjointSolve.apply(dA.values, b, dA, solver, opts, x0, out)
            else:   # no graph to record: the autograd Function's machinery is skipped
                x, _ = forward_solve(b, dA, solver, opts, x0, out)
        finally:
            if "info" in out:
                out["info"].times = times    # "total" is added when the block ends
    info = out["info"]
    info.norm = getattr(solver, "norm", "")
    return (x, info) if return_info else x


def _solve_batched(A, b, method, *, x0, return_info, **kw):
    """One solve per batch entry of a batched (local) SparseTensor; ``b`` is
    ``(*batch, n[, k])``. A loop over matrices, each solve differentiable."""
    nb = len(A.batch_shape)
    if not isinstance(b, torch.Tensor) or tuple(b.shape[:nb]) != tuple(A.batch_shape):
        raise ValueError(f"for a batched matrix b must have shape (*{A.batch_shape}, n[, k]), got "
                         f"{tuple(b.shape) if isinstance(b, torch.Tensor) else type(b).__name__}")
    flat_vals = A.values.reshape((-1,) + tuple(A.values.shape[nb:]))
    flat_b = b.reshape((-1,) + tuple(b.shape[nb:]))
    flat_x0 = None if x0 is None or isinstance(x0, str) else x0.reshape(flat_b.shape)
    base = A[(0,) * nb]
    xs, infos = [], []
    for i in range(flat_b.shape[0]):
        x, info = solve(base.with_values(flat_vals[i]), flat_b[i], method, return_info=True,
                        x0=x0 if isinstance(x0, str) else None if flat_x0 is None else flat_x0[i], **kw)
        xs.append(x)
        infos.append(info)
    x = torch.stack(xs, 0).reshape(b.shape)
    return (x, merge_infos(infos)) if return_info else x


def _method(name: str):
    def fn(A, b: torch.Tensor, *, rtol: float = 1e-5, atol: float = 0.0, maxiter: Optional[int] = None,
           x0: Optional[torch.Tensor] = None, M: Optional[Callable] = None, pc=None,
           callback=None, backend: Optional[str] = None, raise_on_fail: bool = True, **kw
           ) -> Tuple[torch.Tensor, SolveInfo]:
        return solve(A, b, name, rtol=rtol, atol=atol, maxiter=maxiter, x0=x0, M=M, pc=pc,
                     callback=callback, backend=backend, raise_on_fail=raise_on_fail,
                     return_info=True, **kw)
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = (f"Collective. ``x, info = {name}(A, b, ...)``: :func:`solve` with method "
                  f"``\"{name}\"``, SciPy-style, always returning ``(x, SolveInfo)``.")
    return fn


cg = _method("cg")
gmres = _method("gmres")
minres = _method("minres")
bicgstab = _method("bicgstab")
cgs = _method("cgs")
tfqmr = _method("tfqmr")
cg.__doc__ += """

    Examples
    --------
    On one rank, SciPy matrices work directly:

    >>> import numpy as np, scipy.sparse as sp, torch
    >>> from slasolve import cg
    >>> A = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(5, 5), format="csr")
    >>> x, info = cg(A, torch.ones(5, dtype=torch.float64), rtol=1e-10)
    >>> info.converged
    True
    >>> np.allclose(A @ x.numpy(), 1.0)
    True
"""
