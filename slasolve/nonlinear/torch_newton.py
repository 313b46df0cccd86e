"""Native Newton with a backtracking (Armijo) line search; inner solves with slasolve.solve.

Algorithm (PETSc's ``newtonls`` with ``bt``, in torch): at ``u_k`` with residual
``F_k`` stop when ``||F_k|| <= max(rtol ||F_0||, atol)``; else solve ``J(u_k) d = -F_k``
(``slasolve.solve(J, -F, backend="torch", **linear_solver)``, a fixed relative inner
tolerance, default ``1e-10`` in float64 / ``1e-5`` in float32; matrix-free ``1e-5`` /
``1e-3``), then take
``u_{k+1} = u_k + lam d`` with the largest ``lam`` in 1, then quadratic-interpolation
steps clamped to ``[0.1 lam, 0.5 lam]`` satisfying the sufficient decrease
``||F(u_k + lam d)|| <= (1 - alpha lam) ||F_k||`` (``alpha = 1e-4``; PETSc's test on
``||F||^2/2`` with the slope ``-||F_k||^2`` of an exact Newton direction); no such
``lam >= 1e-12`` within 40 trials: ``DIVERGED_LINE_SEARCH``, or ``DIVERGED_LOCAL_MIN`` when
``||J^T F|| < 1e-4 ||F||`` (PETSc's test: a local minimum of ``||F||`` that is no root). ``line_search="basic"``
takes full steps. Every decision uses global norms (one Allreduce each), so all
ranks take the same steps and call ``residual`` / ``jacobian`` equally often.

Without a Jacobian (``jacobian=None``) the inner solve is matrix-free GMRES
(Jacobian-free Newton-Krylov): ``J v ~ (F(u + h v) - F(u)) / h`` with
``h = sqrt(eps) (1 + ||u||) / ||v||``, no preconditioner.
"""
from __future__ import annotations

import math
import time

import torch

from .._comm import allreduce_sum
from .info import NonlinearInfo
from .problem import global_norm

__all__ = ["newton"]

ALPHA = 1e-4
MAX_LS = 40
MIN_LAMBDA = 1e-12
LOCAL_MIN = 1e-4  # PETSc's newtonls local-minimum threshold on ||J^T F|| / ||F||


def inner_rtol_default(dtype, use_jacobian: bool) -> float:
    """Local. The fixed inner relative tolerance when ``linear_solver`` has no ``rtol``: tight with
    a Jacobian (keeps Newton quadratic), ``1e-5`` matrix-free (finite-difference products carry
    relative errors of ``sqrt(eps)`` times the conditioning, so a tighter unpreconditioned inner
    solve mostly stagnates; measured on the tests' 1-D problem at 1-3 ranks)."""
    if not use_jacobian:
        return 1e-5 if dtype == torch.float64 else 1e-3
    return 1e-10 if dtype == torch.float64 else 1e-5


def _linear_solve(prob, J, u, r, ls, rtol_default):
    """Collective. ``d`` with ``J d = -r`` and the SolveInfo (never raises on non-convergence)."""
    from ..krylov.solve import solve
    kw = dict(ls)
    kw.pop("block_size", None)   # a hint for PETSc's Jacobian Mat (GAMG); the torch solves ignore it
    kw.setdefault("rtol", rtol_default)
    if J is not None:
        method = kw.pop("method", "gmres")
        if method == "direct":  # sparse LU / Cholesky (slasolve.spsolve); tolerances do not apply
            from ..krylov.info import ConvergenceError, SolveInfo
            try:
                return solve(J, -r, "direct", backend="torch", return_info=True, pc=kw.get("pc"))
            except ConvergenceError:  # a singular factorisation, raised on every rank
                return None, SolveInfo(converged=False, reason="DIVERGED_PC_FAILED", iterations=0,
                                       residual_norm=float("nan"), method="direct", backend="torch")
        return solve(J, -r, method, backend="torch", return_info=True, raise_on_fail=False, **kw)
    return _jfnk_solve(prob, u, r, kw)


def _jfnk_solve(prob, u, r, kw):
    from ..krylov.torch_methods import default_maxiter, gmres
    comm = prob.comm
    eps = torch.finfo(u.dtype).eps
    unorm = global_norm(comm, u)

    def matvec(v):
        vn = global_norm(comm, v)
        if vn == 0.0:
            return torch.zeros_like(v)
        h = math.sqrt(eps) * (1.0 + unorm) / vn
        return (prob.residual(u + h * v) - r) / h

    n_global = int(allreduce_sum(comm, torch.tensor([prob.n_local], dtype=torch.float64))[0])
    maxiter = kw.get("maxiter")
    with torch.no_grad():
        return gmres(matvec, -r, rtol=float(kw["rtol"]), atol=float(kw.get("atol", 0.0)),
                     maxiter=default_maxiter(n_global) if maxiter is None else int(maxiter),
                     restart=int(kw.get("restart", 30)), reduce_sum=lambda t: allreduce_sum(comm, t))


