"""``solve``, ``cg``, ``gmres``, ``minres``, ``bicgstab``: differentiable distributed Krylov solves.

``x = solve(A, b)`` is differentiable with respect to ``b`` and ``A``'s values by
the adjoint method: the backward solves ``A^T lam = dL/dx`` with the same
solver (and preconditioner), then ``dL/db = lam`` and
``dL/dvalues[k] = -lam[row_k] x[col_k]`` on the stored nonzeros only.
"""
from __future__ import annotations

from typing import Callable, Optional, Tuple, Union

import torch

from .._comm import check_collective
from ..autograd import matvec_value_grad
from .info import ConvergenceError, SolveInfo
from ..sparse import SparseTensor
from .operator import as_row_shard

__all__ = ["solve", "cg", "gmres", "minres", "bicgstab", "default_backend"]

_METHODS = ("cg", "gmres", "minres", "bicgstab")


def default_backend() -> str:
    """Local. ``"petsc"`` when petsc4py imports, else ``"torch"``."""
    try:
        import petsc4py  # noqa: F401
        from petsc4py import PETSc  # noqa: F401
        return "petsc"
    except ImportError:
        return "torch"


def _solver(dA, method, backend, pc, restart, options_prefix, petsc_options):
    L = dA._layout
    cache = L.__dict__.setdefault("solver_cache", {})
    opts_key = tuple(sorted((str(k), str(v)) for k, v in (petsc_options or {}).items()))
    key = (backend, method, pc if isinstance(pc, (str, type(None))) else id(pc), restart,
           options_prefix, opts_key)
    if key not in cache:
        err, solver = None, None
        try:
            if backend == "petsc":
                from .petsc_backend import PetscKrylov
                solver = PetscKrylov(dA, method, pc, restart=restart, options_prefix=options_prefix,
                                     petsc_options=petsc_options)
            else:
                from .torch_backend import TorchKrylov
                solver = TorchKrylov(dA, method, pc, restart=restart)
        except (ValueError, TypeError, ImportError) as e:
            err = e
        check_collective(dA.comm, err)
        cache[key] = solver
    return cache[key]


def _raise_if_failed(info: SolveInfo, raise_on_fail: bool, what: str = "") -> None:
    # info is identical on every rank (decided from reduced scalars / PETSc's
    # global reason), so every rank raises together
    if raise_on_fail and not info.converged:
        raise ConvergenceError(info, None if not what else
                               f"{what}: {info.method} did not converge: {info.reason} after "
                               f"{info.iterations} iterations, residual norm {info.residual_norm:.3e}")


def _merge(infos):
    if len(infos) == 1:
        return infos[0]
    worst = next((i for i in infos if not i.converged), infos[-1])
    out = SolveInfo(converged=all(i.converged for i in infos), reason=worst.reason,
                    iterations=max(i.iterations for i in infos),
                    residual_norm=max(i.residual_norm for i in infos),
                    setup_time=sum(i.setup_time for i in infos), solve_time=sum(i.solve_time for i in infos),
                    method=worst.method, backend=worst.backend, rtol=worst.rtol, atol=worst.atol)
    out.per_rhs = infos
    return out


def _columns(solve_one, b, x0):
    """Solve column by column for ``b`` of shape ``(n, k)``."""
    if b.dim() == 1:
        return solve_one(b, x0)
    xs, infos = [], []
    for j in range(b.shape[1]):
        x, info = solve_one(b[:, j].contiguous(), None if x0 is None else x0[:, j].contiguous())
        xs.append(x)
        infos.append(info)
    return torch.stack(xs, 1), _merge(infos)


class _AdjointSolve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, b, dA, solver, opts, x0, out):
        kw = {k: v for k, v in opts.items() if k != "raise_on_fail"}
        x, info = _columns(lambda bj, x0j: solver.solve(dA, bj, x0j, **kw), b, x0)
        out["info"] = info
        _raise_if_failed(info, opts["raise_on_fail"])
        ctx.dA, ctx.solver, ctx.opts = dA, solver, opts
        ctx.save_for_backward(x)
        return x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        kw = {k: v for k, v in ctx.opts.items() if k != "raise_on_fail"}
        kw.update(callback=None, record_history=False)
        lam, info = _columns(lambda gj, _: ctx.solver.solve_transpose(ctx.dA, gj.contiguous(), **kw),
                             g.contiguous(), None)
        _raise_if_failed(info, True, "adjoint solve in backward")
        gb = lam if ctx.needs_input_grad[1] else None
        gv = matvec_value_grad(ctx.dA, -lam, x) if ctx.needs_input_grad[0] else None
        return gv, gb, None, None, None, None, None


def _validate_rhs(dA, b, x0):
    err = None
    n = dA.n_local
    if not isinstance(b, torch.Tensor):
        err = TypeError(f"b must be a torch.Tensor of this rank's owned rows, got {type(b).__name__}")
    elif b.dim() not in (1, 2) or b.shape[0] != n:
        err = ValueError(f"b must have shape ({n},) or ({n}, k) (this rank's owned rows), "
                         f"got {tuple(b.shape)}")
    elif b.dtype != dA.dtype:
        err = TypeError(f"b has dtype {b.dtype}, the matrix {dA.dtype}")
    elif x0 is not None and (not isinstance(x0, torch.Tensor) or x0.shape != b.shape):
        err = ValueError(f"x0 must be a tensor shaped like b {tuple(b.shape)}, got "
                         f"{tuple(x0.shape) if isinstance(x0, torch.Tensor) else type(x0).__name__}")
    check_collective(dA.comm, err)


