"""The adjoint of :func:`slasolve.solve`: ``A^T lam = dL/dx`` with the same cached solver (and
preconditioner), then ``dL/db = lam`` and ``dL/dvalues[k] = -lam[row_k] x[col_k]``."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from mpi4py import MPI

from .. import _log
from .._comm import allreduce_int
from ..autograd import AdjointFunction, looks_symmetric, matvec_value_grad
from ..symmetry import SYMMETRY_SUMS, symmetry_sums
from .reuse import with_reuse
from .runs import previous_solution, raise_if_failed, remember_solution, solve_columns

__all__ = ["AdjointSolve", "forward_solve", "repeats_forward"]

# solve options that are not keyword arguments of the backends' solve methods
_NOT_SOLVER_KW = frozenset(("raise_on_fail", "pc_fn", "reuse_pc", "warm", "fallback", "limit",
                            "transpose_solver"))


def forward_solve(b, dA, solver, opts, x0, out) -> tuple:
    """Collective. The forward solve ``A x = b`` of :func:`slasolve.solve` (reuse rules, warm
    start, ``out["info"]``, raise on failure); called directly when no gradient is needed.
    Returns ``(x, the initial guess used)``."""
    kw = {k: v for k, v in opts.items() if k not in _NOT_SOLVER_KW}
    if opts["warm"]:
        x0 = previous_solution(solver, "x", b)

    def run(reuse, s=None, maxiter=None):
        s = solver if s is None else s
        k = kw if maxiter is None else dict(kw, maxiter=maxiter)
        many = getattr(s, "solve_many", None)
        return solve_columns(lambda bj, x0j: s.solve(dA, bj, x0j, reuse_pc=reuse, **k), b, x0,
                             None if many is None else lambda B, X0: many(dA, B, X0, reuse_pc=reuse, **k))
    x, info = with_reuse(solver, run, opts["reuse_pc"], True, opts["limit"], opts.get("fallback"),
                         (opts["rtol"], opts["atol"]))
    if opts["warm"]:
        remember_solution(solver, "x", x)
    out["info"] = info
    raise_if_failed(info, opts["raise_on_fail"])
    return x, x0


class AdjointSolve(AdjointFunction):
    @staticmethod
    def forward(ctx, values, b, dA, solver, opts, x0, out):
        x, x0 = forward_solve(b, dA, solver, opts, x0, out)
        info = out["info"]
        ctx.dA, ctx.solver, ctx.opts, ctx.info = dA, solver, opts, info
        # the system the backward may find it is asked to solve again (decided alike on every rank)
        ctx.forward_system = None
        if any(ctx.needs_input_grad[:2]) and getattr(solver, "transpose_is_forward", False) and info.converged \
                and opts.get("pc_fn") is None and not (info.pc_reuse or {}).get("retried"):
            ctx.forward_system = (b.detach().clone(), None if x0 is None else x0.detach().clone())
        # the operator Mat as the forward left it: if no solve changes it before the backward,
        # the adjoint solve needs no comparison of the values with it (see early_sums)
        stamp = getattr(solver, "operator_stamp", None)
        ctx.op_stamp = stamp(dA) if stamp is not None else None
        # this rank's symmetry sums of that Mat's values (dA's, compared with it and written into it
        # by the solve), made once per Mat state: a loop's solves with unchanged values test nothing
        ctx.sym_sums = _operator_symmetry_sums(dA, ctx.op_stamp) \
            if "transpose_solver" in opts and ctx.op_stamp is not None and b.dim() == 1 else None
        # values saved too: changed in place before the backward they raise (on every rank)
        ctx.save_for_backward(x, values)
        return x

    name = "slasolve.solve"

    @classmethod
    def backward(cls, ctx, g):
        """Collective. :meth:`AdjointFunction.backward` on ``g`` made contiguous once (the gradient
        of a ``sum`` is an expanded, stride-0 view: every later ``contiguous()`` would copy it)."""
        return super().backward(ctx, g.contiguous())

    @staticmethod
    def early_flag(ctx, g) -> bool:
        """Local. Whether the adjoint solve differs from the forward's here (see
        :func:`repeats_forward`; combined on the saved-tensor check's Allreduce)."""
        if getattr(ctx, "forward_system", None) is None:
            return False
        l0 = previous_solution(ctx.solver, "lam", g.contiguous()) if ctx.opts["warm"] else None
        return not _same_system(ctx.forward_system, g.contiguous(), l0)

    @staticmethod
    def early_sums(ctx, g) -> np.ndarray:
        """Local. What the backward needs reduced, summed on the saved-tensor check's Allreduce (the
        same entries on every rank: they depend on agreed settings only): ``early_flag``; for CG /
        MINRES the symmetry test's sums (:func:`slasolve.symmetry.symmetry_sums`); for one
        right-hand side of the petsc backend, whether the operator Mat changed here since the
        forward and ``g . g`` (unchanged everywhere: the adjoint solve skips comparing the values
        with the Mat and reducing ``||g||``)."""
        sym = "transpose_solver" in ctx.opts
        known = ctx.op_stamp is not None and g.dim() == 1
        out = np.zeros(1 + (SYMMETRY_SUMS if sym else 0) + (2 if known else 0))
        out[0] = AdjointSolve.early_flag(ctx, g)
        changed = known and ctx.solver.operator_stamp(ctx.dA) != ctx.op_stamp
        if sym:
            # the Mat as the forward left it: the forward's sums (of the values the adjoint solves with)
            sums = ctx.sym_sums if known and not changed and ctx.sym_sums is not None else None
            out[1:1 + SYMMETRY_SUMS] = symmetry_sums(ctx.dA) if sums is None else sums
        if known:
            gn = g.detach() if g.requires_grad else g   # (a gradient of backward without create_graph does not)
            gn = (gn if gn.dtype == torch.float64 and gn.device.type == "cpu" else
                  gn.to(device="cpu", dtype=torch.float64)).contiguous().numpy()
            out[-2], out[-1] = changed, gn.dot(gn)
        return out

    @staticmethod
    def adjoint(ctx, saved, g):
        x, _ = saved
        if ctx.opts.get("pc_fn") is not None:  # the cached solver may have another callable now
            ctx.solver.set_callable(ctx.opts["pc_fn"])
        kw = {k: v for k, v in ctx.opts.items() if k not in _NOT_SOLVER_KW}
        kw.update(callback=None, record_history=False)
        sums = ctx.early_sums
        ctx.early_flag = bool(sums[0])
        sym = sums[1:1 + SYMMETRY_SUMS] if "transpose_solver" in ctx.opts else None
        rest = sums[1 + (0 if sym is None else SYMMETRY_SUMS):]
        # ||g||, when the operator Mat is as the forward left it on every rank
        known = math.sqrt(rest[1]) if rest.size and not rest[0] else None
        with _log.stage("slaAdjoint"), _log.event("slaAdjoint"), _log.collect() as times:
            solver, warm = ctx.solver, ctx.opts["warm"]
            g = g.contiguous()
            l0 = previous_solution(solver, "lam", g) if warm else None
            transposed = "transpose_solver" in ctx.opts and not looks_symmetric(ctx.dA, sym)
            if transposed:
                # CG/MINRES converged on a matrix that is not symmetric (e.g. Dirichlet rows
                # eliminated on one side only): A^{-1} g would be the wrong adjoint. Solve
                # A^T lam = g with GMRES and the same preconditioner instead.
                solver, warm, l0 = ctx.opts["transpose_solver"](), False, None
            if not transposed and repeats_forward(ctx, g, l0):  # the forward's solve of this system, from this start
                lam = x.detach().clone()
                info = dataclasses.replace(ctx.info, iterations=0, residual_history=None, setup_time=0.0,
                                           solve_time=0.0, times={}, adjoint=None, per_rhs=None,
                                           same_as_forward=True)
            else:
                def run(reuse, s=None, maxiter=None):
                    k = kw if maxiter is None else dict(kw, maxiter=maxiter)
                    if s is None and known is not None and not transposed:   # (not for another solver)
                        k = dict(k, known_bnorm=known)
                    s = solver if s is None else s
                    many = getattr(s, "solve_transpose_many", None)
                    return solve_columns(lambda gj, l0j: s.solve_transpose(ctx.dA, gj.contiguous(), x0=l0j,
                                                                      reuse_pc=reuse, **k), g, l0,
                                    None if many is None else lambda G, L0: many(ctx.dA, G, x0=L0,
                                                                                  reuse_pc=reuse, **k))
                lam, info = with_reuse(solver, run, ctx.opts["reuse_pc"] if not transposed else False, False,
                                        ctx.opts["limit"], None if transposed else ctx.opts.get("fallback"))
            if warm:
                remember_solution(solver, "lam", lam)
        info.times = times
        ctx.info.adjoint = info    # reachable from the forward's SolveInfo
        ctx.info.times["adjoint"] = ctx.info.times.get("adjoint", 0.0) + times["total"]
        raise_if_failed(info, True, "adjoint solve in backward")
        gb = lam if ctx.needs_input_grad[1] else None
        gv = matvec_value_grad(ctx.dA, -lam, x) if ctx.needs_input_grad[0] else None
        return gv, gb, None, None, None, None, None


