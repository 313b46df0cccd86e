"""Preconditioner reuse in an optimisation loop: examples/topology_optimisation.py (issue 12).

Run: ``mpirun -n 1 python bench/topopt.py`` and ``mpirun -n 2 ...``
(``--nelx 120 --nely 40``, or ``--nelx 2000 --nely 500`` for 1M elements with fewer
``--iters``).

The SIMP MBB beam (CG + GAMG, ``--rtol``) runs the same ``--iters`` OC iterations
(``--tol 0``: no early stop) once per contender per trial, the contenders alternating
(order flipped every trial, after a warm-up run of each unless ``--no-warmup``), all on one
mesh and filter (1M elements take ~12 GB on one rank), each contender with its own
``options_prefix``, hence its own cached KSP. Contenders are ``slasolve.solve``'s
``reuse_pc`` modes with and without warm starts (``x0="previous"``):

* ``naive``: ``reuse_pc=False``, the default (GAMG rebuilt every OC iteration: what a plain
  PETSc loop does that refills the matrix and calls ``KSPSolve``); its backward takes the
  forward's answer for the self-adjoint compliance (``info.adjoint.same_as_forward``);
* ``naive-2solves``: the same with that shortcut disabled (the adjoint solved again, as a
  plain PETSc loop does and slasolve did before it): what the shortcut saves;
* ``pc``: ``reuse_pc=True`` (kept for good); ``lagged``: kept until the iteration count grows
  by ``LAG_GROWTH`` (a solve past ``LAG_CAP`` x is redone with a rebuilt one);
  ``interpolation``: GAMG prolongators kept, coarse operators and smoothers recomputed;
* ``+warm``: the same with ``x0="previous"`` (forward and adjoint).

Per contender: the per-OC-iteration time (slowest rank) of the compliance evaluation and its
gradient (assembly, solve, adjoint: ``MBB.solve_times``; also its CPU time, ``process_time``,
which a loaded machine disturbs far less than wall time), of the whole OC iteration, the
forward Krylov iterations, the preconditioner builds (``info.pc_reuse``), and the
compliance history, compared with ``naive``'s: the largest relative difference over the
iterations must stay below ``--match`` (default 1e-6; every answer is checked against the
current matrix at ``--rtol``, so the histories agree to the solver tolerance).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, RANK, SIZE, base_parser, fmt_t, rprint, stats, write_json  # noqa: E402

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.krylov.solve import LAG_CAP, LAG_GROWTH  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = {"naive": (False, False), "naive-2solves": (False, False), "pc": (True, False),
              "lagged": ("lagged", False),
              "interpolation": ("interpolation", False), "naive+warm": (False, True),
              "lagged+warm": ("lagged", True), "interpolation+warm": ("interpolation", True)}


def load_example():
    path = os.path.join(ROOT, "examples", "topology_optimisation.py")
    spec = importlib.util.spec_from_file_location("_topology_optimisation", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def coarse_start(topo, nelx, nely, factor, iters, volfrac, rmin, rtol):
    """Collective. A mid-optimisation design for the ``nelx x nely`` mesh: ``iters`` OC
    iterations of the same beam on the ``factor`` times coarser mesh (on every rank alone,
    ``COMM_SELF``: it is small), then each fine element takes the density of the coarse
    element that contains it. Returns this rank's fine densities (the rows of ``cell_range``)
    and the coarse run's last compliance."""
    cx, cy = nelx // factor, nely // factor
    coarse = topo.MBB(cx, cy, rmin=max(1.5, min(0.04 * cx, 4.8)), comm=MPI.COMM_SELF,
                      solve_opts=dict(rtol=rtol))
    xc, hist = topo.optimise(coarse, volfrac, iters, tol=0.0)
    return xc.reshape(cy, cx), hist[-1]


