"""``nonlinear_solve``: distributed Newton-Krylov with an implicit-function-theorem adjoint.

``u = nonlinear_solve(residual, u0, *params)`` solves ``residual(u, *params) = 0`` and is
differentiable with respect to every tensor in ``params`` that requires grad: the backward
solves ``J(u)^T lam = g`` once (``J = dF/du`` at the solution) and returns
``-(dF/dparams)^T lam`` from one residual evaluation with autograd at the solution. The
Newton iterations are never differentiated.
"""
from __future__ import annotations

import dataclasses
import time
from numbers import Integral, Real
from typing import Callable, Optional, Tuple, Union

import torch

from .. import _log
from .._comm import allreduce_sum, check_collective, get_comm, options_key, user_code
from ..settings import Settings, SettingsSchema
from ..autograd import AdjointFunction
from ..registry import KRYLOV_METHODS, default_backend
from .info import NonlinearConvergenceError, NonlinearInfo
from .problem import Problem
from ..dtensor import dtensor_entry

__all__ = ["nonlinear_solve"]


#: the settings of one nonlinear solve: the keyed ones (with the options database entries SNES
#: reads) select the kept SNES, all must agree across ranks
NONLINEAR_SETTINGS = SettingsSchema(
    keyed=("rtol", "atol", "stol", "maxiter", "line_search", "linear_solver", "options_prefix", "petsc_options",
           "options database", "objective given"),
    agreed=("method", "backend", "jacobian given", "return_info", "raise_on_fail", "progress", "callback given",
            "dtype", "number of params", "params requiring grad", "u0 requires grad",
            "problem's NumPy kernels"))

_METHODS = ("newton", "newtonls")
_LINE_SEARCHES = ("bt", "basic")
_LINEAR_KEYS = ("method", "pc", "rtol", "atol", "maxiter", "restart", "near_nullspace", "block_size")
_LINEAR_METHODS = tuple(KRYLOV_METHODS) + ("direct",)


_SNES_MODULE = [None]


def _snes_module():
    """Local. :mod:`slasolve.nonlinear.petsc_snes`, imported at its first use (it needs petsc4py:
    ImportError without it) and kept (a relative import per call runs importlib's Python code)."""
    mod = _SNES_MODULE[0]
    if mod is None:
        from . import petsc_snes as mod
        _SNES_MODULE[0] = mod
    return mod


def _is_dsparse(p) -> bool:
    from ..dsparse import DSparseTensor
    return isinstance(p, DSparseTensor)


def _is_real(v) -> bool:
    # the exact builtin types first: the ABC isinstance test costs a microsecond
    return type(v) is float or type(v) is int or (isinstance(v, Real) and not isinstance(v, bool))


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, Integral) and not isinstance(v, bool))


