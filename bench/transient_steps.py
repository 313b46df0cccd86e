"""Per-step cost of the transient adjoint: CPU seconds of a forward step and of an adjoint step.

Run (not under mpirun; one job per checkout and round, alternated):
``python bench/transient_steps.py [--roots /work/main .] [--problem fem|line] [--n 64] [--steps 50]
[--control source|stiffness] [--ranks 1] [--backend B] [--reps 4] [--rounds 2] [--mpi-counts LIB]
[--json out.json]``.

``--problem fem``: the problem of ``bench/transient.py --compare`` (P1 triangles on ``--n`` x ``--n``
squares, backward Euler, source ``M q``, loss ``sum(u_N^2)``). ``--problem line``: the 12-unknown 1-D
heat equation of ``tests/test_timestepping*.py`` (Crank-Nicolson, source ``q (1 + t)``, ``dt = 0.1 /
steps``), where a step's fixed costs dominate. The gradient is taken with respect to ``q`` (``--control
source``: the adjoint reads no state) or ``q`` and ``K``'s values (``--control stiffness``); full
storage, one direct factorisation for every step (``--backend``: the direct backend, default MUMPS
(``petsc``) for ``fem`` and at several ranks, SuperLU (``scipy``) for ``line`` at one rank).
Each job integrates ``--reps + 1`` times (the first is the warm-up) and reports the least CPU time of
the forward sweep and of the backward per step (``time.thread_time``, the largest over the ranks: less
sensitive than wall time to other jobs on a shared machine; at several oversubscribed ranks it also
counts the time spent polling in MPI waits), their ratio (issue 22's target: adjoint <= 1.2x forward),
the least wall times, and with ``--mpi-counts`` (``bench/mpi_counts.c`` built with ``mpicc -O2 -shared
-fPIC``, preloaded) the MPI reductions, other collectives and sends per step of slasolve's own calls
(MUMPS' Fortran MPI calls go to PMPI directly and are not counted). Each ``--roots`` entry is a
checkout whose ``slasolve`` the job imports (before / after a change in one run).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _counter():
    import ctypes
    try:
        get = ctypes.CDLL(None).mpi_counts_get
    except AttributeError:
        return None

    def read():
        out = (ctypes.c_longlong * 4)()
        get(out)
        return [int(v) for v in out]
    return read


def worker(problem: str, n: int, steps: int, reps: int, control: str, backend: str) -> None:
    import torch
    from mpi4py import MPI

    import slasolve
    from slasolve.timestepping import LinearTimeProblem, integrate

    comm = MPI.COMM_WORLD
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    if problem == "fem":
        from slasolve.fem import Assembler, box_mesh
        V = Assembler(box_mesh(n, cell="triangle", comm=comm))
        M, K = V.mass(), V.stiffness(0.1)
        u0 = V.interpolate(lambda x: torch.sin(torch.pi * x[:, 0]) * x[:, 1])
        q0 = V.interpolate(lambda x: torch.exp(-((x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2) / 0.02))
        source, sch, dt, nodes = (lambda t, q: M @ q), "be", 0.5 / steps, V.n_global_dofs
    else:
        import scipy.sparse as sp
        m = 12
        Kg = (sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m)) * (m + 1) ** 2).tocsr()
        Mg = sp.diags([1 / 6, 2 / 3, 1 / 6], [-1, 0, 1], shape=(m, m)).tocsr()
        M, K = slasolve.DSparseTensor.from_global(Mg, comm), slasolve.DSparseTensor.from_global(Kg, comm)
        r0, r1 = K.row_range
        x = torch.linspace(0, 1, m + 2)[1:-1][r0:r1]
        u0, q0 = torch.cos(2 * x), torch.sin(3 * x)
        source, sch, dt, nodes = (lambda t, q: q * (1.0 + t)), "cn", 0.1 / steps, m
    counts = _counter()
    fw, bw, fw_wall, bw_wall, loss = [], [], [], [], None
    cf = cb = None
    for r in range(reps + 1):
        q = q0.clone().requires_grad_(True)
        Kv = K.values.clone().requires_grad_(control == "stiffness")
        P = LinearTimeProblem(M, K.with_values(Kv), source, scheme=sch, method="direct", backend=backend or None)
        comm.Barrier()
        c0 = counts() if counts else None
        w0, t0 = time.perf_counter(), time.thread_time()
        u = integrate(P, u0, q, dt=dt, n_steps=steps)
        t1, w1 = time.thread_time(), time.perf_counter()
        c1 = counts() if counts else None
        J = slasolve.global_sum((u * u).sum())
        comm.Barrier()
        c2 = counts() if counts else None
        w2, t2 = time.perf_counter(), time.thread_time()
        J.backward()
        t3, w3 = time.thread_time(), time.perf_counter()
        c3 = counts() if counts else None
        if r:
            fw.append(comm.allreduce(t1 - t0, op=MPI.MAX))
            bw.append(comm.allreduce(t3 - t2, op=MPI.MAX))
            fw_wall.append(comm.allreduce(w1 - w0, op=MPI.MAX))
            bw_wall.append(comm.allreduce(w3 - w2, op=MPI.MAX))
        if counts:
            cf = [comm.allreduce(b - a, op=MPI.MAX) / steps for a, b in zip(c0[:3], c1[:3])]
            cb = [comm.allreduce(b - a, op=MPI.MAX) / steps for a, b in zip(c2[:3], c3[:3])]
        g2 = slasolve.global_sum((q.grad * q.grad).sum())
        loss = (float(J), float(g2))
    f, b = min(fw) / steps, min(bw) / steps
    if comm.rank == 0:
        print("RESULT " + json.dumps({
            "slasolve": os.path.dirname(os.path.dirname(slasolve.__file__)), "problem": problem, "n": n,
            "nodes": nodes, "steps": steps, "ranks": comm.size, "control": control, "backend": backend,
            "forward_ms_per_step": 1e3 * f, "adjoint_ms_per_step": 1e3 * b, "adjoint_over_forward": b / f,
            "forward_wall_ms_per_step": 1e3 * min(fw_wall) / steps, "adjoint_wall_ms_per_step": 1e3 * min(bw_wall) / steps,
            "adjoint_over_forward_wall": min(bw_wall) / min(fw_wall),
            "mpi_per_forward_step": cf, "mpi_per_adjoint_step": cb, "loss": loss[0], "grad_norm2": loss[1]}),
            flush=True)


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--roots", nargs="+", default=[ROOT])
    p.add_argument("--problem", choices=["fem", "line"], default="fem")
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--control", choices=["source", "stiffness"], default="source")
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--backend", default=None, help="direct backend (default: scipy for line at 1 rank, else petsc)")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mpi-counts", default=None, help="the built bench/mpi_counts.c, preloaded at several ranks")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        w = a.worker
        worker(w[0], int(w[1]), int(w[2]), int(w[3]), w[4], "" if w[5] == "-" else w[5])
        return
    backend = a.backend or ("scipy" if a.problem == "line" and a.ranks == 1 else "petsc")
    rows = []
    for rnd in range(a.rounds):
        for root in (a.roots if rnd % 2 == 0 else a.roots[::-1]):
            env = dict(os.environ, PYTHONPATH=os.path.abspath(root), OMP_NUM_THREADS="1")
            cmd = [sys.executable, __file__, "--worker", a.problem, str(a.n), str(a.steps), str(a.reps), a.control,
                   backend]
            if a.ranks > 1:
                env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                           OMPI_MCA_rmaps_base_oversubscribe="1", OMPI_MCA_mpi_yield_when_idle="1")
                pre = ["-x", f"LD_PRELOAD={os.path.abspath(a.mpi_counts)}"] if a.mpi_counts else []
                cmd = ["mpirun", "-n", str(a.ranks), "--oversubscribe", "--bind-to", "none", "-x", "PYTHONPATH",
                       "-x", "OMP_NUM_THREADS"] + pre + cmd
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
            row = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
            row["round"] = rnd
            rows.append(row)
            print(f"round {rnd} {row['slasolve']:>24}: forward {row['forward_ms_per_step']:.3f} ms/step, adjoint "
                  f"{row['adjoint_ms_per_step']:.3f} ms/step, adjoint/forward {row['adjoint_over_forward']:.2f} "
                  f"(wall {row['adjoint_over_forward_wall']:.2f}; MPI per step fw/adj {row['mpi_per_forward_step']} / "
                  f"{row['mpi_per_adjoint_step']}; J {row['loss']:.15e})", flush=True)
    out = {"machine": {"cores": os.cpu_count(), "load_average_at_end": os.getloadavg()},
           "settings": {k: v for k, v in vars(a).items() if k != "worker"}, "backend": backend, "rows": rows}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
