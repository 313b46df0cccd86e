"""Parallel mesh read + partition + distribution: time, peak memory per rank, edge cut.

Run (not under mpirun; it launches the workers itself):
``python bench/mesh_io.py [--n 96] [--ranks 1 2 4 8] [--json out.json]``.

1. ``--n`` cubes per side of the unit cube, 6 Kuhn tetrahedra each (``--n 96``: 5.3M
   tetrahedra, 0.9M nodes), generated once in parallel (``box_mesh``) and written with
   ``write_xdmf`` (``$SLASOLVE_BENCH_CACHE`` or the temporary folder,
   ``slasolve_mesh_io_n<n>.xdmf`` + ``.h5``; reused when present).
2. For every rank count P, one ``mpirun -n P`` job per partitioner (so peaks never mix):
   ``read_mesh(path, partition=...)`` with ``"ptscotch"`` (PT-Scotch, the default for file
   meshes) and ``"metis"`` (the dual graph gathered on rank 0 and cut by serial METIS: the
   reference edge cut). Each rank records its RSS after the imports (the floor) and its peak
   after the read (``ru_maxrss``); the table shows the largest peak-minus-floor over the
   ranks, the time of the read (slowest rank), the edge cut and the imbalance
   (``partition_quality``).
3. When ``dolfinx`` is importable, the same file read with DOLFINx's ``XDMFFile.read_mesh``
   (default partitioner), same P, for the time side by side; otherwise reported as absent.
   With ``--trials T`` every contender runs T times per P, in alternated order (reversed every
   other trial, so load drift falls on both sides), and the time ratio slasolve (the first
   method) / DOLFINx is taken per trial, adjacent runs paired: the median and min-max are
   printed and kept in the JSON (``ratios``).

The memory measured is the mesh path only: P=1's peak-minus-floor is the serial read's
peak; the target is ``<= 2.5/P`` of it at P = 8. Oversubscribed runs (P > cores) measure
memory and edge cut faithfully, time only roughly.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

WORKER = r'''
import json, os, resource, sys, time
sys.path.insert(0, {root!r})
os.environ.setdefault("OMP_NUM_THREADS", "1")
from mpi4py import MPI
import numpy as np
import torch
torch.set_num_threads(1)
kind, path, method, out = sys.argv[1:5]
comm = MPI.COMM_WORLD
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
if kind == "slasolve":
    from slasolve.fem import read_mesh, partition_quality
    try:
        from petsc4py import PETSc  # noqa: F401  (the floor includes PETSc for every method)
    except ImportError:
        pass
    floor = rss()
    comm.Barrier(); t0 = time.perf_counter()
    mesh = read_mesh(path, comm=comm, partition=method)
    t = time.perf_counter() - t0
    peak = rss()
    q = partition_quality(mesh)
    rec = dict(time=comm.allreduce(t, op=MPI.MAX), floor=comm.gather(floor), peak=comm.gather(peak),
               edge_cut=q.edge_cut, imbalance=q.load_imbalance, cells=mesh.n_global_cells)
else:
    from dolfinx.io import XDMFFile
    floor = rss()
    comm.Barrier(); t0 = time.perf_counter()
    with XDMFFile(comm, path, "r") as f:
        mesh = f.read_mesh(name="mesh")
    t = time.perf_counter() - t0
    peak = rss()
    rec = dict(time=comm.allreduce(t, op=MPI.MAX), floor=comm.gather(floor), peak=comm.gather(peak))
if comm.rank == 0:
    with open(out, "w") as fh:
        json.dump(rec, fh)
'''

GENERATE = r'''
import sys
sys.path.insert(0, {root!r})
from slasolve.fem import box_mesh, write_xdmf
n, path = int(sys.argv[1]), sys.argv[2]
write_xdmf(path, box_mesh((n, n, n), cell="tetra"))
'''


def mpirun(n: int, args, timeout: int):
    cmd = ["mpirun", "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    env = dict(os.environ, OMP_NUM_THREADS="1", OMPI_MCA_mpi_yield_when_idle="1")
    return subprocess.run(cmd + [sys.executable] + args, env=env, timeout=timeout, capture_output=True, text=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=96, help="cubes per side (6 n^3 tetrahedra; 96: 5.3M)")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--methods", nargs="+", default=["ptscotch", "metis"])
    p.add_argument("--gen-ranks", type=int, default=2, help="ranks that generate and write the mesh")
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--trials", type=int, default=1, help="runs per contender and P, alternated")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    cache = os.environ.get("SLASOLVE_BENCH_CACHE", tempfile.gettempdir())
    path = os.path.join(cache, f"slasolve_mesh_io_n{a.n}.xdmf")
    tmp = tempfile.mkdtemp(prefix="slasolve-mesh-io-")
    gen = os.path.join(tmp, "generate.py")
    work = os.path.join(tmp, "worker.py")
    with open(gen, "w") as fh:
        fh.write(GENERATE.format(root=ROOT))
    with open(work, "w") as fh:
        fh.write(WORKER.format(root=ROOT))
    if not os.path.exists(path):
        r = mpirun(a.gen_ranks, [gen, str(a.n), path], a.timeout)
        if r.returncode:
            sys.exit(f"generating the mesh failed:\n{r.stdout}\n{r.stderr}")
    try:
        import importlib.util
        have_dolfinx = importlib.util.find_spec("dolfinx") is not None
    except ValueError:
        have_dolfinx = False
    rows, ratios = [], {}
    jobs = [("slasolve", m) for m in a.methods] + ([("dolfinx", "default")] if have_dolfinx else [])
    for n in a.ranks:
        for trial in range(a.trials):
            times = {}
            for kind, method in (jobs if trial % 2 == 0 else jobs[::-1]):
                out = os.path.join(tmp, f"{kind}_{method}_{n}_{trial}.json")
                r = mpirun(n, [work, kind, path, method, out], a.timeout)
                if r.returncode or not os.path.exists(out):
                    print(f"P={n} {kind} {method}: FAILED\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}", flush=True)
                    continue
                rec = json.load(open(out))
                rec.update(P=n, kind=kind, method=method, trial=trial,
                           mesh_mib=max(pk - fl for pk, fl in zip(rec["peak"], rec["floor"])))
                rows.append(rec)
                times[kind, method] = rec["time"]
                print(f"P={n:2d} {kind:8s} {method:8s} read {rec['time']:8.2f} s  mesh memory/rank "
                      f"{rec['mesh_mib']:8.1f} MiB  edge cut {rec.get('edge_cut', '-')}  "
                      f"imbalance {rec.get('imbalance', float('nan')):.3f}", flush=True)
            first = ("slasolve", a.methods[0])
            if first in times and ("dolfinx", "default") in times:
                ratios.setdefault(n, []).append(times[first] / times["dolfinx", "default"])
    if ratios:
        print(f"\n  P  read time slasolve ({a.methods[0]}) / DOLFINx, per trial: median (min-max)")
        for n, rs in ratios.items():
            rs = sorted(rs)
            print(f"{n:3d}  {rs[len(rs) // 2] if len(rs) % 2 else 0.5 * (rs[len(rs) // 2 - 1] + rs[len(rs) // 2]):.2f}"
                  f" ({rs[0]:.2f}-{rs[-1]:.2f}), {len(rs)} trials")
    first_trial = [r for r in rows if r["trial"] == 0]
    serial = {r["method"]: r["mesh_mib"] for r in first_trial if r["P"] == 1 and r["kind"] == "slasolve"}
    for r in rows:
        if r["kind"] == "slasolve" and r["method"] in serial:
            r["memory_vs_serial_times_P"] = r["mesh_mib"] / serial[r["method"]] * r["P"]
    metis = {r["P"]: r["edge_cut"] for r in first_trial if r["method"] == "metis"}
    for r in rows:
        if r["method"] == "ptscotch" and metis.get(r["P"]):
            r["edge_cut_vs_metis"] = r["edge_cut"] / metis[r["P"]]
    print("\n  P  method    mem/rank x P / serial   edge cut / METIS   (first trial)")
    for r in first_trial:
        if r["kind"] == "slasolve":
            print(f"{r['P']:3d}  {r['method']:8s}  {r.get('memory_vs_serial_times_P', float('nan')):10.2f}"
                  f"             {r.get('edge_cut_vs_metis', float('nan')):.3f}")
    if not have_dolfinx:
        print("dolfinx: not importable here (optional in bench/): no side-by-side time")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"n": a.n, "rows": rows, "dolfinx": have_dolfinx, "trials": a.trials,
                   "ratios": {str(k): v for k, v in ratios.items()}}, fh, indent=1)


if __name__ == "__main__":
    main()