def _check(residual, u0, jacobian, method, backend, rtol, atol, stol, maxiter, linear_solver,
           line_search, petsc_options, options_prefix, callback, objective=None):
    """Local. The first problem with the arguments, or None."""
    if not callable(residual):
        return TypeError(f"residual must be callable, got {type(residual).__name__}")
    if objective is not None and not callable(objective):
        return TypeError(f"objective must be callable or None, got {type(objective).__name__}")
    if jacobian is not None and not callable(jacobian):
        return TypeError(f"jacobian must be callable or None, got {type(jacobian).__name__}")
    if callback is not None and not callable(callback):
        return TypeError(f"callback must be callable or None, got {type(callback).__name__}")
    if not isinstance(u0, torch.Tensor):
        return TypeError(f"u0 must be a torch.Tensor of this rank's owned rows, got {type(u0).__name__}")
    if u0.dim() != 1:
        return ValueError(f"u0 must be 1-D (this rank's owned rows), got shape {tuple(u0.shape)}")
    if u0.dtype not in (torch.float32, torch.float64):
        return TypeError(f"u0 must be float32 or float64, got {u0.dtype}")
    if method not in _METHODS:
        return ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if backend not in ("petsc", "torch"):
        return ValueError(f"backend must be 'petsc' or 'torch', got {backend!r}")
    if line_search not in _LINE_SEARCHES:
        return ValueError(f"line_search must be one of {_LINE_SEARCHES}, got {line_search!r}")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not _is_real(v):
            return TypeError(f"{name} must be a real number, got {type(v).__name__}")
        if not float(v) >= 0:
            return ValueError(f"{name} must be >= 0, got {v}")
    if stol is not None and (not _is_real(stol) or not float(stol) >= 0):
        return ValueError(f"stol must be None or a number >= 0, got {stol!r}")
    if not _is_int(maxiter) or maxiter < 0:
        return ValueError(f"maxiter must be an int >= 0, got {maxiter!r}")
    if not isinstance(linear_solver, dict):
        return TypeError(f"linear_solver must be a dict of slasolve.solve arguments or None, got "
                         f"{type(linear_solver).__name__}")
    bad = sorted(set(linear_solver) - set(_LINEAR_KEYS))
    if bad:
        return ValueError(f"linear_solver: unknown entries {bad}; allowed: {list(_LINEAR_KEYS)}")
    lm = linear_solver.get("method", "gmres")
    if lm not in _LINEAR_METHODS:
        return ValueError(f"linear_solver method must be one of {_LINEAR_METHODS}, got {lm!r}")
    if jacobian is None and (lm != "gmres" or linear_solver.get("pc") not in (None, "none")):
        return ValueError("without a jacobian the inner solve is matrix-free GMRES without a "
                          f"preconditioner; got linear_solver={linear_solver!r}")
    if "near_nullspace" in linear_solver:
        if jacobian is None or lm == "direct":
            return ValueError("linear_solver near_nullspace is a preconditioner hint for the Krylov solves "
                              "with a jacobian (not matrix-free, not method='direct')")
        from ..krylov.solve import near_nullspace_error
        err = near_nullspace_error(int(u0.shape[0]), linear_solver["near_nullspace"])
        if err is not None:
            return type(err)(f"linear_solver {err}")
    if "block_size" in linear_solver:
        bs = linear_solver["block_size"]
        if not _is_int(bs) or bs < 1:
            return ValueError(f"linear_solver block_size must be an int >= 1, got {bs!r}")
        if int(u0.shape[0]) % int(bs):
            return ValueError(f"linear_solver block_size {bs} does not divide this rank's {int(u0.shape[0])} "
                              "owned rows (every rank must own whole blocks)")
    if petsc_options is not None and not isinstance(petsc_options, dict):
        return TypeError(f"petsc_options must be a dict or None, got {type(petsc_options).__name__}")
    if backend == "torch" and (petsc_options or options_prefix):
        return ValueError("petsc_options / options_prefix need backend='petsc'")
    return None


def _grad_leaves(params):
    """Local. ``params`` with every DSparseTensor replaced by its values tensor (what autograd
    sees as the input), and a function putting such tensors back into DSparseTensors."""
    from ..dsparse import DSparseTensor
    flat = tuple(p.values if isinstance(p, DSparseTensor) else p for p in params)

    def rebuild(tensors):
        return tuple(p.with_values(t) if isinstance(p, DSparseTensor) else t
                     for p, t in zip(params, tensors))
    return flat, rebuild


def _nested_grad_error(params):
    """Local. A TypeError when a tensor that requires grad hides inside a list/tuple/dict param
    (it would silently get no gradient), else None."""
    for i, p in enumerate(params):
        items = p.values() if isinstance(p, dict) else (p if isinstance(p, (list, tuple)) else ())
        if any(isinstance(q, torch.Tensor) and q.requires_grad for q in items):
            return TypeError(f"params[{i}] is a {type(p).__name__} holding tensors that require grad; "
                             "pass such tensors as separate params (only direct tensor / DSparseTensor "
                             "params get gradients)")
    return None


