"""Projected CG time per iteration at 8, 32 and 128 ranks, without 128 cores.

Run: ``mpirun -n 2 python bench/scaling_projection.py`` (2 ranks for the
loopback ping-pong; with 1 rank that measurement is skipped).

What is MEASURED here, on this machine:
  * partition quality of the 3-D 7-point Poisson graph (default 160^3 = 4.1M
    unknowns) cut into P = 8, 32, 128 parts by every partitioner of
    ``slasolve.partition`` (contiguous, rcb, hilbert, metis): halo (ghost rows)
    per rank, neighbours per rank, load imbalance, edge cut -- exact counts;
  * per-rank compute time of one CG + Jacobi iteration on a local block of
    ``ceil(N/P)`` rows of that matrix (one thread, ``COMM_SELF``, no
    communication), for raw PETSc and the slasolve torch backend, and the local
    matvec alone;
  * the loopback MPI ping-pong between 2 ranks on this machine (latency alpha
    and bandwidth beta fitted to t(m) = alpha + m / beta).

What is MODELLED (alpha-beta model, stated values):
  T_iter(P) = T_compute(rows_max, nnz_max)                        [measured rate]
            + max_rank( nbr_r * alpha + 8 * halo_r / beta )      [halo exchange]
            + 3 * ceil(log2 P) * (alpha + 8 / beta)              [3 allreduces]
  CG with the unpreconditioned norm (slasolve's and this benchmark's PETSc
  setting) does one matvec (one halo exchange) and three global reductions
  (<r,z>, <p,Ap>, ||r||) per iteration; allreduce of one double modelled as
  recursive doubling. Compute scales with the busiest rank's nonzeros
  (max part size x mean nnz/row). Not modelled: memory-bandwidth sharing
  between ranks of a node (a real 64-core node gives each core less
  bandwidth than this idle-ish core has), OS noise, network contention.

  Interconnect assumed for the cluster projection: alpha = 2.0 us,
  beta = 10 GB/s per rank -- typical MPI small-message latency (1-2 us) and a
  conservative share of an HDR InfiniBand link (200 Gb/s = 25 GB/s per node,
  shared by the ranks of a node sending at once). The measured loopback
  values are also used, as an optimistic all-on-one-node scenario.

MEASURED memory per rank past 2 ranks (``--memory``; run it NOT under mpirun: it
launches one ``mpirun -n P --oversubscribe`` job per contender and P itself):
``python bench/scaling_projection.py --memory [--ranks 1 2 4 8 16] [--rows-per-rank 125000]``.
A weak-scaling series: the 2-D 5-point Poisson matrix on an ``nx x nx`` grid with
``nx = round(sqrt(rows_per_rank * P))`` (125k rows per rank within 0.3% at P = 1..16),
the contenders of ``bench/memory.py`` (slasolve petsc CG+GAMG and CG+Jacobi, torch
CG+Jacobi, raw petsc4py CG+GAMG and CG+Jacobi; Jacobi capped at 300 iterations), each
in its own job, measured exactly as there: per rank, ``ru_maxrss`` after the solve
minus ``ru_maxrss`` after the imports (the floor). ``bench/memory.py``'s own worker and
launcher run every job (``memory.launch``); this mode only picks the sizes and
summarises. Memory does not depend on timing, so oversubscribing 16 ranks on 2 cores
measures it faithfully. What it shows: the increment per rank stays flat in P (a
global-size array would add ``8 N`` bytes per rank at P ranks: at 16 ranks and 125k
rows per rank one float64 global vector is 15 MiB, listed as ``global_vec_mib``) and
its ratio to raw PETSc doing the same solve.
"""
from __future__ import annotations

import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
#: ``--memory`` launches its own mpirun jobs: MPI must stay uninitialised in this process
MEMORY_MODE = __name__ == "__main__" and "--memory" in sys.argv[1:]
if not MEMORY_MODE:
    from common import (COMM, RANK, SIZE, base_parser, poisson3d_block, poisson3d_rows, quiet_barrier,  # noqa: E402
                        rprint, stats, write_json)
    from mpi4py import MPI  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ASSUMED = {"alpha_s": 2.0e-6, "beta_Bps": 10.0e9,
           "why": "typical MPI latency over InfiniBand (1-2 us); ~10 GB/s per rank = a share of an "
                  "HDR 200 Gb/s (25 GB/s) node link"}