def newton(prob, u0, *, rtol, atol, stol, maxiter, line_search, linear_solver, use_jacobian,
           callback, progress, r0=None) -> tuple:
    """Collective. ``(u, NonlinearInfo)``; never raises on non-convergence."""
    t0 = time.perf_counter()
    comm = prob.comm
    rank0 = comm.Get_rank() == 0
    inner_rtol = inner_rtol_default(u0.dtype, use_jacobian)
    u = u0.detach().clone()
    r = prob.residual(u) if r0 is None else r0
    fn = global_norm(comm, r)
    hist, lits = [fn], []
    target = max(rtol * fn, atol)
    reason, it = None, 0
    lm, pc = "gmres", "none"
    p_last = None   # the objective at u, when known
    while True:
        if not math.isfinite(fn):
            reason = "DIVERGED_FNORM_NAN"
            break
        if fn <= target:
            reason = "CONVERGED_FNORM_ABS" if atol > 0 and fn <= atol else "CONVERGED_FNORM_RELATIVE"
            break
        if it >= maxiter:
            reason = "DIVERGED_MAX_IT"
            break
        J = prob.jacobian(u) if use_jacobian else None
        d, linfo = _linear_solve(prob, J, u, r, linear_solver, inner_rtol)
        lits.append(int(linfo.iterations))
        lm, pc = linfo.method or lm, linfo.pc or pc
        if not linfo.converged:
            reason = "DIVERGED_LINEAR_SOLVE"
            break
        lam, ok = 1.0, False
        # the merit function phi(lam): the objective when given (its slope at 0 is F . d), else
        # ||F||^2 / 2 (slope -||F||^2 for a Newton direction)
        if line_search == "bt" and prob.has_objective:
            if p_last is None:   # else the objective at the point the previous line search accepted
                p_last = prob.objective(u)
            p0, slope = p_last, float(allreduce_sum(comm, (r.to(torch.float64) * d.to(torch.float64))
                                                    .sum().reshape(1))[0])
            if not slope < 0:   # not a descent direction for the objective: fall back to ||F||
                p0 = None
        else:
            p0 = None
        for _ in range(MAX_LS if line_search == "bt" else 1):
            un = u + lam * d
            rn = prob.residual(un)
            fnn = global_norm(comm, rn)
            if line_search != "bt":
                ok = True
                break
            if p0 is not None:
                p1 = prob.objective(un)
                if math.isfinite(fnn) and p1 <= p0 + ALPHA * lam * slope:
                    ok = True
                    break
            elif math.isfinite(fnn) and fnn <= (1.0 - ALPHA * lam) * fn:
                ok = True
                break
            else:
                p1 = 0.5 * fnn * fnn
            if math.isfinite(fnn) and math.isfinite(p1):  # minimiser of the quadratic through phi(0), phi'(0), phi(lam)
                if p0 is None:
                    q0, q_slope = 0.5 * fn * fn, -fn * fn
                else:
                    q0, q_slope = p0, slope
                denom = 2.0 * (p1 - q0 - q_slope * lam)
                lt = -q_slope * lam * lam / denom if denom > 0 else 0.5 * lam
                lam = min(max(lt, 0.1 * lam), 0.5 * lam)
            else:
                lam *= 0.1
            if lam < MIN_LAMBDA:
                break
        if not ok:
            reason = "DIVERGED_LINE_SEARCH"
            if J is not None:  # PETSc's test: ||J^T F|| small relative to ||F|| means a local minimum of ||F||
                with torch.no_grad():
                    if global_norm(comm, J.rmatvec(r)) < LOCAL_MIN * fn:
                        reason = "DIVERGED_LOCAL_MIN"
            break
        it += 1
        step = lam * global_norm(comm, d)
        u, r, fn = un, rn, fnn
        p_last = p1 if p0 is not None else None
        hist.append(fn)
        if progress and rank0:
            print(f"  Newton {it:3d}  residual {fn:.3e}  ({lits[-1]} linear iterations, step {lam:g})",
                  flush=True)
        if callback is not None:
            callback(it, fn)
        # PETSc's order: the residual tests first (next loop pass), then the step test
        if stol and math.isfinite(fn) and fn > target and step <= stol * global_norm(comm, u):
            reason = "CONVERGED_SNORM_RELATIVE"
            break
    info = NonlinearInfo(converged=reason.startswith("CONVERGED"), reason=reason, iterations=it,
                         residual_norm=fn, residual_history=hist, linear_iterations=sum(lits),
                         linear_iterations_per_step=lits, method="newtonls", backend="torch",
                         line_search=line_search, linear_method=lm if use_jacobian else "gmres (matrix-free)",
                         pc=pc, rtol=rtol, atol=atol, stol=stol or 0.0, solve_time=time.perf_counter() - t0)
    return u, info