class _ImplicitFunction(AdjointFunction):
    """``u*(params)`` defined by ``F(u*, params) = 0``; backward by the implicit function theorem.
    ``params`` arrive flattened (DSparseTensors as their values tensors)."""

    @staticmethod
    def forward(ctx, u_star, ctl, *params):
        ctx.ctl = ctl
        ctx.params = params
        # the tensor params saved too: changed in place before the backward they raise
        ctx.save_for_backward(u_star, *(p for p in params if isinstance(p, torch.Tensor)))
        return u_star.clone()

    name = "slasolve.nonlinear_solve"

    @staticmethod
    def comm(ctx):
        return ctx.ctl["comm"]

    @staticmethod
    def adjoint(ctx, saved, g):
        ctl = ctx.ctl
        u = saved[0]
        if ctl["failed"] is not None:  # the same on every rank (decided from global norms)
            raise RuntimeError(f"nonlinear_solve did not converge ({ctl['failed']}): the implicit-function "
                               "gradient of its result is undefined (raise_on_fail=False returned it)")
        lam = _adjoint_solve(ctl, u, g.contiguous())
        want = [i for i, p in enumerate(ctx.params) if isinstance(p, torch.Tensor) and ctx.needs_input_grad[2 + i]]
        with torch.enable_grad():
            ps = list(ctx.params)
            for i in want:
                ps[i] = ctx.params[i].detach().requires_grad_(True)
            leaves = [ps[i] for i in want]
            # every rank evaluates and differentiates the residual (it may exchange ghosts)
            r = ctl["residual"](u.detach(), *ctl["rebuild"](ps))
            grads = torch.autograd.grad(r, leaves, lam, allow_unused=True) if want else ()
        out = [None] * len(ctx.params)
        for i, gi in zip(want, grads):
            out[i] = None if gi is None else -gi
        return (None, None, *out)


def _adjoint_solve(ctl, u, g):
    """Collective. ``lam`` with ``J(u)^T lam = g``."""
    ls = dict(ctl["linear_solver"])
    ls.pop("block_size", None)   # the SNES's Mat only: slasolve.solve takes no such argument
    # a loose inner tolerance suits Newton steps, not gradients: at most 1e-10 (float32 1e-5)
    tight = 1e-10 if u.dtype == torch.float64 else 1e-5
    ls["rtol"] = min(float(ls.get("rtol", tight)), tight)
    params = tuple(p.detach() if isinstance(p, torch.Tensor) or _is_dsparse(p) else p for p in ctl["params"])
    if ctl["jacobian"] is not None:
        from ..krylov.solve import solve
        with torch.no_grad():
            J = ctl["jacobian"](u.detach(), *params).detach()
        if ctl.get("kept") is not None:
            # the Newton solve's own KSP and preconditioner on the tangent at the solution (GAMG
            # keeps its prolongators), as DOLFINx's hand adjoints; None (every rank alike): from scratch
            from .petsc_snes import adjoint_solve_kept
            lam = adjoint_solve_kept(ctl["kept"], ctl["comm"], J, g, ls["rtol"], float(ls.get("atol", 0.0)),
                                     ls.get("maxiter"))
            if lam is not None:
                return lam
        # lam = J^{-T} g is the adjoint of x = J^{-1} b at b = 0 (which costs nothing: b == 0
        # returns x = 0 at once): slasolve.solve's own transpose solve, same method and pc
        method = ls.pop("method", "gmres")
        with torch.enable_grad():
            b = torch.zeros_like(u).requires_grad_(True)
            x = solve(J, b, method, backend=ctl["backend"], **ls)
            (lam,) = torch.autograd.grad(x, b, g)
        return lam
    # matrix-free: J^T w by one vjp through a residual graph built once at u (exact)
    from ..krylov.info import ConvergenceError
    from ..krylov.torch_methods import default_maxiter, gmres
    comm = ctl["comm"]
    with torch.enable_grad():
        uu = u.detach().requires_grad_(True)
        r = ctl["residual"](uu, *params)

        def rmatvec(w):
            (v,) = torch.autograd.grad(r, uu, w, retain_graph=True)
            return v
        n_global = int(allreduce_sum(comm, torch.tensor([u.numel()], dtype=torch.float64))[0])
        maxiter = ls.get("maxiter")
        lam, info = gmres(rmatvec, g.detach(), rtol=float(ls["rtol"]), atol=float(ls.get("atol", 0.0)),
                          maxiter=default_maxiter(n_global) if maxiter is None else int(maxiter),
                          restart=int(ls.get("restart", 30)), reduce_sum=lambda t: allreduce_sum(comm, t))
    if not info.converged:
        raise ConvergenceError(info, f"adjoint solve in backward of nonlinear_solve (matrix-free GMRES) did "
                               f"not converge: {info.reason} after {info.iterations} iterations")
    return lam.detach()