def _progress_callback(comm, every: int, user_cb):
    def cb(it, rnorm):
        if comm.Get_rank() == 0 and it % every == 0:
            print(f"  iteration {it:6d}  residual {rnorm:.3e}", flush=True)
        if user_cb is not None:
            user_cb(it, rnorm)
    return cb


def solve(A, b: torch.Tensor, method: str = "cg", *, backend: Optional[str] = None, rtol: float = 1e-5,
          atol: float = 0.0, maxiter: Optional[int] = None, x0: Optional[torch.Tensor] = None,
          pc: Union[str, Callable, None] = None, M: Optional[Callable] = None, restart: int = 30,
          callback: Optional[Callable[[int, float], None]] = None, return_info: bool = False,
          raise_on_fail: bool = True, petsc_options: Optional[dict] = None,
          options_prefix: Optional[str] = None, record_history: bool = False,
          progress: Union[bool, int] = False) -> Union[torch.Tensor, Tuple[torch.Tensor, SolveInfo]]:
    """Collective. Solve ``A x = b`` with a Krylov method; differentiable (adjoint).

    Parameters
    ----------
    A : DSparseTensor (row shard), SparseTensor, scipy.sparse matrix or torch sparse tensor
        The last three are single-rank operators.
    b : torch.Tensor
        This rank's owned rows, ``(n_local,)`` or ``(n_local, k)``.
    method : {"cg", "gmres", "minres", "bicgstab"}
    backend : {"petsc", "torch"}, optional
        Default ``"petsc"`` when petsc4py imports.
    rtol, atol, maxiter, x0
        As in SciPy: stop when ``||b - A x|| <= max(rtol ||b||, atol)`` (unpreconditioned
        residual; see the backend modules for MINRES with a preconditioner).
    pc, M
        Preconditioner name (``none, jacobi, bjacobi, ilu, icc, asm, gamg, hypre, lu,
        cholesky``; the torch backend has ``none, jacobi, bjacobi, ilu, icc``) or a callable
        ``z = M(r)`` on owned rows. ``M`` is SciPy's name for the same argument.
    callback : callable(iteration, residual_norm), optional
        Called on every rank after each iteration.
    return_info, raise_on_fail
        Non-convergence raises :class:`ConvergenceError` on every rank unless
        ``raise_on_fail=False``; ``return_info=True`` returns ``(x, SolveInfo)``.
    petsc_options, options_prefix
        Entries for the PETSc options database (``{"ksp_monitor": None}``) under the
        prefix; command-line ``-ksp_*`` / ``-pc_*`` options apply too.
    record_history : bool
        Fill ``SolveInfo.residual_history``.
    progress : bool or int
        Print the residual on rank 0 every ``progress`` (default 10) iterations.

    Returns
    -------
    x : torch.Tensor, the owned rows of the solution (and a SolveInfo with ``return_info``).
    """
    if isinstance(A, SparseTensor) and A.batch_shape:
        return _solve_batched(A, b, method, x0=x0, return_info=return_info, backend=backend, rtol=rtol,
                              atol=atol, maxiter=maxiter, pc=pc, M=M, restart=restart, callback=callback,
                              raise_on_fail=raise_on_fail, petsc_options=petsc_options,
                              options_prefix=options_prefix, record_history=record_history,
                              progress=progress)
    dA = as_row_shard(A)
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if M is not None and pc is not None:
        raise ValueError("give the preconditioner as pc or as M, not both")
    pc = M if M is not None else pc
    backend = default_backend() if backend is None else backend
    if backend not in ("petsc", "torch"):
        raise ValueError(f"backend must be 'petsc' or 'torch', got {backend!r}")
    _validate_rhs(dA, b, x0)
    if progress:
        callback = _progress_callback(dA.comm, 10 if progress is True else int(progress), callback)
    solver = _solver(dA, method, backend, pc, restart, options_prefix, petsc_options)
    opts = dict(rtol=float(rtol), atol=float(atol), maxiter=maxiter, callback=callback,
                record_history=record_history, raise_on_fail=raise_on_fail)
    out: dict = {}
    x = _AdjointSolve.apply(dA.values, b, dA, solver, opts, x0, out)
    info = out["info"]
    if hasattr(solver, "norm"):
        info.norm = solver.norm
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
    flat_x0 = None if x0 is None else x0.reshape(flat_b.shape)
    base = A[(0,) * nb]
    xs, infos = [], []
    for i in range(flat_b.shape[0]):
        x, info = solve(base.with_values(flat_vals[i]), flat_b[i], method, return_info=True,
                        x0=None if flat_x0 is None else flat_x0[i], **kw)
        xs.append(x)
        infos.append(info)
    x = torch.stack(xs, 0).reshape(b.shape)
    return (x, _merge(infos)) if return_info else x


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
