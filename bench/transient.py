"""Transient adjoint: peak memory and time of loss + gradient through N heat-equation steps,
with full storage and with s snapshots (binomial checkpointing), and the adjoint step's cost.

Run (not under mpirun; it launches one job per configuration so peaks never mix):
``python bench/transient.py [--ranks 1 2] [--n 100] [--steps 1000] [--snapshots 5 20 50] [--json out.json]``.

Problem: ``du/dt - div(kappa grad u) = q`` on the unit square, ``--n`` x ``--n`` bilinear quads,
insulated, Crank-Nicolson, ``u0 = sin(pi x) y``, one factorisation (MUMPS, petsc backend) for
all steps; loss ``sum(u_N^2)``, gradient with respect to ``u0`` and ``q``. Each worker records
``ru_maxrss`` after a warm-up (the floor) and after the gradient (the peak), so
``peak - floor`` is what the trajectory's storage and the adjoint cost. It also reports the
forward seconds per step (the first sweep) and, with full storage, the adjoint seconds per
step (``backward_time / N``: one transposed solve and the products per step).

dolfin-adjoint is not compared here (see docs/timestepping.md).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(n: int, steps: int, snapshots: int) -> None:
    import resource

    import torch
    from mpi4py import MPI

    import slasolve
    from slasolve.fem import Assembler, box_mesh
    from slasolve.timestepping import LinearTimeProblem, integrate

    torch.set_default_dtype(torch.float64)
    comm = MPI.COMM_WORLD
    V = Assembler(box_mesh(n, cell="quad", comm=comm))
    M, K = V.mass(), V.stiffness(0.05)
    x = V.owned_coords()
    u0 = torch.sin(torch.pi * x[:, 0]) * x[:, 1]
    q = torch.exp(-((x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2) / 0.02)
    P = LinearTimeProblem(M, K, lambda t, q: M @ q, scheme="cn", method="direct")
    ck = None if snapshots == 0 else snapshots

    def run(n_steps):
        a, b = u0.clone().requires_grad_(True), q.clone().requires_grad_(True)
        t0 = time.perf_counter()
        u, info = integrate(P, a, b, dt=0.5 / n_steps, n_steps=n_steps, checkpoints=ck, return_info=True)
        loss = slasolve.global_sum((u * u).sum())
        loss.backward()
        return time.perf_counter() - t0, info, float(loss)

    run(4)   # warm-up: imports, factorisation code paths, schedule generators
    comm.Barrier()
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    wall, info, loss = run(steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    res = comm.gather({"floor_mib": floor, "peak_mib": peak}, root=0)
    if comm.rank == 0:
        state_mib = V.n_global_dofs * 8 / 2 ** 20 / comm.size
        out = {"ranks": comm.size, "n": n, "nodes": V.n_global_dofs, "steps": steps,
               "snapshots": snapshots or "all", "loss": loss, "wall_s": wall,
               "extra_peak_mib_max_rank": max(r["peak_mib"] - r["floor_mib"] for r in res),
               "state_mib_per_rank": state_mib, "peak_stored_states": info.peak_stored_states,
               "forward_steps": info.forward_steps, "recomputed_steps": info.recomputed_steps,
               "optimal_recomputed_steps": info.optimal_recomputed_steps,
               "recompute_factor": info.recompute_factor,
               "forward_s_per_step": info.forward_time / steps,
               "backward_s": info.backward_time,
               "adjoint_s_per_step": (info.backward_time / steps) if snapshots == 0 else None}
        print("RESULT " + json.dumps(out), flush=True)


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--steps", type=int, nargs="+", default=[1000])
    p.add_argument("--snapshots", type=int, nargs="+", default=[0, 5, 20, 50], help="0: full storage")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    rows = []
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    for ranks in a.ranks:
        for steps in a.steps:
            for s in a.snapshots:
                cmd = [sys.executable, __file__, "--worker", str(a.n), str(steps), str(s)]
                if ranks > 1:
                    cmd = ["timeout", "1800", "mpirun", "-n", str(ranks), "--oversubscribe"] + \
                          (["--allow-run-as-root"] if os.geteuid() == 0 else []) + cmd
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
                rows.append(row)
                print(f"ranks {row['ranks']} steps {row['steps']:5d} snapshots {str(row['snapshots']):>4}: "
                      f"extra peak {row['extra_peak_mib_max_rank']:8.1f} MiB (state {row['state_mib_per_rank']:.3f} "
                      f"MiB, {row['peak_stored_states']} held), forward steps {row['forward_steps']} "
                      f"(recomputed {row['recomputed_steps']}, optimum {row['optimal_recomputed_steps']}, "
                      f"factor {row['recompute_factor']:.2f}), {row['wall_s']:.1f} s, forward "
                      f"{1e3 * row['forward_s_per_step']:.2f} ms/step"
                      + (f", adjoint {1e3 * row['adjoint_s_per_step']:.2f} ms/step"
                         if row['adjoint_s_per_step'] is not None else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
