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

``--compare --baseline ROOT`` adds the same slasolve runs importing the checkout at ``ROOT``
(before / after a change, alternated in the same run).

``--compare``: side by side with dolfin-adjoint 2023.0 on legacy DOLFIN 2019.2 (optional: made by
``bench/install_peers.sh`` in ``.venv-dolfin-adjoint``; skipped with a message without it), the
same heat-equation inverse problem on both sides:

* ``du/dt - div(kappa grad u) = q`` on the unit square, insulated, ``kappa = --kappa``,
  ``u(0) = sin(pi x) y``; ``--n`` x ``--n`` squares cut into two triangles from the low corner
  (``slasolve.fem.box_mesh(n, cell="triangle")`` == DOLFIN's ``UnitSquareMesh(n, n)``), P1;
* backward Euler, ``dt = --t-end / steps``: ``(M + dt K) u_{k+1} = M u_k + dt M q``;
* loss ``J(q) = 1/2 int (u_N - d)^2 dx`` with ``d = x y`` (``1/2 e^T M e``), control the nodal
  source ``q`` (at ``exp(-|x - (0.3, 0.6)|^2 / 0.02)``), its gradient ``dJ/dq_i`` (dolfin-adjoint's
  l2 representation);
* the gradients compared through ``dJ/dq . dq`` (``dq = cos(3x) y + 1/2``) and ``|dJ/dq|_2``,
  with each other and with a central difference of each side's own ``J`` (``h = 1e-4``);
* ``--control conductivity``: the control is instead a cellwise conductivity
  ``kappa (1 + 0.5 sin(3x) cos(2y))`` at the centroids (DOLFIN: a DG0 Function), the source fixed at
  ``q0``, gradients compared through ``dJ/dk . dk`` (``dk`` the same formula as ``dq``, per cell).
  ``K``'s values then need a gradient, so slasolve's adjoint reads the forward states and with
  snapshots recomputes them (``recompute_factor`` in the output); with ``--control source`` its
  adjoint reads no state and recomputes nothing.

slasolve: ``LinearTimeProblem(M, K, source=M q, scheme="be", method="direct")`` (one MUMPS
factorisation for every forward and adjoint step), with ``--compare-snapshots`` snapshots (what
a user sets for a long run) and with full storage. dolfin-adjoint: ``solve(a == L, u)`` with
MUMPS each step and ``u_old.assign(u)`` (its tutorials' way), ``compute_gradient`` on the
default tape (pyadjoint 2023.0 has no checkpointing; the releases that do need the renamed
``ufl_legacy``, which Debian's DOLFIN 2019.2 does not use). Every contender runs in its own
process (its own ``mpirun`` at 2 ranks): the peer in its own venv's interpreter, and so that the
peak RSS of one does not include the other's. Each process warms up (3 steps), records its RSS
floor, then times one loss + gradient; the contenders alternate, order flipped each trial, and
the ratios are per trial.

Memory columns (max over ranks): ``peak`` (``ru_maxrss``), ``+extra`` (peak - the warm floor),
``peak over imports`` (peak - RSS after the imports) and ``anon over imports``: the growth of
``RssAnon`` (the heap and anonymous mappings: memory the process itself allocated) from after
the imports to after the gradient, which leaves out the file-backed pages of shared libraries
first touched by the run (torch's kernels: ~22 MiB, the same at 25 unknowns as at 4,225, and
shared between the ranks of a node). Both sides load SuperLU_DIST, which turns glibc's heap
trimming off, so ``RssAnon`` never falls and its value after the gradient is its peak.
``SLASOLVE_BENCH_PROBE=PREFIX`` makes both workers record where the memory is at each phase
(``bench/memory_probe.py``; ``bench/memory_transient.py`` prints the tables).
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


PEER_PYTHON = os.path.join(ROOT, ".venv-dolfin-adjoint", "bin", "python")
PEER_WORKER = os.path.join(HERE, "transient_dolfin_adjoint.py")


def compare_worker(n: int, steps: int, snapshots: int, t_end: float, kappa: float, fd: bool,
                   control: str = "source") -> None:
    """Collective. slasolve's side of --compare (see the module docstring)."""
    import resource

    sys.path.insert(0, HERE)
    from memory_probe import from_env, status_mib
    probe, probe_path = from_env("slasolve" + (f"_{snapshots}" if snapshots else "_full"))
    if probe:
        probe.mark("start")

    import torch
    from mpi4py import MPI

    import slasolve
    from slasolve.fem import Assembler, box_mesh
    from slasolve.timestepping import LinearTimeProblem, integrate

    # the imports' own footprint (the interpreter, torch, petsc4py, mpi4py, slasolve, ...)
    imports_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    imports_anon_mib = status_mib("RssAnon")
    if probe:
        probe.mark("imports")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    V = Assembler(box_mesh(n, cell="triangle", comm=comm))
    M, K = V.mass(), V.stiffness(kappa)
    u0 = V.interpolate(lambda x: torch.sin(torch.pi * x[:, 0]) * x[:, 1])
    q0 = V.interpolate(lambda x: torch.exp(-((x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.6) ** 2) / 0.02))
    d = V.interpolate(lambda x: x[:, 0] * x[:, 1])
    dq = V.interpolate(lambda x: torch.cos(3 * x[:, 0]) * x[:, 1] + 0.5)
    P = LinearTimeProblem(M, K, lambda t, q: M @ q, scheme="be", method="direct")
    ck = None if snapshots == 0 else snapshots
    # --control conductivity: kappa per cell at the centroids, the source fixed at q0; K's values
    # then need a gradient, so the adjoint reads the states (snapshots recomputed)
    c = V.cell_coords.mean(1)
    k0 = kappa * (1 + 0.5 * torch.sin(3 * c[:, 0]) * torch.cos(2 * c[:, 1]))
    dk = torch.cos(3 * c[:, 0]) * c[:, 1] + 0.5
    m0, dm = (k0, dk) if control == "conductivity" else (q0, dq)

    def loss(m, N, **kw):
        if control == "conductivity":
            Pk = LinearTimeProblem(M, V.stiffness(m), lambda t, q: M @ q, scheme="be", method="direct")
            u = integrate(Pk, u0, q0, dt=t_end / N, n_steps=N, checkpoints=ck, **kw)
        else:
            u = integrate(P, u0, m, dt=t_end / N, n_steps=N, checkpoints=ck, **kw)
        info = None
        if isinstance(u, tuple):
            u, info = u
        e = u - d
        return 0.5 * slasolve.global_sum((e * (M @ e)).sum()), info

    def loss_and_gradient(N):
        m = m0.clone().requires_grad_(True)
        comm.Barrier()
        t0 = time.perf_counter()
        J, info = loss(m, N, return_info=True)
        t1 = time.perf_counter()
        if probe:
            probe.mark(f"forward {N}")
        J.backward()
        t2 = time.perf_counter()
        if probe:
            probe.mark(f"backward {N}")
        return {"loss": float(J.detach()), "g_dot_dq": float(slasolve.global_sum((m.grad * dm).sum())),
                "g_norm": float(slasolve.global_sum((m.grad * m.grad).sum())) ** 0.5,
                "forward_s": t1 - t0, "gradient_s": t2 - t1, "info": info}

    def max_over_ranks(x):
        return comm.allreduce(x, op=MPI.MAX)

    if probe:
        probe.mark("setup")
    loss_and_gradient(3)
    comm.Barrier()
    floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    res = loss_and_gradient(steps)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    # private memory (heap, anonymous mmap) only, not the library pages first touched by the run
    # (file-backed, shared between processes); the heap is never trimmed in this PETSc build
    # (bench/memory_probe.py), so RssAnon now is its peak
    anon_over_imports = status_mib("RssAnon") - imports_anon_mib
    if probe:
        probe.dump(probe_path)
    info = res.pop("info")
    res["wall_s"] = max_over_ranks(res["forward_s"] + res["gradient_s"])
    res["forward_s"], res["gradient_s"] = max_over_ranks(res["forward_s"]), max_over_ranks(res["gradient_s"])
    res["peak_mib_max_rank"] = max_over_ranks(peak)
    res["extra_peak_mib_max_rank"] = max_over_ranks(peak - floor)
    res["imports_mib_max_rank"] = max_over_ranks(imports_mib)
    res["over_imports_mib_max_rank"] = max_over_ranks(peak - imports_mib)
    res["anon_over_imports_mib_max_rank"] = max_over_ranks(anon_over_imports)
    # the steps alone (no recomputation with full storage): info's forward sweep and backward
    res["forward_s_per_step"] = max_over_ranks(info.forward_time) / steps
    res["adjoint_s_per_step"] = (max_over_ranks(info.backward_time) / steps) if ck is None else None
    res["recompute_factor"] = info.recompute_factor
    if fd:
        h = 1e-4
        with torch.no_grad():
            res["fd"] = float((loss(m0 + h * dm, steps)[0] - loss(m0 - h * dm, steps)[0]) / (2 * h))
    if comm.rank == 0:
        res.update({"contender": "slasolve " + (f"{snapshots} snapshots" if ck else "full storage"),
                    "ranks": comm.size, "nodes": V.n_global_dofs, "steps": steps,
                    "versions": {"slasolve": getattr(slasolve, "__version__", "?"), "torch": torch.__version__}})
        print("RESULT " + json.dumps(res), flush=True)


def peer_available() -> str:
    """Local. Why dolfin-adjoint cannot run ("" when it can)."""
    if not os.path.exists(PEER_PYTHON):
        return f"{PEER_PYTHON} not found (run bash bench/install_peers.sh)"
    r = subprocess.run([PEER_PYTHON, "-c", "import dolfin, dolfin_adjoint"], capture_output=True, text=True)
    if r.returncode != 0:
        return "the peer venv cannot import dolfin / dolfin_adjoint: " + (r.stderr.strip().splitlines() or ["?"])[-1]
    return ""


def _launch(cmd, ranks, env):
    if ranks > 1:
        cmd = ["timeout", "1800", "mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + \
              (["--allow-run-as-root"] if os.geteuid() == 0 else []) + cmd
    r = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    return json.loads(next(line for line in r.stdout.splitlines() if line.startswith("RESULT "))[7:])


def compare(a) -> dict:
    """Local. --compare: slasolve (snapshots, full storage) and dolfin-adjoint, alternated."""
    import statistics
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    why = peer_available()
    if why:
        print(f"dolfin-adjoint skipped: {why}", flush=True)
    peer_env = dict(env, PYTHONPATH="")   # the peer's own venv: no slasolve, no torch
    base = [str(a.n), str(a.compare_steps[0])]
    contenders = {f"slasolve {a.compare_snapshots} snapshots":
                  lambda fd: [sys.executable, __file__, "--compare-worker", *base, str(a.compare_snapshots),
                              str(a.t_end), str(a.kappa), str(int(fd)), a.control],
                  "slasolve full storage":
                  lambda fd: [sys.executable, __file__, "--compare-worker", *base, "0", str(a.t_end), str(a.kappa),
                              str(int(fd)), a.control]}
    if a.no_full_storage:
        del contenders["slasolve full storage"]
    if a.baseline:
        # the same worker (this file) importing another checkout's slasolve: before / after in one run
        contenders[f"baseline {a.compare_snapshots} snapshots"] = contenders[f"slasolve {a.compare_snapshots} snapshots"]
        if not a.no_full_storage:
            contenders["baseline full storage"] = contenders["slasolve full storage"]
    base_env = dict(env, PYTHONPATH=(a.baseline or "") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not why:
        contenders["dolfin-adjoint"] = lambda fd: [PEER_PYTHON, PEER_WORKER, base[0], base[1], str(a.t_end),
                                                   str(a.kappa), "--control", a.control] + (["--fd"] if fd else [])
    out = {"problem": {"n": a.n, "steps": a.compare_steps[0], "t_end": a.t_end, "kappa": a.kappa,
                       "scheme": "backward Euler", "element": "P1 triangles", "snapshots": a.compare_snapshots,
                       "control": a.control},
           "machine": {"cores": os.cpu_count(), "load_average_at_start": os.getloadavg()},
           "peer_skipped": why or None, "baseline": a.baseline, "runs": []}
    names = list(contenders)
    for ranks in a.ranks:
        rows = {k: [] for k in names}
        for trial in range(a.trials):
            order = names if trial % 2 == 0 else names[::-1]
            for name in order:
                fd = trial == 0 and not a.no_fd
                r = _launch(contenders[name](fd), ranks, peer_env if name == "dolfin-adjoint" else
                            base_env if name.startswith("baseline") else env)
                rows[name].append(r)
                print(f"ranks {ranks} trial {trial} {name:>24}: {r['wall_s']:.2f} s (forward {r['forward_s']:.2f}, "
                      f"gradient {r['gradient_s']:.2f}), peak {r['peak_mib_max_rank']:.0f} MiB "
                      f"(+{r['extra_peak_mib_max_rank']:.1f}), J {r['loss']:.12e}, dJ.dq {r['g_dot_dq']:.12e}"
                      + (f", FD {r['fd']:.12e}" if "fd" in r else ""), flush=True)
        summary = {"ranks": ranks, "contenders": {}}
        for name in names:
            rs = rows[name]
            summary["contenders"][name] = {
                "wall_s_median": statistics.median(r["wall_s"] for r in rs),
                "peak_mib_max_rank": max(r["peak_mib_max_rank"] for r in rs),
                "extra_peak_mib_max_rank": max(r["extra_peak_mib_max_rank"] for r in rs),
                "imports_mib_max_rank": max(r.get("imports_mib_max_rank", float("nan")) for r in rs),
                "over_imports_mib_max_rank": max(r.get("over_imports_mib_max_rank", float("nan")) for r in rs),
                "anon_over_imports_mib_max_rank": max(r.get("anon_over_imports_mib_max_rank", float("nan"))
                                                      for r in rs),
                "loss": rs[0]["loss"], "g_dot_dq": rs[0]["g_dot_dq"], "g_norm": rs[0]["g_norm"],
                "fd": rs[0].get("fd"),
                "fd_rel_err": abs(rs[0]["g_dot_dq"] - rs[0]["fd"]) / abs(rs[0]["fd"]) if "fd" in rs[0] else None,
                "forward_s_per_step": rs[0].get("forward_s_per_step"),
                "adjoint_over_forward_step": [r["adjoint_s_per_step"] / r["forward_s_per_step"] for r in rs
                                              if r.get("adjoint_s_per_step")],
                "recompute_factor": rs[0].get("recompute_factor"), "versions": rs[0].get("versions"),
                "trials": rs}
        if "dolfin-adjoint" in rows:
            da = rows["dolfin-adjoint"]
            for name in names[:-1]:
                c = summary["contenders"][name]
                t = [r["wall_s"] / p["wall_s"] for r, p in zip(rows[name], da)]
                c["time_ratio_vs_dolfin_adjoint"] = {"median": statistics.median(t), "min": min(t), "max": max(t)}
                c["peak_ratio_vs_dolfin_adjoint"] = (c["peak_mib_max_rank"]
                                                     / summary["contenders"]["dolfin-adjoint"]["peak_mib_max_rank"])
                c["over_imports_ratio_vs_dolfin_adjoint"] = (
                    c["over_imports_mib_max_rank"] / summary["contenders"]["dolfin-adjoint"]["over_imports_mib_max_rank"])
                c["anon_over_imports_ratio_vs_dolfin_adjoint"] = (
                    c["anon_over_imports_mib_max_rank"]
                    / summary["contenders"]["dolfin-adjoint"]["anon_over_imports_mib_max_rank"])
                c["extra_peak_ratio_vs_dolfin_adjoint"] = (
                    c["extra_peak_mib_max_rank"] / summary["contenders"]["dolfin-adjoint"]["extra_peak_mib_max_rank"])
                pd = summary["contenders"]["dolfin-adjoint"]
                c["loss_rel_diff_vs_dolfin_adjoint"] = abs(c["loss"] - pd["loss"]) / abs(pd["loss"])
                c["grad_rel_diff_vs_dolfin_adjoint"] = abs(c["g_dot_dq"] - pd["g_dot_dq"]) / abs(pd["g_dot_dq"])
                c["grad_norm_rel_diff_vs_dolfin_adjoint"] = abs(c["g_norm"] - pd["g_norm"]) / abs(pd["g_norm"])
        for name in names:
            twin = "baseline" + name[len("slasolve"):]
            if name.startswith("slasolve") and twin in rows:
                t = [r["wall_s"] / b["wall_s"] for r, b in zip(rows[name], rows[twin])]
                summary["contenders"][name]["time_ratio_vs_baseline"] = {"median": statistics.median(t),
                                                                         "min": min(t), "max": max(t)}
        out["runs"].append(summary)
        _print_compare(summary)
    return out


def _print_compare(s: dict) -> None:
    print(f"\n{s['ranks']} rank(s): median wall (loss + gradient), max RSS per rank (extra over the warm floor)")
    for name, c in s["contenders"].items():
        line = (f"  {name:>24}: {c['wall_s_median']:7.2f} s, {c['peak_mib_max_rank']:6.0f} MiB "
                f"(+{c['extra_peak_mib_max_rank']:.1f}; imports {c['imports_mib_max_rank']:.0f}, "
                f"peak over imports +{c['over_imports_mib_max_rank']:.0f}, anon over imports "
                f"+{c['anon_over_imports_mib_max_rank']:.1f})")
        if "time_ratio_vs_dolfin_adjoint" in c:
            line += (f"; vs dolfin-adjoint: time {c['time_ratio_vs_dolfin_adjoint']['median']:.3f}x, peak "
                     f"{c['peak_ratio_vs_dolfin_adjoint']:.2f}x "
                     f"(extra {c['extra_peak_ratio_vs_dolfin_adjoint']:.2f}x, over imports "
                     f"{c['over_imports_ratio_vs_dolfin_adjoint']:.2f}x, anon over imports "
                     f"{c['anon_over_imports_ratio_vs_dolfin_adjoint']:.2f}x), "
                     f"dJ.dq rel diff {c['grad_rel_diff_vs_dolfin_adjoint']:.1e}")
        if "time_ratio_vs_baseline" in c:
            line += f"; time vs baseline {c['time_ratio_vs_baseline']['median']:.3f}x"
        if c["fd_rel_err"] is not None:
            line += f"; |dJ.dq - FD| / |FD| {c['fd_rel_err']:.1e}"
        if c.get("recompute_factor"):
            line += f"; recompute factor {c['recompute_factor']:.2f}"
        if c["adjoint_over_forward_step"]:
            r = c["adjoint_over_forward_step"]
            line += f"; adjoint/forward step {min(r):.2f}-{max(r):.2f}"
        print(line, flush=True)


def main() -> None:
    import argparse
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--n", type=int, default=100)
    p.add_argument("--steps", type=int, nargs="+", default=[1000])
    p.add_argument("--snapshots", type=int, nargs="+", default=[0, 5, 20, 50], help="0: full storage")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", nargs=3, type=int, help=argparse.SUPPRESS)
    p.add_argument("--compare", action="store_true", help="side by side with dolfin-adjoint (module docstring)")
    p.add_argument("--compare-steps", type=int, nargs=1, default=[100])
    p.add_argument("--compare-snapshots", type=int, default=10)
    p.add_argument("--t-end", type=float, default=0.5)
    p.add_argument("--kappa", type=float, default=0.1)
    p.add_argument("--trials", type=int, default=2)
    p.add_argument("--no-fd", action="store_true", help="--compare without the finite differences (long runs)")
    p.add_argument("--no-full-storage", action="store_true", help="--compare without slasolve's full storage run")
    p.add_argument("--baseline", default=None, metavar="ROOT",
                   help="--compare: also run another checkout's slasolve (e.g. /work/main), alternated")
    p.add_argument("--control", choices=["source", "conductivity"], default="source",
                   help="--compare: the control (conductivity: the snapshots are recomputed)")
    p.add_argument("--compare-worker", nargs=7, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.worker:
        worker(*a.worker)
        return
    if a.compare_worker:
        w = a.compare_worker
        compare_worker(int(w[0]), int(w[1]), int(w[2]), float(w[3]), float(w[4]), bool(int(w[5])), w[6])
        return
    if a.compare:
        out = compare(a)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(out, f, indent=1)
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