def pingpong(reps: int = 50):
    """Collective (2+ ranks; ranks > 1 idle). Loopback ping-pong rank 0 <-> 1."""
    sizes = [8, 64, 512, 4096, 32768, 262144, 1 << 21, 1 << 23]
    rows = []
    for m in sizes:
        buf = np.zeros(m // 8, dtype=np.float64)
        ts = []
        for rep in range(reps if m < (1 << 20) else 10):
            if RANK == 0:
                t0 = time.perf_counter()
                COMM.Send(buf, dest=1, tag=5)
                COMM.Recv(buf, source=1, tag=6)
                ts.append((time.perf_counter() - t0) / 2)
            elif RANK == 1:
                COMM.Recv(buf, source=0, tag=5)
                COMM.Send(buf, dest=0, tag=6)
        if RANK == 0:
            rows.append({"bytes": m, "one_way_min_s": float(np.min(ts)), "one_way_median_s": float(np.median(ts))})
    if RANK != 0:
        return None
    # best-of-repetitions (the usual ping-pong convention; this machine is shared, medians
    # include other jobs' scheduling delays and are kept in the JSON)
    m = np.array([r["bytes"] for r in rows], float)
    t = np.array([r["one_way_min_s"] for r in rows])
    alpha = float(np.min(t[m <= 512]))
    beta = float((m[-1] - m[-2]) / max(t[-1] - t[-2], 1e-12))  # slope between the two largest
    return {"alpha_s": alpha, "beta_Bps": beta, "samples": rows,
            "fit": "alpha = min one-way time of messages <= 512 B; beta = slope between 2 MiB and 8 MiB"}


def graph3d(n: int):
    import scipy.sparse as sp
    N = n ** 3
    ip, ix, v = poisson3d_rows(n, 0, N)
    G = sp.csr_matrix((np.ones(ix.size, dtype=np.int8), ix, ip), shape=(N, N))
    G.has_canonical_format = True
    i = np.arange(N)
    coords = np.stack([i % n, (i // n) % n, i // (n * n)], 1).astype(np.float64)
    return G, coords


def local_compute(n: int, rows: int, iters: int, trials: int) -> dict:
    """Measured: one CG+Jacobi iteration on rank 0's diagonal block of ``rows`` rows."""
    from petsc4py import PETSc
    from slasolve.dsparse import DSparseTensor
    from slasolve.krylov import solve
    ip2, ix2, v2 = poisson3d_block(n, rows)
    nnz = int(ix2.size)
    dA = DSparseTensor.from_local_rows(torch.from_numpy(ip2), torch.from_numpy(ix2), torch.from_numpy(v2),
                                       (rows, rows), MPI.COMM_SELF)
    A = dA.to_petsc()
    b = torch.ones(rows, dtype=torch.float64)
    ksp = PETSc.KSP().create(comm=MPI.COMM_SELF)
    ksp.setOperators(A)
    ksp.setType("cg")
    ksp.getPC().setType("jacobi")
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.setTolerances(rtol=1e-30, atol=0.0, max_it=iters)
    B, X = A.createVecs()
    B.set(1.0)
    Y = A.createVecLeft()
    x = torch.ones(rows, dtype=torch.float64)

    def t(f, k=1):
        t0 = time.perf_counter()
        for _ in range(k):
            f()
        return (time.perf_counter() - t0) / k
    samples = {"petsc_cg_iter": [], "torch_cg_iter": [], "petsc_matvec": [], "slasolve_matvec": []}
    kmv = max(1, int(2e6 // rows))
    for _ in range(trials):
        X.set(0.0)
        samples["petsc_cg_iter"].append(t(lambda: ksp.solve(B, X)) / iters)
        samples["torch_cg_iter"].append(t(lambda: solve(dA, b, "cg", backend="torch", pc="jacobi", rtol=1e-30,
                                                        maxiter=iters, raise_on_fail=False)) / iters)
        samples["petsc_matvec"].append(t(lambda: A.mult(B, Y), kmv))
        samples["slasolve_matvec"].append(t(lambda: dA @ x, kmv))
    return {"rows": rows, "nnz": nnz, **{k: stats(s) for k, s in samples.items()}}


def model(q, compute_s: float, compute_nnz: int, nnz_per_row: float, alpha: float, beta: float) -> dict:
    sizes, halo, nbr = q.part_sizes, q.halo_size, q.neighbours
    P = len(sizes)
    # busiest rank's compute, scaled from the measured block by nonzeros
    t_comp = compute_s * (sizes.max() * nnz_per_row) / compute_nnz
    t_halo = float(np.max(nbr * alpha + 8.0 * halo / beta))
    t_red = 3 * math.ceil(math.log2(P)) * (alpha + 8.0 / beta) if P > 1 else 0.0
    return {"compute_s": t_comp, "halo_s": t_halo, "reductions_s": t_red, "total_s": t_comp + t_halo + t_red}


def memory_series(ranks, rows_per_rank: int = 125_000, timeout: int = 300) -> dict:
    """Local (starts one mpirun job per contender and rank count; no MPI in this process).
    Peak memory per rank above the import floor for ``bench/memory.py``'s contenders on
    a 2-D Poisson problem of about ``rows_per_rank`` rows per rank, at each P in ``ranks``."""
    import memory as mem
    # oversubscribed ranks wait in MPI: let them yield the core instead of spinning
    os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
    os.environ.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    rows, table = [], {}
    print(f"# memory per rank, weak scaling: 2-D Poisson, ~{rows_per_rank} rows per rank, CG; "
          "peak RSS minus the import floor (MiB), max over ranks; each contender its own mpirun job", flush=True)
    print(f"{'contender':<18} {'P':>3} {'N':>9} {'rows/rank':>9} {'floor':>7} {'peak-floor':>10} "
          f"{'min..max over ranks':>19} {'x raw':>6} {'x P=1':>6} {'its':>4} {'s':>5} {'private':>7} {'code':>6} "
          f"{'x raw':>6}", flush=True)
    for P in ranks:
        nx = int(round(math.sqrt(rows_per_rank * P)))
        N = nx * nx
        for kind in mem.WORKERS:
            t0 = time.perf_counter()
            r = mem.launch(kind, nx, P, timeout=timeout)
            r["seconds"] = time.perf_counter() - t0
            r.update(kind=kind, ranks=P, nx=nx, N=N, rows_per_rank=N / P, global_vec_mib=8.0 * N / 2 ** 20)
            rows.append(r)
            if "error" in r:
                print(f"{kind:<18} {P:>3} {N:>9}  FAILED: {r['error'][-300:]}", flush=True)
                continue
            inc = [x["peak_mib"] - x["floor_mib"] for x in r["per_rank"]]
            r.update(floor_mib=max(x["floor_mib"] for x in r["per_rank"]), increment_mib=max(inc),
                     increment_min_mib=min(inc), iterations=r["per_rank"][0]["iterations"],
                     anon_mib=max(x["anon_mib"] for x in r["per_rank"]),
                     file_mib=max(x["file_mib"] for x in r["per_rank"]))
            table[(kind, P)] = r["increment_mib"]
            table[(kind, P, "anon")] = r["anon_mib"]
            raw_kind = "raw_petsc" + kind[kind.rindex("_"):]
            raw, raw_anon = table.get((raw_kind, P)), table.get((raw_kind, P, "anon"))
            first = table.get((kind, ranks[0]))
            r["x_raw"] = r["increment_mib"] / raw if raw else None
            r["x_raw_anon"] = r["anon_mib"] / raw_anon if raw_anon else None
            r["x_first"] = r["increment_mib"] / first if first else None
            print(f"{kind:<18} {P:>3} {N:>9} {N / P:>9.0f} {r['floor_mib']:>7.1f} {r['increment_mib']:>10.1f} "
                  f"{min(inc):>9.1f}..{max(inc):<9.1f} {r['x_raw'] or float('nan'):>6.2f} "
                  f"{r['x_first'] or float('nan'):>6.2f} {r['iterations']:>4} {r['seconds']:>5.0f} "
                  f"{r['anon_mib']:>7.1f} {r['file_mib']:>6.1f} {r['x_raw_anon'] or float('nan'):>6.2f}", flush=True)
    return {"bench": "scaling_memory", "rows_per_rank": rows_per_rank, "ranks": list(ranks), "results": rows,
            "note": "bench/memory.py's workers and launcher; 2-D Poisson nx = round(sqrt(rows_per_rank * P)); "
                    "max over ranks of ru_maxrss after the solve minus after the imports (MiB); "
                    "private = growth of RssAnon (the never-trimmed heap's high-water mark), code = growth of "
                    "RssFile (shared-library pages first touched, shared by the ranks of a node); "
                    "oversubscribed mpirun on this machine's cores"}


def memory_main() -> None:
    import argparse
    import json
    ap = argparse.ArgumentParser(description="measured memory per rank, weak scaling (not under mpirun)")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--ranks", type=int, nargs="*", default=None)
    ap.add_argument("--rows-per-rank", type=int, default=None)
    ap.add_argument("--quick", action="store_true", help="20k rows per rank at 1, 2, 4 ranks")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per mpirun job")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    ranks = a.ranks or ([1, 2, 4] if a.quick else [1, 2, 4, 8, 16])
    out = memory_series(ranks, a.rows_per_rank or (20_000 if a.quick else 125_000), a.timeout)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=None, help="3-D grid edge (N = n^3 unknowns)")
    p.add_argument("--ranks", type=int, nargs="*", default=[8, 32, 128])
    p.add_argument("--metis", type=int, nargs="*", default=None, help="part counts for metis (default: 128 only at full size; slow)")
    a = p.parse_args()
    n = a.n or (48 if a.quick else 160)
    trials = a.trials or (3 if a.quick else 5)
    metis_parts = a.metis if a.metis is not None else (a.ranks if a.quick else [128])
    from petsc4py import PETSc  # noqa: F401  (PetscInitialize is collective: every rank imports)
    import slasolve.krylov  # noqa: F401
    pp = pingpong() if SIZE > 1 else None
    out = {"bench": "scaling_projection", "n_edge": n, "N": n ** 3, "assumed_interconnect": ASSUMED,
           "loopback_measured": pp, "ranks": a.ranks}
    if RANK != 0:
        quiet_barrier()
        return
    from slasolve import partition as part
    N = n ** 3
    rprint(f"# scaling projection: 3-D 7-point Poisson {n}^3 = {N} unknowns")
    if pp:
        rprint(f"[measured] loopback ping-pong: alpha = {pp['alpha_s'] * 1e6:.2f} us, "
               f"beta = {pp['beta_Bps'] / 1e9:.2f} GB/s")
    t0 = time.perf_counter()
    G, coords = graph3d(n)
    nnz_per_row = G.nnz / N
    rprint(f"[measured] graph built in {time.perf_counter() - t0:.1f} s, nnz {G.nnz}")
    parts = {}
    for P in a.ranks:
        for method in ("contiguous", "rcb", "hilbert", "metis"):
            if method == "metis" and P not in metis_parts:
                continue
            t0 = time.perf_counter()
            try:
                pt = part.partition(G, P, method=method, coords=None if method in ("contiguous", "metis") else coords)
            except Exception as e:  # e.g. pymetis missing
                rprint(f"  {method} P={P}: failed {e!r}")
                continue
            dt = time.perf_counter() - t0
            q = pt.quality
            parts[(method, P)] = q
            rprint(f"[measured] {method:<10} P={P:<4} {dt:6.1f} s  {q.summary()}")
    comp = {}
    for P in a.ranks:
        rows = -(-N // P)
        comp[P] = local_compute(n, rows, iters=20 if a.quick else 30, trials=trials)
        c = comp[P]
        rprint(f"[measured] local block {rows} rows ({c['nnz']} nnz): CG+Jacobi iteration petsc "
               f"{c['petsc_cg_iter']['median'] * 1e3:.3f} ms, torch {c['torch_cg_iter']['median'] * 1e3:.3f} ms; "
               f"matvec petsc {c['petsc_matvec']['median'] * 1e3:.3f} ms, slasolve {c['slasolve_matvec']['median'] * 1e3:.3f} ms")
    scen = {"cluster_assumed": (ASSUMED["alpha_s"], ASSUMED["beta_Bps"])}
    if pp:
        scen["loopback_measured"] = (pp["alpha_s"], pp["beta_Bps"])
    table = []
    rprint(f"[modelled] time per CG+Jacobi iteration (ms): compute(measured rate) + halo + 3 allreduce")
    rprint(f"  {'scenario':<18} {'method':<10} {'P':>4} {'halo max':>9} {'nbr max':>7} {'imb':>6} "
           f"{'B/matvec max':>12} {'petsc':>8} {'torch':>8} {'comm %':>7}")
    for (method, P), q in parts.items():
        c = comp[P]
        for sname, (al, be) in scen.items():
            mp = model(q, c["petsc_cg_iter"]["median"], c["nnz"], nnz_per_row, al, be)
            mt = model(q, c["torch_cg_iter"]["median"], c["nnz"], nnz_per_row, al, be)
            row = {"scenario": sname, "method": method, "P": P, "alpha_s": al, "beta_Bps": be,
                   "halo_max": int(q.halo_size.max()), "halo_mean": float(q.halo_size.mean()),
                   "neighbours_max": int(q.neighbours.max()), "neighbours_mean": float(q.neighbours.mean()),
                   "imbalance": q.load_imbalance, "edge_cut": int(q.edge_cut),
                   "bytes_per_matvec_max": int(8 * q.halo_size.max()),
                   "bytes_per_matvec_total": int(8 * q.halo_size.sum()),
                   "bytes_per_cg_iter_max": int(8 * q.halo_size.max() + 3 * 8 * math.ceil(math.log2(P))),
                   "petsc": mp, "torch": mt}
            table.append(row)
            rprint(f"  {sname:<18} {method:<10} {P:>4} {row['halo_max']:>9} {row['neighbours_max']:>7} "
                   f"{q.load_imbalance:>6.3f} {row['bytes_per_matvec_max']:>12} {mp['total_s'] * 1e3:>8.3f} "
                   f"{mt['total_s'] * 1e3:>8.3f} {100 * (mp['halo_s'] + mp['reductions_s']) / mp['total_s']:>6.1f}%")
    out.update(compute_measured={str(k): v for k, v in comp.items()}, projection=table, nnz=int(G.nnz))
    write_json(a.json, out)
    quiet_barrier()


if __name__ == "__main__":
    memory_main() if MEMORY_MODE else main()
