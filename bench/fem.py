"""Benchmark: distributed P1 Poisson assembly vs scikit-fem, and the phases of one FEM solve.

    python bench/fem.py                          # ~1M triangles (n = 708 -> 1,002,528 cells)
    mpirun -n 2 python bench/fem.py --json fem_2.json

Measured in the same run:

* slasolve: parallel box mesh, ``Assembler`` setup (pattern, nonzero halo plan),
  and assembly of the stiffness matrix with per-cell coefficients (element
  matrices + ``index_add`` + reverse halo + ``with_values``; minimum of
  ``--repeat`` runs, the slowest rank's time). Also the assembly with the
  coefficients requiring grad plus one backward pass.
* scikit-fem (rank 0 only, one process): ``asm(laplace, Basis(mesh, ElementTriP1()))``
  of the same mesh (same points and triangles), and a check that both matrices agree.
* one full manufactured Poisson solve (``fem.manufactured_solve``, CG + GAMG): time per phase.

Needs scikit-fem (``pip install scikit-fem``; the ``bench`` extra).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

try:
    import slasolve  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI

from slasolve.fem import Assembler, box_mesh
from slasolve.fem.problems import manufactured_solve


def timed(comm, fn, repeat=1):
    """Minimum over ``repeat`` runs of the slowest rank's wall time; returns (seconds, last result)."""
    best, out = float("inf"), None
    for _ in range(repeat):
        comm.Barrier()
        t0 = time.perf_counter()
        out = fn()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        best = min(best, dt)
    return best, out


def bench_slasolve(comm, n, repeat):
    res = {}
    res["mesh"], mesh = timed(comm, lambda: box_mesh(n, cell="triangle", comm=comm))
    res["setup"], V = timed(comm, lambda: Assembler(mesh))
    g = torch.Generator().manual_seed(0)
    kappa = 1.0 + torch.rand(mesh.n_local_cells, generator=g, dtype=torch.float64)
    V.stiffness(kappa)  # warm-up (first-call overheads)
    res["assemble"], A = timed(comm, lambda: V.stiffness(kappa), repeat)

    def with_grad():
        k = kappa.clone().requires_grad_()
        B = V.stiffness(k)
        B.values.sum().backward()
        return k.grad

    res["assemble+backward"], _ = timed(comm, with_grad, repeat)
    res["n_cells"] = mesh.n_global_cells
    res["n_nodes"] = mesh.n_global_nodes
    res["nnz"] = comm.allreduce(V.nnz)
    res["remote_nnz_per_rank_max"] = comm.allreduce(V.n_remote, op=MPI.MAX)
    return res, A, kappa


def bench_skfem(n, kappa_global, repeat):
    from skfem import Basis, ElementTriP1, MeshTri, asm
    from skfem.models.poisson import laplace
    from skfem.helpers import dot, grad
    from skfem import BilinearForm

    ref = box_mesh(n, cell="triangle", comm=MPI.COMM_SELF)
    pts = ref.node_coords.numpy().T.copy()
    tri = ref.cells.numpy().T.copy()
    res = {}
    t0 = time.perf_counter()
    m = MeshTri(pts, tri)
    basis = Basis(m, ElementTriP1())
    res["setup"] = time.perf_counter() - t0

    @BilinearForm
    def kgrad(u, v, w):
        return w["kappa"] * dot(grad(u), grad(v))

    kq = np.repeat(kappa_global[:, None], basis.X.shape[1], axis=1)
    best = float("inf")
    A = None
    for _ in range(repeat):
        t0 = time.perf_counter()
        A = asm(kgrad, basis, kappa=kq)
        best = min(best, time.perf_counter() - t0)
    res["assemble"] = best
    best_c = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        asm(laplace, basis)
        best_c = min(best_c, time.perf_counter() - t0)
    res["assemble_constant_kappa"] = best_c
    return res, A.tocsr()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=708, help="cells per side (2 n^2 triangles; 708 -> ~1M)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--solve-n", type=int, default=None, help="n of the full solve (default: --n)")
    p.add_argument("--no-skfem", action="store_true")
    p.add_argument("--no-solve", action="store_true")
    p.add_argument("--json", default=None, help="write the results to this JSON file (rank 0)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_default_dtype(torch.float64)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    per_node = local.Get_size()
    local.Free()
    if per_node > 1 and torch.get_num_threads() * per_node > (os.cpu_count() or 1):
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // per_node))  # no oversubscription
    say = print if rank == 0 else (lambda *a, **k: None)
    out = {"ranks": size, "n": args.n, "torch_threads": torch.get_num_threads(),
           "host": platform.node(), "python": platform.python_version(), "torch": torch.__version__}

    mine, A, kappa = bench_slasolve(comm, args.n, args.repeat)
    out["slasolve"] = mine
    kappa_all = comm.gather(kappa.numpy(), root=0)
    loc = comm.gather(A.local.to_scipy("csr"), root=0)
    if not args.no_skfem:
        err = None
        if rank == 0:
            try:
                sk, S = bench_skfem(args.n, np.concatenate(kappa_all), args.repeat)
                G = sp.vstack(loc).tocsr()
                diff = abs(G - S).max()
                sk["max_abs_diff_vs_slasolve"] = float(diff)
                out["skfem"] = sk
            except ImportError as e:
                err = f"scikit-fem not available ({e}); pip install scikit-fem"
        err = comm.bcast(err, root=0)
        if err:
            say(err)
    if not args.no_solve:
        r = manufactured_solve("poisson", args.solve_n or args.n, 2, "triangle", comm, pc="gamg", rtol=1e-8)
        out["solve"] = {"n": r.n, "dofs": r.n_dofs, "iterations": r.iterations, "error_l2": r.error_l2,
                        "times": r.timings, "total": sum(r.timings.values())}

    # ---- table
    say(f"\nP1 Poisson stiffness, {mine['n_cells']:,} triangles, {mine['n_nodes']:,} nodes, "
        f"nnz {mine['nnz']:,}; {size} rank(s), {out['torch_threads']} torch thread(s) per rank")
    say(f"{'phase':<28}{'slasolve [s]':>14}{'scikit-fem 1 rank [s]':>24}")
    sk = out.get("skfem", {})
    rows = [("mesh", mine["mesh"], None), ("setup (pattern + halo)", mine["setup"], sk.get("setup")),
            ("assemble (per-cell kappa)", mine["assemble"], sk.get("assemble")),
            ("assemble + backward", mine["assemble+backward"], None),
            ("assemble (constant kappa)", None, sk.get("assemble_constant_kappa"))]
    for name, a, b in rows:
        fa = f"{a:14.3f}" if a is not None else f"{'':>14}"
        fb = f"{b:24.3f}" if b is not None else f"{'':>24}"
        say(f"{name:<28}{fa}{fb}")
    if sk:
        say(f"speed-up of the assembly vs scikit-fem: {sk['assemble'] / mine['assemble']:.1f}x; "
            f"max |A_slasolve - A_skfem| = {sk['max_abs_diff_vs_slasolve']:.2e}")
    if "solve" in out:
        s = out["solve"]
        say(f"\nfull fem_solve run (Poisson, n = {s['n']}, {s['dofs']:,} dofs, CG + GAMG, "
            f"{s['iterations']} iterations, L2 error {s['error_l2']:.3e}):")
        for k, v in s["times"].items():
            say(f"  {k:<10}{v:8.3f} s  ({100 * v / s['total']:5.1f} %)")
        say(f"  {'total':<10}{s['total']:8.3f} s")
    if args.json and rank == 0:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
        say(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())  # import slasolve already aborts the job on an unhandled exception
