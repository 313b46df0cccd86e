"""Peak resident memory per rank of a 1M-unknown 2-D Poisson CG solve: slasolve vs raw petsc4py.

Run (not under mpirun; it launches the workers itself):
``python bench/memory.py [--ranks 1 2] [--nx 1000] [--json out.json]``.

Every contender runs in its own ``mpirun -n P`` job so peaks never mix. A
worker records ``getrusage(RUSAGE_SELF).ru_maxrss`` after its imports (the
*floor*: Python + numpy + torch + mpi4py + petsc4py, the same for every worker,
because all import ``bench/common.py``) and after the solve (the *peak*); the
difference is what the matrix, vectors, solver and preconditioner cost.

Workers (all CG, rtol 1e-6, unpreconditioned residual):
  sla_petsc_gamg    slasolve.solve(dA, b, backend="petsc", pc="gamg")
  raw_petsc_gamg    petsc4py Mat (createAIJ from the same CSR) + KSP cg/gamg
  sla_torch_jacobi  slasolve.solve(dA, b, backend="torch", pc="jacobi"), 300 iterations
  raw_petsc_jacobi  petsc4py KSP cg/jacobi, 300 iterations
  sla_petsc_jacobi  slasolve.solve(dA, b, backend="petsc", pc="jacobi"), 300 iterations
(Jacobi runs are capped at 300 iterations: CG's memory does not grow with iterations.)

Each contender runs twice, in separate jobs:

* the **peak** run (above): the process as a user runs it.
* the **phases** run (``--phases``): after the input CSR arrays are generated, freed memory
  is given back (``malloc_trim(0)``) and the peak is reset (``/proc/self/clear_refs``), so
  ``build`` = peak RSS while the matrix is built (``from_local_rows`` / ``createAIJ``, the
  input arrays alive) minus the floor, and ``steady`` = RSS after the solve, again trimmed,
  minus the floor (the matrix, caches, solver and vectors still held). ``build/steady`` is
  the construction overshoot.

Why trimming matters here: Debian's PETSc loads SuperLU_DIST, whose library constructor
calls ``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, -1)``; after
``import petsc4py.PETSc`` glibc never returns freed memory to the system, so RSS is the
high-water mark of live memory (plus fragmentation) and every temporary counts in the
peak. ``bench/memory_breakdown.py`` lists what is held, array by array.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WORKERS = ("raw_petsc_gamg", "sla_petsc_gamg", "raw_petsc_jacobi", "sla_torch_jacobi", "sla_petsc_jacobi")


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _trim_and_reset() -> None:
    """Give freed heap memory back (glibc) and reset the peak RSS (Linux >= 4.0)."""
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(kind: str, nx: int, phases: bool = False) -> None:
    sys.path.insert(0, HERE)
    from common import COMM, RANK, build_dpoisson2d, build_petsc_poisson2d, maxrss_mib, rhs_local, split_offsets
    import slasolve.krylov  # noqa: F401  (same imports in every worker)
    from petsc4py import PETSc
    floor = maxrss_mib()
    floor_split = (_status_mib("RssAnon"), _status_mib("RssFile"))
    n = nx * nx
    its = None
    build = None
    if kind.startswith("sla"):
        from slasolve.krylov import solve
        dA, _ = build_dpoisson2d(nx, before_build=_trim_and_reset if phases else None)
        build = _status_mib("VmHWM")
        r0, r1 = dA.row_range
        b = rhs_local(r1 - r0, r0)
        if kind == "sla_petsc_gamg":
            x, info = solve(dA, b, "cg", backend="petsc", pc="gamg", rtol=1e-6, return_info=True)
        elif kind == "sla_petsc_jacobi":
            x, info = solve(dA, b, "cg", backend="petsc", pc="jacobi", rtol=1e-30, maxiter=300,
                            return_info=True, raise_on_fail=False)
        else:
            x, info = solve(dA, b, "cg", backend="torch", pc="jacobi", rtol=1e-30, maxiter=300,
                            return_info=True, raise_on_fail=False)
        its = info.iterations
    else:
        A, _ = build_petsc_poisson2d(nx, before_build=_trim_and_reset if phases else None)
        build = _status_mib("VmHWM")
        offs = split_offsets(n)
        b = A.createVecLeft()
        b.getArray()[:] = rhs_local(int(offs[RANK + 1] - offs[RANK]), int(offs[RANK])).numpy()
        x = A.createVecRight()
        ksp = PETSc.KSP().create(comm=COMM)
        ksp.setOperators(A)
        ksp.setType("cg")
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        if kind == "raw_petsc_gamg":
            ksp.getPC().setType("gamg")
            ksp.setTolerances(rtol=1e-6, atol=0.0)
        else:
            ksp.getPC().setType("jacobi")
            ksp.setTolerances(rtol=1e-30, atol=0.0, max_it=300)
        ksp.solve(b, x)
        its = ksp.getIterationNumber()
    peak = maxrss_mib()
    # private (anonymous) vs file-backed growth: the file-backed part is shared-library code
    # first touched by the run (torch's kernels: a fixed few MiB, shared by all ranks on a node);
    # the heap is never trimmed in this build, so RssAnon after the solve is its high-water mark
    row = {"rank": RANK, "floor_mib": floor, "peak_mib": peak, "iterations": its,
           "anon_mib": _status_mib("RssAnon") - floor_split[0], "file_mib": _status_mib("RssFile") - floor_split[1]}
    if phases:
        _trim_and_reset()
        row = {"rank": RANK, "floor_mib": floor, "build_mib": build, "steady_mib": _status_mib("VmRSS"),
               "iterations": its}
    rows = COMM.gather(row, root=0)
    if RANK == 0:
        print("RESULT " + json.dumps({"kind": kind, "nx": nx, "ranks": COMM.Get_size(), "per_rank": rows}),
              flush=True)


def launch(kind: str, nx: int, ranks: int, timeout: int = 300, phases: bool = False) -> dict:
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMP_NUM_THREADS="1")
    cmd = ["mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none", sys.executable,
           os.path.abspath(__file__), "--worker", kind, "--nx", str(nx)] + (["--phases"] if phases else [])
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "ranks": ranks, "nx": nx, "error": f"timeout {timeout}s"}
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {"kind": kind, "ranks": ranks, "nx": nx, "error": (p.stderr or p.stdout)[-2000:]}


def main():
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", choices=WORKERS)
    ap.add_argument("--nx", type=int, default=None)
    ap.add_argument("--ranks", type=int, nargs="*", default=[1, 2])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", action="store_true", help="(worker) trimmed build / steady-state run")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    nx = a.nx or (300 if a.quick else 1000)
    if a.worker:
        worker(a.worker, nx, a.phases)
        return
    results = []
    print(f"# memory: 2-D Poisson n={nx * nx}, CG, peak RSS per rank (MiB), each contender its own mpirun job")
    print(f"{'contender':<18} {'ranks':>5} {'floor':>8} {'peak':>8} {'peak-floor':>10} {'x raw':>6} "
          f"{'build':>7} {'steady':>7} {'build/steady':>12} {'its':>5}")
    for P in a.ranks:
        incs = {}
        for kind in WORKERS:
            r = launch(kind, nx, P)
            ph = launch(kind, nx, P, phases=True)
            results.append(r)
            if "error" in r or "error" in ph:
                print(f"{kind:<18} {P:>5}  FAILED: {r.get('error', ph.get('error'))[-300:]}")
                continue
            pr, pp = r["per_rank"], ph["per_rank"]
            fl = max(x["floor_mib"] for x in pr)
            pk = max(x["peak_mib"] for x in pr)
            inc = incs[kind] = max(x["peak_mib"] - x["floor_mib"] for x in pr)
            build = max(x["build_mib"] - x["floor_mib"] for x in pp)
            steady = max(x["steady_mib"] - x["floor_mib"] for x in pp)
            raw = incs.get("raw_petsc" + kind[kind.rindex("_"):])
            r.update(floor_mib=fl, peak_mib=pk, increment_mib=inc, build_mib=build, steady_mib=steady)
            ratio = f"{inc / raw:>6.2f}" if raw else f"{'':>6}"
            print(f"{kind:<18} {P:>5} {fl:>8.1f} {pk:>8.1f} {inc:>10.1f} {ratio} {build:>7.1f} {steady:>7.1f} "
                  f"{build / steady:>12.2f} {pr[0]['iterations']:>5}", flush=True)
    if a.json:
        sys.path.insert(0, HERE)
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump({"bench": "memory", "nx": nx, "n": nx * nx, "results": results,
                       "note": "max over ranks; floor = after imports; RSS in MiB (ru_maxrss)"}, f, indent=1)


if __name__ == "__main__":
    main()