def fine_design(prob, xc):
    """Local. This rank's densities on ``prob``'s mesh from the coarse ``(cy, cx)`` design."""
    cy, cx = xc.shape
    c0, c1 = prob.cell_range
    ids = np.arange(c0, c1)
    iy, ix = ids // prob.nelx, ids % prob.nelx
    jy = np.minimum(iy * cy // prob.nely, cy - 1)
    jx = np.minimum(ix * cx // prob.nelx, cx - 1)
    return xc[jy, jx].clone()


@contextlib.contextmanager
def adjoint_always_solved(on: bool):
    """Local. With ``on``, the backward solves the adjoint system even when it is the forward
    one (``slasolve.solve``'s shortcut for the self-adjoint compliance disabled): what the
    library did before the shortcut, and what a raw PETSc loop does (two KSPSolve)."""
    mod = importlib.import_module("slasolve.krylov.solve")
    real = mod._repeats_forward
    if on:
        mod._repeats_forward = lambda *a: False
    try:
        yield
    finally:
        mod._repeats_forward = real


def run_once(topo, prob, opts, iters, x0=None):
    """Collective. One OC run of ``iters`` iterations on ``prob`` with the solve options
    ``opts`` (each contender has its own ``options_prefix``, hence its own cached KSP on the
    shared mesh, kept between its runs as in a long loop). Returns the record of this run."""
    two = opts.pop("_two_solves", False)
    prob.solve_opts = opts
    n0 = len(prob.infos)
    COMM.Barrier()
    t0 = time.perf_counter()
    with adjoint_always_solved(two):
        _, history = topo.optimise(prob, 0.5, iters, tol=0.0, x0=x0)
    opts["_two_solves"] = two
    wall = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    solve = COMM.allreduce(sum(prob.solve_times), op=MPI.MAX)
    cpu = COMM.allreduce(sum(prob.solve_cpu_times), op=MPI.MAX)
    infos = prob.infos[n0:]
    builds = sum(1 for i in infos if (i.pc_reuse or {"rebuilt": True})["rebuilt"])
    # seconds per OC iteration in the solve's phases (SolveInfo.times; slowest rank per phase)
    keys = ("setup", "solve", "adjoint", "refill", "verify")
    ph = np.array([sum(i.times.get(k, 0.0) for i in infos) / iters for k in keys])
    COMM.Allreduce(MPI.IN_PLACE, ph, op=MPI.MAX)
    return {"history": history, "wall": wall / iters, "solve": solve / iters, "cpu": cpu / iters,
            "iterations": [i.iterations for i in infos], "adjoint_iterations": [i.adjoint.iterations for i in infos],
            "builds": builds, "retries": sum(1 for i in infos if (i.pc_reuse or {}).get("retried")),
            "phases": dict(zip(keys, ph.tolist()))}


def main():
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--nelx", type=int, default=120)
    p.add_argument("--nely", type=int, default=40)
    p.add_argument("--iters", type=int, default=30, help="OC iterations per run")
    p.add_argument("--rmin", type=float, default=None,
                   help="filter radius (default the example's 0.04 nelx, at most 4.8: 1M elements need a small one)")
    p.add_argument("--rtol", type=float, default=1e-8)
    p.add_argument("--match", type=float, default=1e-6, help="largest relative history difference allowed")
    p.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    p.add_argument("--no-warmup", action="store_true", help="no untimed first run (large meshes)")
    p.add_argument("--start-coarse", type=int, default=0, metavar="F",
                   help="start every run from a mid-optimisation design: --start-iters OC iterations on the "
                        "F times coarser mesh, prolonged (default 0: the uniform start)")
    p.add_argument("--start-iters", type=int, default=30)
    args = p.parse_args()
    if args.quick:
        args.nelx, args.nely, args.iters = min(args.nelx, 60), min(args.nely, 20), min(args.iters, 8)
    trials = args.trials or (1 if args.quick else 3)
    if args.rmin is None:
        args.rmin = max(1.5, min(0.04 * args.nelx, 4.8))
    topo = load_example()
    t0 = time.perf_counter()
    prob = topo.MBB(args.nelx, args.nely, rmin=args.rmin, comm=COMM, solve_opts=dict(rtol=args.rtol))
    x0, start = None, "uniform density 0.5"
    if args.start_coarse:
        ts = time.perf_counter()
        xc, cc = coarse_start(topo, args.nelx, args.nely, args.start_coarse, args.start_iters, 0.5, args.rmin,
                              args.rtol)
        x0 = fine_design(prob, xc)
        start = (f"the design after {args.start_iters} OC iterations on the {args.nelx // args.start_coarse} x "
                 f"{args.nely // args.start_coarse} mesh (compliance {cc:.4g}, {time.perf_counter() - ts:.1f} s)")
    opts = {}
    for name in args.contenders:
        reuse, warm = CONTENDERS[name]
        opts[name] = dict(prob.solve_opts, reuse_pc=reuse, x0="previous" if warm else None,
                          options_prefix=name.replace("+", "_").replace("-", "_") + "_",
                          _two_solves=name == "naive-2solves")
    rprint(f"topopt reuse benchmark: MBB {args.nelx} x {args.nely} ({args.nelx * args.nely} elements, "
           f"{2 * (args.nelx + 1) * (args.nely + 1)} dofs), rmin {args.rmin:g}, {SIZE} rank(s), "
           f"CG + GAMG rtol {args.rtol:g}, {args.iters} OC iterations per run, {trials} trial(s), "
           f"LAG_GROWTH {LAG_GROWTH}, LAG_CAP {LAG_CAP} "
           f"(set-up {time.perf_counter() - t0:.1f} s); start: {start}")
    if not args.no_warmup:
        for name in args.contenders:
            run_once(topo, prob, opts[name], min(args.iters, 2), x0)
    runs = {k: [] for k in args.contenders}
    for t in range(trials):
        order = args.contenders if t % 2 == 0 else args.contenders[::-1]
        for name in order:
            runs[name].append(run_once(topo, prob, opts[name], args.iters, x0))
            rprint(f"  trial {t + 1} {name:20s} {fmt_t(runs[name][-1]['solve'])} per OC iteration in solve+gradient")
    ref = runs["naive"][0]["history"] if "naive" in runs else None
    out = {}
    for name in args.contenders:
        rs = runs[name]
        diff = None
        if ref is not None:
            diff = max(max(abs(a - b) / abs(b) for a, b in zip(r["history"], ref)) for r in rs)
        out[name] = {"solve": stats([r["solve"] for r in rs]), "wall": stats([r["wall"] for r in rs]),
                     "cpu": stats([r["cpu"] for r in rs]), "cpu_samples": [r["cpu"] for r in rs],
                     "solve_samples": [r["solve"] for r in rs], "wall_samples": [r["wall"] for r in rs],
                     "iterations": rs[-1]["iterations"], "adjoint_iterations": rs[-1]["adjoint_iterations"],
                     "builds": rs[-1]["builds"], "retries": rs[-1]["retries"],
                     "history": rs[-1]["history"], "max_rel_diff_vs_naive": diff,
                     "phases": {k: stats([r["phases"][k] for r in rs])["median"] for k in rs[-1]["phases"]}}
    if "naive" in out:
        for name in args.contenders:
            pr = [a / b for a, b in zip(out[name]["solve_samples"], out["naive"]["solve_samples"])]
            out[name]["speedup_vs_naive"] = {"median": 1.0 / stats(pr)["median"], "min": 1.0 / stats(pr)["max"],
                                             "max": 1.0 / stats(pr)["min"]}
            pc_ = [a / b for a, b in zip(out[name]["cpu_samples"], out["naive"]["cpu_samples"])]
            out[name]["cpu_speedup_vs_naive"] = {"median": 1.0 / stats(pc_)["median"],
                                                 "min": 1.0 / stats(pc_)["max"], "max": 1.0 / stats(pc_)["min"]}
    ok = all(v["max_rel_diff_vs_naive"] is None or v["max_rel_diff_vs_naive"] <= args.match for v in out.values())
    rprint(f"\n{'contender':20s} {'solve+grad/it':>14s} {'OC it':>10s} {'speedup':>16s} {'CPU/it':>10s} "
           f"{'CPU speedup':>16s} {'Krylov its':>10s} {'PC builds':>9s} {'max rel diff':>12s}")
    for name, v in out.items():
        sp = v.get("speedup_vs_naive")
        spd = "%.2fx (%.2f-%.2f)" % (sp["median"], sp["min"], sp["max"]) if sp else "-"
        cp = v.get("cpu_speedup_vs_naive")
        cpd = "%.2fx (%.2f-%.2f)" % (cp["median"], cp["min"], cp["max"]) if cp else "-"
        d = v["max_rel_diff_vs_naive"]
        rprint(f"{name:20s} {fmt_t(v['solve']['median']):>14s} {fmt_t(v['wall']['median']):>10s} {spd:>16s} "
               f"{fmt_t(v['cpu']['median']):>10s} {cpd:>16s} "
               f"{sum(v['iterations']):10d} {v['builds']:9d} {'-' if d is None else '%.1e' % d:>12s}")
    rprint("\nper OC iteration, slowest rank (SolveInfo.times): PC set-up (forward, retries included), "
           "forward solve, adjoint (solve incl. any set-up), refill, true-residual check")
    for name, v in out.items():
        rprint(f"  {name:20s} " + "  ".join(f"{k} {fmt_t(t)}" for k, t in v["phases"].items()))
    if ref is not None:
        rprint("\ncompliance history (naive | " + " | ".join(n for n in args.contenders if n != "naive") + "):")
        for i, c in enumerate(ref):
            rprint(f"  {i + 1:3d} {c:14.8f} | " + " | ".join(f"{out[n]['history'][i]:14.8f}"
                                                            for n in args.contenders if n != "naive"))
    rprint(f"\nhistories match naive to {args.match:g}: {'yes' if ok else 'NO'}")
    write_json(args.json, {"benchmark": "topopt", "nelx": args.nelx, "nely": args.nely, "iters": args.iters,
                           "rmin": args.rmin, "elements": args.nelx * args.nely, "start": start,
                           "rtol": args.rtol, "ranks": SIZE, "trials": trials, "lag_growth": LAG_GROWTH,
                           "lag_cap": LAG_CAP,
                           "match": args.match, "histories_match": ok, "contenders": out})
    return 0 if ok else 1


if __name__ == "__main__":
    rc = main()
    sys.exit(rc)
