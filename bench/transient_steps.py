"""Per-step cost of the transient adjoint: CPU seconds of a forward step and of an adjoint step.

Run (not under mpirun; one process per checkout and round, alternated):
``python bench/transient_steps.py [--roots /work/main .] [--n 64] [--steps 50] [--reps 4] [--rounds 2]
[--json out.json]``.

The problem of ``bench/transient.py --compare`` (P1 triangles on ``--n`` x ``--n`` squares, backward
Euler, source ``M q``, loss ``sum(u_N^2)``, gradient with respect to ``q``), full storage, one rank.
Each worker integrates ``--reps + 1`` times (the first is the warm-up) and reports the least CPU time
(``time.process_time``: less sensitive than wall time to other jobs on a shared machine) of the
forward sweep and of the backward, per step; ``adjoint/forward`` is their ratio (the target of
issue 22 is <= 1.2). Each ``--roots`` entry is a checkout whose ``slasolve`` the worker imports
(before / after a change in one run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def worker(n: int, steps: int, reps: int) -> None:
    import torch
    from mpi4py import MPI

    import slasolve
    from slasolve.fem import Assembler, box_mesh
    from slasolve.timestepping import LinearTimeProblem, integrate

    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    V = Assembler(box_mesh(n, cell="triangle", comm=MPI.COMM_WORLD))
    M, K = V.mass(), V.stiffness(0.1)
    u0 = V.interpolate(lambda x: torch.sin(torch.pi * x[:, 0]) * x[:, 1])
    q0 = V.interpolate(lambda x: torch.exp(-((x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2) / 0.02))
    P = LinearTimeProblem(M, K, lambda t, q: M @ q, scheme="be", method="direct")
    fw, bw, loss = [], [], None
    for r in range(reps + 1):
        q = q0.clone().requires_grad_(True)
        t0 = time.process_time()
        u = integrate(P, u0, q, dt=0.5 / steps, n_steps=steps)
        t1 = time.process_time()
        J = slasolve.global_sum((u * u).sum())
        J.backward()
        t2 = time.process_time()
        if r:
            fw.append(t1 - t0)
            bw.append(t2 - t1)
        loss = (float(J), float((q.grad * q.grad).sum()))
    f, b = min(fw) / steps, min(bw) / steps
    print("RESULT " + json.dumps({"slasolve": os.path.dirname(os.path.dirname(slasolve.__file__)), "n": n,
                                  "nodes": V.n_global_dofs, "steps": steps, "forward_ms_per_step": 1e3 * f,
                                  "adjoint_ms_per_step": 1e3 * b, "adjoint_over_forward": b / f,
                                  "loss": loss[0], "grad_norm2": loss[1]}), flush=True)


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--roots", nargs="+", default=[ROOT])
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    rows = []
    for rnd in range(a.rounds):
        for root in (a.roots if rnd % 2 == 0 else a.roots[::-1]):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(root), OMP_NUM_THREADS="1")
            out = subprocess.run([sys.executable, __file__, "--worker", str(a.n), str(a.steps), str(a.reps)],
                                 env=env, capture_output=True, text=True, check=True).stdout
            row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {row['slasolve']:>24}: forward {row['forward_ms_per_step']:.3f} ms/step, adjoint "
                  f"{row['adjoint_ms_per_step']:.3f} ms/step, adjoint/forward {row['adjoint_over_forward']:.2f} "
                  f"(J {row['loss']:.15e})", flush=True)
    out = {"machine": {"cores": os.cpu_count(), "load_average_at_end": os.getloadavg()}, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
