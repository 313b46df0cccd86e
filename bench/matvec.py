"""Row-shard ``dA @ x`` (slasolve) against PETSc ``MatMult`` on the same matrix.

Run: ``mpirun -n 1 python bench/matvec.py`` and ``mpirun -n 2 ...``.
The matrix is the 2-D 5-point Poisson matrix (default 1000 x 1000 grid = 1M
unknowns), each rank building only its own rows (``DSparseTensor.from_local_rows``);
PETSc multiplies the very same Mat (``dA.to_petsc()``) with Vecs that share the
torch tensors' memory. Contenders alternate in one run; one thread per rank.
Also timed: assembly (``from_local_rows`` vs raw ``createAIJ`` with the same CSR)
and the first ``to_petsc()`` (Mat creation) and a refill (values only).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COMM, RANK, SIZE, Solo, base_parser, build_dpoisson2d, build_petsc_poisson2d, compare,  # noqa: E402
                    fmt_t, ratio, rhs_local, rprint, timed, write_json)

import torch  # noqa: E402


def run_size(nx: int, trials: int, inner: int) -> dict:
    from petsc4py import PETSc
    from slasolve.petsc import tensor_to_vec

    n = nx * nx
    # assembly, alternated: slasolve from_local_rows vs raw petsc4py createAIJ
    asm = {"slasolve_from_local_rows": [], "petsc_createAIJ": []}
    for t in range(3):
        for k in (list(asm) if t % 2 == 0 else list(asm)[::-1]):
            if k == "petsc_createAIJ":
                M, dt = build_petsc_poisson2d(nx)
                M.destroy()
            else:
                dA, dt = build_dpoisson2d(nx)
            asm[k].append(dt)
    tp = timed(lambda: dA.to_petsc())
    A = dA.to_petsc()
    dA2 = dA.with_values(dA.values * 1.0)
    t_refill = timed(lambda: dA2.to_petsc())
    r0, r1 = dA.row_range
    x = rhs_local(r1 - r0, r0)
    y_t = dA @ x
    xv = tensor_to_vec(x, COMM, global_size=n)
    yv = A.createVecLeft()
    A.mult(xv, yv)
    err = float(torch.linalg.vector_norm(torch.from_numpy(yv.getArray().copy()) - y_t))
    err = COMM.allreduce(err ** 2) ** 0.5
    cont = {"slasolve": lambda: dA @ x, "petsc": lambda: A.mult(xv, yv)}
    if SIZE > 1:  # the 1-rank baseline in the same run: rank 0 alone, the others asleep
        from mpi4py import MPI
        solo = {}
        if RANK == 0:
            dA1, _ = build_dpoisson2d(nx, MPI.COMM_SELF)
            A1 = dA1.to_petsc()
            x1 = rhs_local(n, 0)
            xv1 = tensor_to_vec(x1, MPI.COMM_SELF, global_size=n)
            yv1 = A1.createVecLeft()
            solo = {"slasolve": lambda: dA1 @ x1, "petsc": lambda: A1.mult(xv1, yv1)}
        cont["slasolve_1rank"] = Solo(lambda: solo["slasolve"]())
        cont["petsc_1rank"] = Solo(lambda: solo["petsc"]())
    res = compare(cont, trials=trials, inner=inner)
    rt = ratio(res, "slasolve", "petsc")
    from common import stats
    out = {"nx": nx, "n": n, "nnz": int(COMM.allreduce(dA.local.nnz)), "ranks": SIZE,
           "slasolve": {k: v for k, v in res["slasolve"].items()},
           "petsc": {k: v for k, v in res["petsc"].items()},
           "ratio_slasolve_over_petsc": rt, "max_abs_diff": err,
           "assembly": {k: stats(v) for k, v in asm.items()},
           "to_petsc_create_s": tp, "to_petsc_refill_s": t_refill,
           "ghosts_per_rank": COMM.allgather(int(dA.halo.n_ghost))}
    if SIZE > 1:
        for k in ("slasolve", "petsc"):
            out[k + "_1rank"] = res[k + "_1rank"]
            out["speedup_" + k] = ratio(res, k + "_1rank", k)
    return out


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, nargs="*", default=None, help="grid sizes (n = nx^2)")
    a = p.parse_args()
    nxs = a.nx or ([300] if a.quick else [1000])
    trials = a.trials or (5 if a.quick else 15)
    rows = []
    rprint(f"# matvec: 2-D Poisson, {SIZE} rank(s), 1 thread/rank, {trials} alternating trials")
    rprint(f"{'n':>9} {'slasolve':>11} {'petsc':>11} {'ratio(med)':>10} {'spread':>15} {'asm sla':>10} {'asm petsc':>10}")
    for nx in nxs:
        n = nx * nx
        inner = max(1, int(2e6 // n))  # keep each sample >= ~ a few ms
        r = run_size(nx, trials, inner)
        rows.append(r)
        rt = r["ratio_slasolve_over_petsc"]
        rprint(f"{n:>9} {fmt_t(r['slasolve']['median']):>11} {fmt_t(r['petsc']['median']):>11} "
               f"{rt['median']:>10.3f} {rt['min']:>7.3f}-{rt['max']:<7.3f} "
               f"{fmt_t(r['assembly']['slasolve_from_local_rows']['median']):>10} "
               f"{fmt_t(r['assembly']['petsc_createAIJ']['median']):>10}")
        if SIZE > 1:
            rprint("  speedup %d ranks vs rank 0 alone (same run): slasolve %.2fx  petsc %.2fx" % (
                SIZE, r["speedup_slasolve"]["median"], r["speedup_petsc"]["median"]))
    write_json(a.json, {"bench": "matvec", "ranks": SIZE, "trials": trials, "rows": rows,
                        "problem": "2-D 5-point Poisson, Dirichlet, lexicographic rows, PETSC_DECIDE row split",
                        "options": "float64, OMP_NUM_THREADS=1, torch.set_num_threads(1); "
                                   "sample = mean of `inner` back-to-back products"})


if __name__ == "__main__":
    main()
