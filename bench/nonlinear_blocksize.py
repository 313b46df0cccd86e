"""nonlinear_solve on a neo-Hookean solid with the Jacobian Mat's block size = dim (``linear_solver``
``block_size=P.block_size``, DOLFINx's configuration) against the scalar Mat (the default), alternated
in one run: CPU seconds per call (max over ranks, load-independent unlike wall time on a shared
machine) and wall seconds, forward and forward + gradient, GAMG set-up / apply time from PETSc's
log, Newton and CG counts, answers compared.

    mpirun -n 1 python bench/nonlinear_blocksize.py [--n 64 --n3 11] [--trials 7]
    mpirun -n 2 python bench/nonlinear_blocksize.py
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
torch.set_num_threads(1)

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh, rigid_body_modes  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

COMM = MPI.COMM_WORLD
RTOL = 1e-10


def problem(dim: int, n: int):
    sp = Assembler(box_mesh(n, cell="triangle" if dim == 2 else "tetra", comm=COMM), dim)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    force = torch.zeros(dim, dtype=torch.float64)
    force[-1] = -0.2
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64)), body_force=force)
    c = sp.cell_coords.mean(1).numpy()
    theta = torch.from_numpy(0.3 * np.sin(3 * c[:, 0]) * np.cos(2 * c[:, 1]))
    return sp, P, rigid_body_modes(sp), theta


def run(sp, P, Z, theta, bs, gradient):
    ls = dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=Z)
    if bs > 1:
        ls["block_size"] = bs
    th = theta.clone().requires_grad_(gradient)
    mu = torch.exp(th)
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), mu, 1.5 * mu, jacobian=P.jacobian, rtol=RTOL,
                                       linear_solver=ls, objective=P.energy, return_info=True)
    J = slasolve.global_sum(0.5 * (u ** 2).sum(), COMM)
    g = None
    if gradient:
        J.backward()
        g = th.grad
    return float(J.detach()), g, info


def event_times(names):
    """Seconds in each PETSc event so far, summed over the main stage and slasolve's stages."""
    from slasolve._log import STAGE_NAMES
    stages = [PETSc.Log.Stage("Main Stage")] + [PETSc.Log.Stage(n) for n in STAGE_NAMES]
    return {name: sum(float(PETSc.Log.Event(name).getPerfInfo(st.id)["time"]) for st in stages) for name in names}


def timed(f):
    COMM.Barrier()
    c0, w0 = time.process_time(), time.perf_counter()
    r = f()
    c, w = time.process_time() - c0, time.perf_counter() - w0
    return r, COMM.allreduce(c, op=MPI.MAX), COMM.allreduce(w, op=MPI.MAX)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--n", type=int, default=64, help="2-D: 2 n^2 triangles")
    p.add_argument("--n3", type=int, default=11, help="3-D: 6 n^3 tetrahedra (0: skip)")
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    PETSc.Log.begin()
    out = {"ranks": COMM.size, "trials": args.trials, "cases": []}
    cases = [(2, args.n)] + ([(3, args.n3)] if args.n3 else [])
    for dim, n in cases:
        sp, P, Z, theta = problem(dim, n)
        for gradient in (False, True):
            res, cpu, wall, pc = {}, {1: [], dim: []}, {1: [], dim: []}, {1: [], dim: []}
            for bs in (1, dim):
                run(sp, P, Z, theta, bs, gradient)   # warm-up: kept SNES, caches
            for t in range(args.trials):
                for bs in ((1, dim) if t % 2 == 0 else (dim, 1)):
                    e0 = event_times(["PCSetUp", "PCApply"])
                    res[bs], c, w = timed(lambda: run(sp, P, Z, theta, bs, gradient))
                    e1 = event_times(["PCSetUp", "PCApply"])
                    cpu[bs].append(c)
                    wall[bs].append(w)
                    pc[bs].append(COMM.allreduce(sum(e1[k] - e0[k] for k in e0), op=MPI.MAX))
            (J1, g1, i1), (Jb, gb, ib) = res[1], res[dim]
            row = {"dim": dim, "n": n, "cells": 2 * n * n if dim == 2 else 6 * n ** 3,
                   "gradient": gradient, "newton its": [i1.iterations, ib.iterations],
                   "cg its": [i1.linear_iterations, ib.linear_iterations],
                   "rel diff J": abs(J1 - Jb) / abs(J1)}
            if gradient:
                num = slasolve.global_sum(((g1 - gb) ** 2).sum(), COMM)
                den = slasolve.global_sum((g1 ** 2).sum(), COMM)
                row["rel diff grad"] = float((num / den).sqrt())
            for name, d in (("cpu", cpu), ("wall", wall), ("PCSetUp+PCApply", pc)):
                r = [b / a for a, b in zip(d[1], d[dim])]
                row[name] = {"bs=1 median": float(np.median(d[1])), f"bs={dim} median": float(np.median(d[dim])),
                             "ratio median": float(np.median(r)), "ratio min": float(min(r)),
                             "ratio max": float(max(r))}
            out["cases"].append(row)
            if COMM.rank == 0:
                print(f"{dim}-D {row['cells']} cells, {'forward+gradient' if gradient else 'forward'}, "
                      f"{COMM.size} rank(s): Newton {row['newton its']}, CG {row['cg its']} (bs=1, bs={dim}); "
                      f"rel diff J {row['rel diff J']:.0e}" +
                      (f", grad {row['rel diff grad']:.0e}" if gradient else ""), flush=True)
                for name in ("cpu", "wall", "PCSetUp+PCApply"):
                    s = row[name]
                    print(f"   {name:>16}: bs=1 {s['bs=1 median'] * 1e3:8.1f} ms, bs={dim} "
                          f"{s[f'bs={dim} median'] * 1e3:8.1f} ms, ratio bs={dim}/bs=1 {s['ratio median']:.2f} "
                          f"({s['ratio min']:.2f}-{s['ratio max']:.2f})", flush=True)
    out["loadavg"] = os.getloadavg()
    if COMM.rank == 0:
        path = args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"nlbs_blocksize_ab_n{COMM.size}.json")
        with open(path, "w") as f:
            json.dump(out, f, indent=1)
        print("load average", out["loadavg"], "->", path)


if __name__ == "__main__":
    main()
