"""Benchmark: k smallest eigenpairs of the 2-D Poisson matrix (5-point FD, Dirichlet).

Run serially or under MPI (the timings of one run are compared with each other):

    python bench/eigen.py --n 500                       # 500x501 grid, 250k unknowns, 1 rank
    mpirun -n 2 python bench/eigen.py --n 500 --json out.json

Compared, in the same run and with identical settings (shift-and-invert at
``sigma = 0``, Krylov-Schur, LU by MUMPS, ``tol``, ``nev = k``, the same
initial vector, SLEPc's default ``ncv``):

* ``slepc4py``    -- raw slepc4py on a Mat assembled directly by PETSc, the ST's
  factorisation MUMPS LU (SLEPc's default unless the Mat is flagged symmetric);
* ``slepc4py-cholesky`` -- the same with MUMPS' LDL^T (``-st_pc_type cholesky``,
  SLEPc's default for a Mat flagged ``MAT_SYMMETRIC``);
* ``slasolve-slepc`` -- ``slasolve.eigsh(dA, k, sigma=0, backend="slepc")``
  (the full call: input checks, EPS, the multiplicity verification -- here an
  inertia count, a numeric refactorisation of its shift-invert LDL^T --, sign
  convention, explicit residuals);
* ``slasolve-torch`` -- ``slasolve.eigsh(dA, k, which="SA", backend="torch")``
  (native LOBPCG, block-Jacobi IC(0) preconditioner by default; ``--torch-pc``);
* ``scipy-arpack`` -- ``scipy.sparse.linalg.eigsh(A, k, sigma=0)`` on rank 0
  with the global matrix (SuperLU), the other ranks idle.

Times are wall-clock seconds, the minimum over ``--repeat`` runs after one
warm-up run each (the warm-up builds and caches the PETSc Mat); the SLEPc
contenders alternate within each repetition (in rotating order), so a change of
the machine's load hits them alike. ``ratios`` are the minima's ratios to raw
slepc4py; ``paired_ratios`` the median over the repetitions of the ratio within
each. The hook for other comparisons (torch-sla, ...) is
:func:`run_benchmark`, which returns the measurements as a dict.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402


def _split(n, size, rank):
    counts = np.full(size, n // size, dtype=np.int64)
    counts[: n % size] += 1
    offs = np.concatenate([[0], np.cumsum(counts)])
    return int(offs[rank]), int(offs[rank + 1])


def poisson2d_local_rows(m, rstart, rend, mx=None):
    """CSR (indptr, global cols, values) of rows [rstart, rend) of the grid Laplacian
    with ``m`` grid rows of ``mx`` (default ``m``) points."""
    mx = m if mx is None else mx
    rows = np.arange(rstart, rend, dtype=np.int64)
    i, j = rows // mx, rows % mx
    entries = [(-mx, i > 0), (-1, j > 0), (0, np.ones_like(i, dtype=bool)), (1, j < mx - 1),
               (mx, i < m - 1)]
    cc = np.stack([rows + off for off, _ in entries], 1)
    mask = np.stack([ok for _, ok in entries], 1)
    vv = np.where(np.arange(5)[None, :] == 2, 4.0, -1.0) * np.ones_like(cc, dtype=np.float64)
    counts = mask.sum(1)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    return indptr, cc[mask], vv[mask]


def analytic(m, k, mx=None):
    mx = m if mx is None else mx
    ey = 4 * np.sin(np.arange(1, m + 1) * np.pi / (2 * (m + 1))) ** 2
    ex = 4 * np.sin(np.arange(1, mx + 1) * np.pi / (2 * (mx + 1))) ** 2
    return np.sort((ey[:, None] + ex[None, :]).ravel())[:k]


def _timed_alternating(fns, repeat, comm):
    """Collective. Warm up every contender, then ``repeat`` rounds running each once, in an
    order rotated every round; returns ``({name: [seconds per round]}, {name: last output})``."""
    names = list(fns)
    outs = {name: fns[name]() for name in names}
    ts = {name: [] for name in names}
    for r in range(repeat):
        for name in names[r % len(names):] + names[:r % len(names)]:
            comm.Barrier()
            t = time.perf_counter()
            outs[name] = fns[name]()
            comm.Barrier()
            ts[name].append(time.perf_counter() - t)
    return ts, outs


def run_benchmark(n=500, k=6, tol=1e-8, repeat=2, comm=None, torch_backend=True, torch_pc="icc",
                  torch_maxiter=20000, scipy_run=True, threads=1, torch_sla_timeout=120.0):
    """Collective. Run the comparison on an n x n grid; return a dict of measurements
    (identical on every rank except ``scipy`` entries, which rank 0 fills)."""
    from petsc4py import PETSc
    from slepc4py import SLEPc

    from slasolve.dsparse import DSparseTensor
    from slasolve.eigen import eigsh
    from slasolve.eigen.slepc_backend import configure_eps
    from slasolve.eigen.torch_methods import start_vectors

    torch.set_num_threads(threads)
    comm = comm or MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    # an n x (n+1) grid: on a square grid (exactly repeated eigenvalues) raw slepc4py
    # and ARPACK return one copy of each, so their answers would differ from eigsh's
    # (which verifies multiplicities by a deflated re-solve, included in its time)
    mx = n + 1
    N = n * mx
    rstart, rend = _split(N, size, rank)
    indptr, cols, vals = poisson2d_local_rows(n, rstart, rend, mx)
    dA = DSparseTensor.from_local_rows(indptr, cols, torch.tensor(vals), (N, N), comm)
    ref = analytic(n, k, mx)
    v0 = start_vectors(rend - rstart, 1, row_offset=rstart, seed=0, dtype=torch.float64)[:, 0]
    res = {"n_grid": n, "unknowns": N, "k": k, "tol": tol, "ranks": size, "threads": threads,
           "mumps": bool(PETSc.Sys.hasExternalPackage("mumps")), "times": {}, "errors": {}}

    # raw slepc4py: the Mat assembled by PETSc, the EPS configured as slasolve does
    mat = PETSc.Mat().createAIJ(size=((rend - rstart, N), (rend - rstart, N)),
                                csr=(indptr.astype(PETSc.IntType), cols.astype(PETSc.IntType), vals),
                                comm=comm)
    mat.assemble()
    x0 = mat.createVecs("right")
    x0.getArray()[:] = v0.numpy()

    def raw(factor="lu"):
        eps = SLEPc.EPS().create(comm=comm)
        eps.setOperators(mat)
        configure_eps(eps, k=k, which="LM", sigma=0.0, tol=tol, maxiter=None, ncv=None, generalized=False)
        pc = eps.getST().getKSP().getPC()
        if pc.getType() != factor:
            pc.setType(factor)      # resets the solver package: MUMPS again
            pc.setFactorSolverType("mumps")
        eps.setInitialSpace([x0])
        eps.setFromOptions()
        eps.solve()
        nconv = eps.getConverged()
        vr = mat.createVecs("right")
        ws, vs = [], []
        for i in range(min(nconv, k)):
            ws.append(eps.getEigenpair(i, vr).real)
            vs.append(vr.getArray().copy())
        eps.destroy()
        vr.destroy()
        return np.sort(np.array(ws))

    def sl():
        return eigsh(dA, k=k, sigma=0.0, tol=tol, backend="slepc")[0].numpy()

    ts, ws = _timed_alternating({"slepc4py": raw, "slepc4py-cholesky": lambda: raw("cholesky"),
                                 "slasolve-slepc": sl}, repeat, comm)
    res["times_all"] = ts
    res["paired_ratios"] = {}
    for name, t in ts.items():
        res["times"][name] = min(t)
        res["errors"][name] = float(np.max(np.abs(ws[name] - ref) / ref))
        res["paired_ratios"][name] = float(np.median(np.array(t) / np.array(ts["slepc4py"])))

    if torch_backend:
        def tb():
            w, V, info = eigsh(dA, k=k, which="SA", tol=tol, backend="torch", pc=torch_pc,
                               maxiter=torch_maxiter, return_info=True, raise_on_fail=False)
            return w.numpy(), info
        comm.Barrier()
        t0 = time.perf_counter()
        w, info = tb()     # one run: the native solve is the long one
        comm.Barrier()
        res["times"]["slasolve-torch"] = time.perf_counter() - t0
        res["errors"]["slasolve-torch"] = float(np.max(np.abs(w - ref) / ref))
        res["torch_iterations"] = info.iterations
        res["torch_converged"] = info.converged
        res["torch_pc"] = str(torch_pc)

    if scipy_run:
        t_sc = err = None
        if rank == 0:
            import scipy.sparse as sp
            import scipy.sparse.linalg as spla
            ip, cc, vv = poisson2d_local_rows(n, 0, N, mx)
            A = sp.csr_matrix((vv, cc, ip), shape=(N, N))
            t0 = time.perf_counter()
            ws = spla.eigsh(A, k=k, sigma=0.0, tol=tol, v0=start_vectors(N, 1, seed=0).numpy()[:, 0],
                            return_eigenvectors=True)[0]
            t_sc = time.perf_counter() - t0
            err = float(np.max(np.abs(np.sort(ws) - ref) / ref))
        t_sc, err = comm.bcast((t_sc, err), root=0)
        res["times"]["scipy-arpack"] = t_sc
        res["errors"]["scipy-arpack"] = err
    if torch_sla_timeout and size == 1:
        res["torch_sla"] = _torch_sla_eigsh(n, mx, k, ref, torch_sla_timeout)
        if res["torch_sla"].get("time") is not None:
            res["times"]["torch-sla"] = res["torch_sla"]["time"]
            res["errors"]["torch-sla"] = res["torch_sla"]["error"]
    base = res["times"]["slepc4py"]
    res["ratios"] = {key: v / base for key, v in res["times"].items()}
    mat.destroy()
    x0.destroy()
    return res


_TORCH_SLA_SCRIPT = """
import sys, time, numpy as np, torch
sys.path.insert(0, {here!r})
import torch_sla as ts
from eigen import poisson2d_local_rows
torch.set_num_threads(1)
n, mx, k = {n}, {mx}, {k}
N = n * mx
ip, cols, vals = poisson2d_local_rows(n, 0, N, mx)
row = torch.from_numpy(np.repeat(np.arange(N), np.diff(ip)))
A = ts.SparseTensor(torch.from_numpy(vals), row, torch.from_numpy(cols), (N, N))
t = time.perf_counter()
w, V = A.eigsh(k=k, which="SA")
print("TIME", time.perf_counter() - t)
print("W", " ".join(repr(float(v)) for v in np.sort(np.asarray(w).ravel())[:k]))
"""


def _torch_sla_eigsh(n, mx, k, ref, timeout):
    """torch-sla's ``SparseTensor.eigsh(k, which="SA")`` on the same matrix, in a child
    process with a time limit (it can take far longer than the others)."""
    import subprocess
    try:
        import torch_sla  # noqa: F401
    except ImportError:
        return {"time": None, "note": "torch-sla not installed"}
    code = _TORCH_SLA_SCRIPT.format(here=os.path.dirname(os.path.abspath(__file__)), n=n, mx=mx, k=k)
    try:
        # a plain (non-MPI) child: drop the launcher's variables, or its MPI_Init would
        # try to join this mpirun job
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_"))}
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           env=env)
    except subprocess.TimeoutExpired:
        return {"time": None, "note": f"did not finish within {timeout:.0f} s"}
    out = dict(line.split(" ", 1) for line in p.stdout.splitlines() if line.startswith(("TIME", "W")))
    if p.returncode != 0 or "TIME" not in out:
        return {"time": None, "note": f"failed (rc {p.returncode}): {p.stderr.strip()[-300:]}"}
    w = np.array([float(v) for v in out["W"].split()])
    return {"time": float(out["TIME"]), "error": float(np.max(np.abs(w - ref) / ref)), "note": "one run"}


def print_table(res):
    print(f"\n2-D Poisson, {res['n_grid']}x{res['n_grid'] + 1} = {res['unknowns']} unknowns, k={res['k']}, "
          f"tol={res['tol']:g}, {res['ranks']} rank(s), mumps={res['mumps']}")
    print(f"{'solver':<19}{'time [s]':>11}{'ratio':>8}{'paired':>8}{'max rel err':>14}")
    for key, t in res["times"].items():
        paired = res.get("paired_ratios", {}).get(key)
        paired = f"{paired:>8.2f}" if paired is not None else f"{'':>8}"
        print(f"{key:<19}{t:>11.3f}{res['ratios'][key]:>8.2f}{paired}{res['errors'][key]:>14.2e}")
    print("(ratio: of the best times; paired: median over the repetitions of the ratio within each, "
          "the SLEPc rows alternating)")
    if "torch_sla" in res and res["torch_sla"].get("time") is None:
        print(f"torch-sla         {res['torch_sla']['note']}")
    if "torch_iterations" in res:
        print(f"(torch: LOBPCG + {res['torch_pc']}, {res['torch_iterations']} iterations, "
              f"{res['torch_converged']}/{res['k']} converged; slepc/scipy: shift-invert sigma=0)")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=500, help="grid side (unknowns = n^2; default 500)")
    p.add_argument("--k", type=int, default=6)
    p.add_argument("--tol", type=float, default=1e-8)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-torch", action="store_true", help="skip the native torch backend")
    p.add_argument("--torch-pc", default="icc", help="LOBPCG preconditioner (jacobi, icc, none)")
    p.add_argument("--torch-maxiter", type=int, default=20000)
    p.add_argument("--no-scipy", action="store_true")
    p.add_argument("--torch-sla-timeout", type=float, default=120.0,
                   help="time limit for torch-sla's eigsh (1-rank runs only; 0 skips it)")
    p.add_argument("--json", default=None, help="write the measurements to this JSON file (rank 0)")
    a = p.parse_args(argv)
    res = run_benchmark(n=a.n, k=a.k, tol=a.tol, repeat=a.repeat, torch_backend=not a.no_torch,
                        torch_pc=a.torch_pc, torch_maxiter=a.torch_maxiter, scipy_run=not a.no_scipy,
                        threads=a.threads, torch_sla_timeout=a.torch_sla_timeout)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print_table(res)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
    return res


if __name__ == "__main__":
    main()