def _newton(prob, u0, backend, settings, petsc_options, options_prefix, kw, checked=False):
    """Collective. One Newton run of ``prob`` from ``u0`` on ``backend``: ``(u, NonlinearInfo, kept)``
    (``kept``: the kept SNES for the backward, see :func:`~slasolve.nonlinear.petsc_snes.adjoint_solve_kept`;
    None on the torch backend). ``checked``: ``prob.start_error(u0)`` said the kernels apply and its
    error passed the caller's collective check on every rank."""
    if backend == "petsc":
        snes_solve = _snes_module().snes_solve
        # checked (shape, dtype) on every rank, collectively with the Jacobian at u0 (a deferred check)
        u0 = u0.detach()   # one tensor for F(u0) and J(u0): the latter's input checks are the former's
        # a slasolve.fem problem's own methods: SNES evaluates by its kernels from u0 on, after one input check
        start = prob.start_kernels(u0, checked=checked) if kw["use_jacobian"] else None
        if start is not None:
            return snes_solve(prob, u0, petsc_options=petsc_options, options_prefix=options_prefix,
                              start=start, settings=settings, **kw)
        r0, r0_error = prob.residual_local(u0)
        return snes_solve(prob, u0, petsc_options=petsc_options, options_prefix=options_prefix, r0=r0,
                          r0_error=r0_error, settings=settings, **kw)
    from .torch_newton import newton
    return (*newton(prob, u0, r0=prob.residual(u0.detach()), **kw), None)  # checked collectively


def _without_objective(prob, u, info, kept, backend, settings, petsc_options, options_prefix, kw):
    """Collective. Continue a run whose line search on the objective failed from its last iterate
    ``u`` with the line search on ``||F||`` and what is left of the budget, toward the first
    run's tolerance ``max(rtol ||F(u0)||, atol)``: ``(u, info, kept)`` of both runs together
    (``kept``: the last run's).

    Near a solution the objective's decrease along a Newton step (about ``||F|| ||du||``) falls
    below the rounding of its value (a few ulp of a sum over every cell), so a backtracking test
    on it rejects every step of a run that ``||F||`` shows converging (PETSc's ``bt`` on a
    neo-Hookean energy at ``||F|| ~ 1e-12``); the residual norm stays informative there."""
    left = kw["maxiter"] - info.iterations
    if left <= 0:
        return u, info, kept
    target = max(kw["rtol"] * info.residual_history[0], kw["atol"])
    plain = prob.without_objective()
    values = dict(settings.values, rtol=repr(0.0), atol=repr(target), maxiter=repr(left))
    values["objective given"] = False
    more_kw = dict(kw, rtol=0.0, atol=target, maxiter=left)
    u2, more, kept = _newton(plain, u.detach(), backend, Settings(values, settings.keyed), petsc_options,
                             options_prefix, more_kw)
    prob.nfev, prob.njev = plain.nfev, plain.njev
    reason = more.reason
    if reason == "CONVERGED_FNORM_ABS" and not kw["atol"] >= more.residual_norm:
        reason = "CONVERGED_FNORM_RELATIVE"   # the first run's relative test is what was met
    merged = dataclasses.replace(
        more, reason=reason, iterations=info.iterations + more.iterations,
        residual_history=list(info.residual_history) + list(more.residual_history[1:]),
        linear_iterations=info.linear_iterations + more.linear_iterations,
        linear_iterations_per_step=list(info.linear_iterations_per_step) + list(more.linear_iterations_per_step),
        line_search=f"{info.line_search} on the objective, then on ||F||", rtol=info.rtol, atol=info.atol,
        setup_time=info.setup_time + more.setup_time, solve_time=info.solve_time + more.solve_time)
    return u2, merged, kept


