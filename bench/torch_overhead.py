"""Per-iteration overhead of the torch backend's CG + Jacobi at small local sizes (issue 12).

Run: ``mpirun -n 1 python bench/torch_overhead.py`` and ``mpirun -n 2 ...``
(``--per-rank`` unknowns per rank, default 10,000: 2-D Poisson, ``nx = sqrt(per_rank * ranks)``).

Measured in the same run, contenders alternating (the machine may be loaded: take
the ratios, best of ``--trials``):

* ``raw_petsc``: a raw petsc4py KSP, CG + Jacobi, ``--iters`` iterations (rtol 1e-30);
* ``torch``: ``slasolve.solve(..., backend="torch", pc="jacobi")``, same iterations;
* the per-solve time to ``rtol = 1e-6`` of both (setup included).

Breakdown of the torch CG iteration: the kernel ``torch_methods.cg`` is run with
timed wrappers around its callables (operator, preconditioner, reduction), so
``matvec``, ``pc`` and ``reductions`` are measured inside a real solve; ``halo`` is a
forward halo exchange alone (part of ``matvec``; ``matvec local`` = matvec - halo);
the rest of the iteration (vector updates, dots, scalar work, Python) is
``vector updates + Python``, split using the cost of the bare torch vector
operations of one iteration timed in a loop (``vector ops``).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, RANK, SIZE, build_dpoisson2d, rhs_local, rprint  # noqa: E402

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

from slasolve import solve  # noqa: E402
from slasolve._comm import allreduce_sum  # noqa: E402
from slasolve.krylov import torch_methods  # noqa: E402


CLOCK = [time.perf_counter]   # --clock cpu: time.process_time


def best_time(fn, reps: int, trials: int) -> float:
    """Collective. Best over ``trials`` of the mean seconds of ``reps`` calls (max over ranks)."""
    best = math.inf
    for _ in range(trials):
        COMM.Barrier()
        t0 = CLOCK[0]()
        for _ in range(reps):
            fn()
        dt = COMM.allreduce((CLOCK[0]() - t0) / reps, op=MPI.MAX)
        best = min(best, dt)
    return best


class Timed:
    """Wrap a callable, accumulating its wall time (keyword arguments pass through; an
    operator's ``bind`` protocol too: the bound ``apply`` is timed into the same total)."""

    def __init__(self, fn, parent=None):
        self.fn, self.t, self.parent = fn, 0.0, parent
        for attr in ("supports_out", "ghost_slots"):
            if hasattr(fn, attr):
                setattr(self, attr, getattr(fn, attr))
        if hasattr(fn, "bind"):
            self.bind = lambda *a: Timed(fn.bind(*a), parent=self)

    def __call__(self, *a, **kw):
        t0 = CLOCK[0]()
        out = self.fn(*a, **kw)
        dt = CLOCK[0]() - t0
        if self.parent is not None:
            self.parent.t += dt
        else:
            self.t += dt
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--per-rank", type=int, default=10_000)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None, help="write the figures to this JSON file (rank 0)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall (default): perf_counter; cpu: process_time, which leaves out the time the OS "
                        "gives other processes (a loaded machine); at 2+ ranks it still counts waiting for "
                        "the other ranks while MPI polls")
    a = p.parse_args()
    if a.clock == "cpu":
        CLOCK[0] = time.process_time
    torch.set_num_threads(1)
    nx = int(round(math.sqrt(a.per_rank * SIZE)))
    dA, _ = build_dpoisson2d(nx, COMM)
    r0, r1 = dA.row_range
    b = rhs_local(r1 - r0, r0)
    A = dA.to_petsc()
    from petsc4py import PETSc

    def make_ksp(rtol, maxit):
        ksp = PETSc.KSP().create(comm=COMM)
        ksp.setOperators(A)
        ksp.setType("cg")
        ksp.getPC().setType("jacobi")
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        ksp.setTolerances(rtol=rtol, atol=0.0, max_it=maxit)
        ksp.setUp()
        return ksp
    pb, px = A.createVecLeft(), A.createVecRight()
    pb.getArray()[:] = b.numpy()
    k_it, k_tol = make_ksp(1e-30, a.iters), make_ksp(1e-6, 10_000)

    def petsc_iters():
        px.set(0.0)
        k_it.solve(pb, px)

    def petsc_rtol():
        px.set(0.0)
        k_tol.solve(pb, px)

    def torch_iters():
        return solve(dA, b, "cg", backend="torch", pc="jacobi", rtol=1e-30, maxiter=a.iters,
                     return_info=True, raise_on_fail=False)

    def torch_rtol():
        return solve(dA, b, "cg", backend="torch", pc="jacobi", rtol=1e-6, return_info=True)

    _, inf_it = torch_iters()
    _, inf_tol = torch_rtol()
    petsc_iters()
    petsc_rtol()
    its_p, its_tol_p = k_it.getIterationNumber(), k_tol.getIterationNumber()
    assert inf_it.iterations == its_p == a.iters, (inf_it.iterations, its_p)
    # alternate contenders, best of trials
    t = {"raw_petsc": math.inf, "torch": math.inf, "raw_petsc_rtol": math.inf, "torch_rtol": math.inf}
    fns = {"raw_petsc": petsc_iters, "torch": torch_iters, "raw_petsc_rtol": petsc_rtol, "torch_rtol": torch_rtol}
    for trial in range(a.trials):
        for k in (list(fns) if trial % 2 == 0 else list(fns)[::-1]):
            t[k] = min(t[k], best_time(fns[k], 1, 1))

    # breakdown inside a real kernel run: the backend's own operator, reducer and
    # preconditioner, wrapped in timers (attributes the kernel looks for pass through)
    from slasolve.krylov.torch_backend import _build_pc
    try:
        from slasolve.krylov.torch_operator import krylov_matvec, krylov_reducer
    except ImportError:  # before issue 12: the backend passed dA.matvec and a plain Allreduce
        def krylov_matvec(dA, b):
            return dA.matvec

        def krylov_reducer(comm):
            return (lambda t: allreduce_sum(comm, t)) if comm.Get_size() > 1 else None
    M0 = _build_pc(dA, "jacobi", False)
    comm = dA.comm
    halo = dA.halo
    parts = None
    for _ in range(a.trials):
        mv, pc = Timed(krylov_matvec(dA, b)), Timed(M0)
        if hasattr(M0, "inv_diag"):
            pc.inv_diag = M0.inv_diag  # fused into the kernel's vector updates
        red0 = krylov_reducer(comm)
        red = red_in = None
        if red0 is not None:
            red, red_in = Timed(red0), Timed(getattr(red0, "host_inplace", lambda a: None))
            if hasattr(red0, "host_inplace"):
                red.host_inplace = red_in
        COMM.Barrier()
        t0 = CLOCK[0]()
        torch_methods.cg(mv, b, rtol=1e-30, maxiter=a.iters, M=pc, reduce_sum=red)
        tot = CLOCK[0]() - t0
        cand = [tot, mv.t, pc.t, (red.t + red_in.t) if red is not None else 0.0]
        cand = COMM.allreduce(cand, op=MPI.MAX)  # lexicographic: the slowest rank's parts
        if parts is None or cand[0] < parts[0]:
            parts = cand
    tot, t_mv, t_pc, t_red = (v / a.iters for v in parts)
    x = torch.ones(r1 - r0, dtype=torch.float64)
    t_halo = t_halo_plan = 0.0
    if halo.n_ghost or halo.n_send:
        t_halo_plan = best_time(lambda: halo.finish(halo.start_forward(x)), a.iters, a.trials)

    def exchange_of(op):
        """The operator's own exchange, alone (None: it has none on this rank)."""
        if hasattr(op, "bind"):   # bound to an extended vector [x | ghosts]: the kernel's way
            xe = torch.ones(x.numel() + op.ghost_slots, dtype=x.dtype)
            ex = getattr(op.bind(xe, torch.empty_like(x)), "_exchange", None)
            return None if ex is None else ex.run
        ex = getattr(op, "_exchange", None)   # before the extended operator
        return None if ex is None else (lambda: (ex.start(x), ex.finish()))
    ex_run = exchange_of(krylov_matvec(dA, b))   # collective (krylov_matvec agrees its choice)
    if SIZE > 1 and ex_run is not None:
        t_halo = best_time(ex_run, a.iters, a.trials)
    else:
        t_halo = t_halo_plan
    # the synchronisation floor of one iteration alone: the exchange and the two Allreduces
    t_sync = 0.0
    if SIZE > 1:
        import numpy as np
        ex = exchange_of(krylov_matvec(dA, b))
        a1, a2 = np.zeros(1), np.zeros(2)

        def sync():
            if ex is not None:
                ex()
            elif halo.n_ghost or halo.n_send:
                halo.finish(halo.start_forward(x))
            comm.Allreduce(MPI.IN_PLACE, a1, op=MPI.SUM)
            comm.Allreduce(MPI.IN_PLACE, a2, op=MPI.SUM)
        t_sync = best_time(sync, a.iters, a.trials)
    # bare vector work of one CG+Jacobi iteration as the CPU kernel does it (BLAS level 1
    # on NumPy views): p.q, x += alpha p, r -= alpha q, z = r * d, r.r, r.z, p = z + beta p
    n = r1 - r0
    import numpy as np
    W = torch.rand(5, n, dtype=torch.float64)
    xv, rv, zv, pv, qv = (w.numpy() for w in W)
    dv = torch.rand(n, dtype=torch.float64).numpy()
    blas1 = getattr(torch_methods, "_blas1", None)
    if blas1 is not None:
        dot, axpy, scal = blas1(W[0])

        def vec_ops():
            dot(pv, qv)
            axpy(pv, xv, a=1e-9)
            axpy(qv, rv, a=-1e-9)
            np.multiply(rv, dv, out=zv)
            dot(rv, rv)
            dot(rv, zv)
            scal(0.5, pv)
            axpy(zv, pv)
    else:   # the torch-ops kernel before BLAS: p.q, [x; r] += [p; q] * c, z = r d, [r; z] r, p = z + b p
        PQ, coef, buf = W[3:5], torch.full((2, 1), 1e-9, dtype=torch.float64), torch.empty(2, dtype=torch.float64)
        dt_ = torch.from_numpy(dv)

        def vec_ops():
            torch.dot(PQ[0], PQ[1]).item()
            W[0:2].addcmul_(PQ, coef)
            torch.mul(W[1], dt_, out=W[2])
            torch.mv(W[1:3], W[1], out=buf)
            torch.add(W[2], PQ[0], alpha=0.5, out=PQ[0])
    t_vec = best_time(vec_ops, a.iters, a.trials)
    rest = tot - t_mv - t_pc - t_red
    per = {k: t[k] / (a.iters if "rtol" not in k else 1) for k in t}
    rprint(f"torch CG+Jacobi overhead, {SIZE} rank(s), {r1 - r0} unknowns on rank 0 (n = {nx * nx}), "
           f"{a.iters} iterations, best of {a.trials}" + (", CPU time" if a.clock == "cpu" else ""))
    rprint(f"  per iteration: raw PETSc {per['raw_petsc'] * 1e6:8.1f} us | torch solve() "
           f"{per['torch'] * 1e6:8.1f} us | ratio {per['torch'] / per['raw_petsc']:.2f}")
    rprint(f"  per solve to rtol=1e-6 ({inf_tol.iterations} its torch, {its_tol_p} PETSc): raw PETSc "
           f"{per['raw_petsc_rtol'] * 1e3:.2f} ms | torch {per['torch_rtol'] * 1e3:.2f} ms | ratio "
           f"{per['torch_rtol'] / per['raw_petsc_rtol']:.2f}")
    rprint(f"  breakdown of a kernel iteration ({tot * 1e6:.1f} us, ratio to PETSc "
           f"{tot / per['raw_petsc']:.2f}):")
    rows = [("matvec (total)", t_mv), ("  halo exchange alone", t_halo),
            ("  (HaloPlan exchange alone, for comparison)", t_halo_plan),
            ("  matvec local (matvec - halo)", t_mv - t_halo), ("preconditioner apply (unfused)", t_pc),
            ("reductions", t_red), ("vector updates + Python", rest),
            ("  bare vector ops", t_vec), ("  Python / scalar work", rest - t_vec),
            ("sync floor alone (exchange + 2 Allreduce)", t_sync)]
    for name, v in rows:
        rprint(f"    {name:42s} {v * 1e6:8.1f} us  {v / per['raw_petsc']:5.2f} x PETSc it")
    if a.json and COMM.rank == 0:
        import json
        with open(a.json, "w") as fh:
            json.dump({"ranks": SIZE, "n": nx * nx, "clock": a.clock, "rows_rank0": r1 - r0, "iters": a.iters, "trials": a.trials,
                       "per_iteration_s": {"raw_petsc": per["raw_petsc"], "torch": per["torch"]},
                       "ratio_per_iteration": per["torch"] / per["raw_petsc"],
                       "per_solve_s": {"raw_petsc": per["raw_petsc_rtol"], "torch": per["torch_rtol"]},
                       "iterations_rtol": {"torch": inf_tol.iterations, "raw_petsc": its_tol_p},
                       "ratio_per_solve": per["torch_rtol"] / per["raw_petsc_rtol"],
                       "kernel_iteration_s": tot, "breakdown_s": {k.strip(): v for k, v in rows}}, fh, indent=2)


if __name__ == "__main__":
    main()
