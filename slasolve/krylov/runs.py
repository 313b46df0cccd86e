"""Solve results of :func:`slasolve.solve`: columns of a multi-column right-hand side, merged
SolveInfos, the collective raise on failure, the kept solutions of ``x0="previous"``."""
from __future__ import annotations

import torch

from .info import ConvergenceError, SolveInfo

__all__ = ["raise_if_failed", "merge_infos", "solve_columns", "previous_solution", "remember_solution"]


def raise_if_failed(info: SolveInfo, raise_on_fail: bool, what: str = "") -> None:
    # info is identical on every rank (decided from reduced scalars / PETSc's
    # global reason), so every rank raises together
    if raise_on_fail and not info.converged:
        raise ConvergenceError(info, None if not what else
                               f"{what}: {info.method} did not converge: {info.reason} after "
                               f"{info.iterations} iterations, residual norm {info.residual_norm:.3e}")


def merge_infos(infos):
    if len(infos) == 1:
        return infos[0]
    worst = next((i for i in infos if not i.converged), infos[-1])
    out = SolveInfo(converged=all(i.converged for i in infos), reason=worst.reason,
                    iterations=max(i.iterations for i in infos),
                    residual_norm=max(i.residual_norm for i in infos),
                    setup_time=sum(i.setup_time for i in infos), solve_time=sum(i.solve_time for i in infos),
                    method=worst.method, backend=worst.backend, rtol=worst.rtol, atol=worst.atol,
                    pc=worst.pc)
    keys = dict.fromkeys(k for i in infos for k in i.times)
    out.times = {k: sum(i.times.get(k, 0.0) for i in infos) for k in keys}
    out.per_rhs = infos
    out.floor = max((i.floor for i in infos if i.floor is not None), default=None)
    return out


def solve_columns(solve_one, b, x0, solve_many=None):
    """Solve column by column for ``b`` of shape ``(n, k)``, or all columns in one call
    with ``solve_many(b, x0) -> (x, [SolveInfo per column])`` (the petsc backend)."""
    if b.dim() == 1:
        return solve_one(b, x0)
    if solve_many is not None:
        x, infos = solve_many(b, x0)
        return x, merge_infos(infos)
    xs, infos = [], []
    for j in range(b.shape[1]):
        x, info = solve_one(b[:, j].contiguous(), None if x0 is None else x0[:, j].contiguous())
        xs.append(x)
        infos.append(info)
    return torch.stack(xs, 1), merge_infos(infos)


def previous_solution(solver, what, b):
    """Local. The last solution ``what`` (``"x"``, adjoint ``"lam"``) this solver gave for a
    right-hand side shaped like ``b`` under ``x0="previous"``, or None. Every rank finds
    one or none alike: the cache and the call sequence are the same on every rank."""
    prev = solver.previous.get(what)
    if prev is None or prev.shape != b.shape or prev.dtype != b.dtype or prev.device != b.device:
        return None
    return prev


def remember_solution(solver, what, x) -> None:
    solver.previous[what] = x.detach().clone()