@_log.logged("slaNonlinear", "slaNonlinear")
@dtensor_entry("nonlinear_solve")
def nonlinear_solve(residual: Callable, u0: torch.Tensor, *params, jacobian: Optional[Callable] = None,
                    method: str = "newton", backend: Optional[str] = None, rtol: float = 1e-8,
                    atol: float = 0.0, stol: Optional[float] = None, maxiter: int = 50,
                    linear_solver: Optional[dict] = None, line_search: str = "bt",
                    return_info: bool = False, raise_on_fail: bool = True,
                    progress: bool = False, callback: Optional[Callable[[int, float], None]] = None,
                    petsc_options: Optional[dict] = None, options_prefix: Optional[str] = None,
                    comm=None, objective: Optional[Callable] = None
                    ) -> Union[torch.Tensor, Tuple[torch.Tensor, NonlinearInfo]]:
    """Collective. Solve ``residual(u, *params) = 0`` by Newton's method; differentiable (IFT).

    Parameters
    ----------
    residual : callable ``(u, *params) -> r``
        ``u``: this rank's owned rows ``(n_local,)``; ``r``: the owned rows of the residual,
        same shape and dtype, computed with torch operations (differentiable in ``params``
        for the adjoint). It may communicate (ghost exchange, e.g. an ``Assembler``'s
        ``fetch_ghosts`` or a ``DSparseTensor`` product): the solver calls it collectively,
        the same number of times in the same order on every rank.
    u0 : torch.Tensor
        Initial guess, owned rows, float64 or float32. Gets no gradient.
    *params
        Passed to ``residual`` / ``jacobian``. Tensors and DSparseTensors (their values)
        that require grad get gradients; tensors captured by the functions' closures or
        nested in lists/dicts do not (a list/tuple/dict param holding a tensor that requires
        grad raises TypeError). Gradients are this rank's share: a tensor used identically
        on every rank, e.g. a replicated scalar, gets the contribution of this rank's
        residual rows; sum over ranks, as :func:`slasolve.testing.local_slice` does.
    jacobian : callable ``(u, *params) -> DSparseTensor``, optional
        ``dF/du`` as a square row-shard DSparseTensor whose owned rows and columns match
        ``u``, the same sparsity pattern at every call. ``None``: Jacobian-free
        Newton-Krylov (finite-difference ``J v``, GMRES without preconditioner; the
        adjoint uses exact ``J^T w`` products by autograd through one residual evaluation).
    method : {"newton"}
        Newton with a line search (PETSc's ``newtonls``; ``"newtonls"`` is accepted too).
    backend : {"petsc", "torch"}, optional
        ``"petsc"``: PETSc SNES (default when petsc4py imports); ``"torch"``: native Newton
        whose inner solves are ``slasolve.solve(J, -F, backend="torch", **linear_solver)``.
    rtol, atol, maxiter
        Stop when ``||F(u)|| <= max(rtol ||F(u0)||, atol)`` (global 2-norms); ``maxiter``
        Newton steps at most (``DIVERGED_MAX_IT``).
    stol : float, optional
        Also stop when the Newton step ``||du|| <= stol ||u||`` (``CONVERGED_SNORM_RELATIVE``,
        a step test: the residual test need not pass). Default: no step test.
    linear_solver : dict, optional
        ``slasolve.solve`` arguments for the inner solves and the adjoint solve: ``method``
        (``cg, gmres, minres, bicgstab, direct``; default ``"gmres"``), ``pc``, ``rtol``
        (fixed relative inner tolerance, default ``1e-10`` for float64, ``1e-5`` float32;
        matrix-free ``1e-5`` / ``1e-3``; the adjoint solve uses at most ``1e-10`` / ``1e-5``),
        ``atol``, ``maxiter``, ``restart``, ``near_nullspace`` (``(n_local, m)``, as in
        :func:`slasolve.solve`: e.g. :func:`slasolve.fem.rigid_body_modes` for GAMG on
        elasticity; set on the kept SNES's Jacobian, which is rebuilt when the values change on
        any rank), ``block_size`` (default 1: dofs per node, dividing every rank's owned rows; the petsc
        backend's Jacobian Mat and vectors get it, as DOLFINx gives a vector space's, e.g.
        ``block_size=P.block_size`` for a :mod:`slasolve.fem` problem; the torch backend ignores
        it. GAMG with the rigid-body near-nullspace builds nearly the same hierarchy either way
        and ran 1.0-1.3x slower per solve with it on neo-Hookean solids, hence not the default).
        A failed inner solve stops Newton (``DIVERGED_LINEAR_SOLVE``).
    line_search : {"bt", "basic"}
        Backtracking (Armijo, quadratic interpolation) or full Newton steps.
    objective : callable ``(u, *params) -> scalar``, optional
        For a residual that is the gradient of an energy (a hyperelastic solid:
        ``objective=P.energy``): the backtracking line search's merit function instead of
        ``||F||^2 / 2`` (PETSc's ``SNESSetObjective``), so a full Newton step that lowers the
        energy is taken even where it raises ``||F||`` (on a neo-Hookean solid, ``||F||``
        backtracking took 6-17 Newton steps where the energy took 4-5). Collective: every rank
        returns the global value (e.g. through :func:`slasolve.global_sum`); ``inf`` / NaN makes
        the line search backtrack. Convergence is still decided by ``||F||``. Near a
        solution the energy's decrease along a Newton step falls below the rounding of its
        value; when the line search on it fails (``DIVERGED_LINE_SEARCH``), the solve continues
        from that iterate with the line search on ``||F||`` toward the same tolerance, within
        the remaining ``maxiter`` (``info.line_search`` then says so).
    return_info, raise_on_fail
        Non-convergence raises :class:`NonlinearConvergenceError` (a
        :class:`slasolve.ConvergenceError`) on every rank unless ``raise_on_fail=False``;
        ``return_info=True`` returns ``(u, NonlinearInfo)``.
    progress : bool
        Print the residual norm on rank 0 after every Newton step.
    callback : callable ``(iteration, residual_norm)``, optional
        Called on every rank after each Newton step.
    petsc_options, options_prefix
        PETSc backend: options database entries (``{"snes_monitor": None}``) present only
        while the SNES is configured; command-line ``-snes_*``, ``-ksp_*``, ``-pc_*`` apply
        too and take precedence over the keyword arguments, as in PETSc.
    comm : MPI.Comm, optional
        Default ``MPI.COMM_WORLD``.

    Returns
    -------
    u : torch.Tensor, this rank's owned rows of the solution (and a NonlinearInfo).

    Notes
    -----
    Every setting is checked on every rank and compared across ranks in one reduction
    before anything else is communicated; a bad argument or a difference raises on every
    rank. ``"converged"`` always means ``||F(u)||`` of the returned ``u`` passes the
    residual test (or, with ``stol``, the step test). The backward of ``u`` solves
    ``J(u)^T lam = g`` with ``slasolve.solve``'s adjoint (same method and preconditioner;
    a failure raises ``ConvergenceError`` on every rank) and evaluates ``residual`` once
    with autograd: it is collective, like the forward. Differentiable once
    (``create_graph=True`` raises ``RuntimeError``; so does a backward through a result that
    did not converge, returned with ``raise_on_fail=False``). The adjoint is exactly as right
    as ``jacobian``: give the exact derivative of ``residual`` (an approximate Jacobian still
    lets Newton converge, more slowly, but gives wrong gradients; ``jacobian=None`` does not).

    On the petsc backend with a ``jacobian``, the SNES (its KSP, preconditioner, vectors and
    Jacobian Mat) is kept on the Jacobian's layout for these settings and the options database
    entries it reads, and a later call with the same ones reuses it: GAMG then keeps its
    prolongators from one call's last tangent to the next call's first, as DOLFINx's
    ``NewtonSolver`` does (a linear solve that fails with them is redone with GAMG rebuilt).
    """
    t0 = time.perf_counter()
    backend = default_backend() if backend is None else backend
    linear_solver = {} if linear_solver is None else linear_solver
    err = None
    try:
        comm = get_comm(comm)
    except TypeError as e:
        from mpi4py import MPI
        comm, err = MPI.COMM_WORLD, e
    err = err or _check(residual, u0, jacobian, method, backend, rtol, atol, stol, maxiter, linear_solver,
                        line_search, petsc_options, options_prefix, callback, objective) \
        or _nested_grad_error(params)
    dparams = tuple(p.detach() if isinstance(p, torch.Tensor) or _is_dsparse(p) else p for p in params)
    prob, kernels = None, None
    if err is None:
        prob = Problem(residual, jacobian, dparams, comm, int(u0.shape[0]), u0.dtype, objective=objective)
        if backend == "petsc" and jacobian is not None:
            # a slasolve.fem problem's check of u0 and the parameters before its kernels evaluate at
            # u0 rides on this call's one reduction (whether they apply: a setting that must agree)
            kernels, err = prob.start_error(u0)
    database = None
    if backend == "petsc" and err is None:
        try:  # the kept SNES is keyed on them: every rank must read the same
            database = _snes_module().database_key(options_prefix)
        except ImportError:   # raised by the solve below, on every rank
            pass
    settings = NONLINEAR_SETTINGS.bind(
        rtol=repr(rtol), atol=repr(atol), stol=repr(stol), maxiter=repr(maxiter), line_search=line_search,
        linear_solver=options_key(linear_solver), options_prefix=options_prefix,
        petsc_options=options_key(petsc_options), method=method, backend=backend,
        return_info=bool(return_info), raise_on_fail=bool(raise_on_fail), progress=bool(progress),
        dtype=str(u0.dtype) if isinstance(u0, torch.Tensor) else None,
        **{"options database": database, "jacobian given": jacobian is not None,
           "objective given": objective is not None, "problem's NumPy kernels": kernels,
           "callback given": callback is not None, "number of params": len(params),
           # a graph on some ranks only would leave those ranks alone in the backward's adjoint
           "params requiring grad": [i for i, p in enumerate(params) if torch.is_grad_enabled() and (
               (isinstance(p, torch.Tensor) and p.requires_grad) or (_is_dsparse(p) and p.values.requires_grad))],
           "u0 requires grad": isinstance(u0, torch.Tensor) and u0.requires_grad and torch.is_grad_enabled()})
    check_collective(comm, err, agree=settings.agree())
    rtol, atol = float(rtol), float(atol)
    stol = None if stol is None else float(stol)
    callback = user_code(comm, callback, "callback")   # a raise on one rank ends the solve everywhere
    kw = dict(rtol=rtol, atol=atol, stol=stol, maxiter=int(maxiter), line_search=line_search,
              linear_solver=linear_solver, use_jacobian=jacobian is not None, callback=callback,
              progress=progress)
    u, info, kept = _newton(prob, u0, backend, settings, petsc_options, options_prefix, kw, checked=bool(kernels))
    if info.reason == "DIVERGED_LINE_SEARCH" and objective is not None:
        u, info, kept = _without_objective(prob, u, info, kept, backend, settings, petsc_options, options_prefix, kw)
    info.function_evaluations, info.jacobian_evaluations = prob.nfev, prob.njev
    if info.setup_time == 0.0:
        info.solve_time = time.perf_counter() - t0
    if raise_on_fail and not info.converged:
        raise NonlinearConvergenceError(info)
    if settings.values["params requiring grad"]:   # decided at entry (with grad mode on), agreed
        flat, rebuild = _grad_leaves(params)
        ctl = {"residual": user_code(comm, residual, "residual"), "jacobian": user_code(comm, jacobian, "jacobian"), "params": params, "linear_solver": linear_solver,
               "backend": backend, "comm": comm, "rebuild": rebuild, "kept": kept,
               "failed": None if info.converged else info.reason}
        u = _ImplicitFunction.apply(u.detach(), ctl, *flat)
    return (u, info) if return_info else u