def _operator_symmetry_sums(dA, stamp) -> np.ndarray:
    """Local. This rank's :func:`~slasolve.symmetry.symmetry_sums` of ``dA`` right after a solve
    wrote ``dA``'s values into the layout's operator Mat, whose ``operator_stamp`` is now
    ``stamp`` (the Mat and its PETSc state, which moves with every change of its values; the
    entry holds the Mat, so no other Mat takes its handle): computed when the stamp is new, else
    the sums computed for it before (the values are the same)."""
    cache = dA._layout.cache("symmetry sums")
    hit = cache.get("operator")
    if hit is not None and hit[0] == stamp:
        return hit[1]
    sums = symmetry_sums(dA)
    cache["operator"] = (stamp, sums)
    return sums


def repeats_forward(ctx, g, l0) -> bool:
    """Collective. True on every rank when the adjoint solve ``A^T lam = g`` would repeat the
    forward solve exactly: the backend solves it with the forward's KSP on ``A`` itself
    (CG, MINRES: ``A`` is symmetric, ``transpose_is_forward``), the forward converged
    without a retry, and on every rank ``g`` equals the forward's ``b`` and the adjoint's
    initial guess the forward's (both zero, or equal ``x0="previous"`` iterates). The
    compliance ``f . u`` of topology optimisation is such a case. One Allreduce."""
    fwd = getattr(ctx, "forward_system", None)
    if fwd is None:  # decided in the forward from global facts: the same on every rank
        return False
    if getattr(ctx, "early_flag", None) is not None:   # in the backward: combined on the saved-tensor
        return not ctx.early_flag                      # check's Allreduce (AdjointSolve.early_flag)
    return bool(allreduce_int(ctx.dA.comm, int(_same_system(fwd, g, l0)), MPI.MIN))


def _same_system(fwd, g, l0) -> bool:
    """Local. Whether ``g`` and the adjoint's start ``l0`` are the forward's ``b`` and ``x0`` here."""
    b, x0 = fwd
    return g.shape == b.shape and g.dtype == b.dtype and torch.equal(g, b) and \
        ((x0 is None and l0 is None) or (x0 is not None and l0 is not None and x0.shape == l0.shape
                                         and torch.equal(x0, l0)))
