"""Where the memory of a 2-D Poisson CG solve goes, per rank: RSS after each step and the
bytes of every array slasolve holds.

Run: ``python bench/memory_breakdown.py [--nx 1000] [--pc jacobi|gamg] [--backend torch|petsc]``
(under ``mpirun -n P`` for P ranks). Rank 0 prints; the tables are rank 0's.

Two views:

* **RSS steps**: current resident set (``VmRSS``) and its peak (``ru_maxrss``) after the
  imports, the input CSR arrays, ``DSparseTensor.from_local_rows``, the PETSc Mat (petsc
  backend) and two solves. Note: this PETSc build loads SuperLU_DIST, whose library
  constructor calls ``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, -1)``, so
  after ``import petsc4py.PETSc`` glibc never gives freed memory back to the system: every
  temporary stays in RSS (and is reused by later allocations). The peak is therefore the
  high-water mark of live memory plus fragmentation, the same for raw petsc4py and slasolve.
* **Held arrays**: every torch tensor / NumPy array reachable from the tensor, its layout,
  halo plan, pattern caches and solver caches (shared storage counted once), in groups
  (matrix, layout index sets, halo plan, caches, solver), plus the PETSc Mat's own arrays
  (AIJ: values, int column indices, row pointers and per-row bookkeeping; estimated from its
  nonzeros and sizes, PETSc allocates them in C).
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from common import COMM, RANK, maxrss_mib, poisson2d_rows, rhs_local, split_offsets  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import slasolve.krylov  # noqa: E402,F401


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _nbytes(obj):
    if isinstance(obj, torch.Tensor):
        if obj.layout != torch.strided:
            return None
        st = obj.untyped_storage()
        return st.data_ptr(), st.nbytes()
    if isinstance(obj, np.ndarray):
        base = obj
        while isinstance(base.base, np.ndarray):
            base = base.base
        return base.__array_interface__["data"][0], base.nbytes
    return None


def walk(obj, path: str, out: dict, seen: set, depth: int = 0) -> None:
    """Collect ``{path: bytes}`` of the arrays reachable from ``obj`` (each storage once)."""
    if depth > 8 or id(obj) in seen:
        return
    seen.add(id(obj))
    nb = _nbytes(obj)
    if nb is not None:
        key = ("mem",) + nb[:1]
        if key not in seen and nb[1]:
            seen.add(key)
            out[path] = out.get(path, 0) + nb[1]
        return
    if isinstance(obj, (str, bytes, int, float, bool, type(None))):
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            walk(v, f"{path}[{k!r}]" if not isinstance(k, str) else f"{path}.{k}", out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            walk(v, f"{path}[{i}]", out, seen, depth + 1)
        return
    if callable(obj) and getattr(obj, "__closure__", None):
        for i, c in enumerate(obj.__closure__):
            try:
                walk(c.cell_contents, f"{path}<closure{i}>", out, seen, depth + 1)
            except ValueError:
                pass
    d = getattr(obj, "__dict__", None)
    if d is not None and type(obj).__module__.split(".")[0] in ("slasolve", "__main__", "collections"):
        walk(d, path, out, seen, depth + 1)
    for s in getattr(type(obj), "__slots__", ()):
        if hasattr(obj, s):
            walk(getattr(obj, s), f"{path}.{s}", out, seen, depth + 1)


def group(path: str) -> str:
    if path.startswith("dA.values"):
        return "matrix values"
    if path.startswith("dA.pattern"):
        return "matrix pattern (indptr, indices)" if path.split(".")[-1] in ("indptr", "indices") \
            else "pattern caches (rows, transpose, int32 copies)"
    if ".halo" in path:
        return "halo plan"
    if "petsc_mats" in path:
        return "PETSc Mat value snapshot"
    if "solvers" in path or "factorizations" in path:
        return "solver caches (snapshots, preconditioners)"
    if path.startswith("layout"):
        return "layout index sets (diag/offd split, bulk product)"
    return "other"


def petsc_mat_bytes(mat) -> int:
    """The bytes PETSc allocates for an AIJ Mat's local arrays (diagonal and off-diagonal
    blocks: values, int32 columns, row pointers, ilen/imax, diagonal positions; for MPIAIJ
    also garray, lvec and the scatter's index lists)."""
    from petsc4py import PETSc
    isz = np.dtype(PETSc.IntType).itemsize
    info = mat.getInfo()
    nz = int(info["nz_allocated"])
    m = mat.getLocalSize()[0]
    blocks = 1 if mat.getComm().getSize() == 1 else 2
    out = nz * (8 + isz) + blocks * (m + 1) * isz + blocks * 2 * m * isz + m * isz
    if blocks == 2:
        Ad, Ao, garray = mat.getMPIAIJ()
        ng = len(garray)
        out += ng * (isz + 8) + ng * isz * 2   # garray, lvec, scatter indices
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nx", type=int, default=1000)
    ap.add_argument("--backend", default="torch", choices=["torch", "petsc"])
    ap.add_argument("--pc", default="jacobi")
    ap.add_argument("--maxiter", type=int, default=300)
    a = ap.parse_args()
    from slasolve.dsparse import DSparseTensor
    from slasolve.krylov import solve
    steps = []

    def step(name):
        steps.append((name, COMM.allreduce(rss_mib(), op=max_op), COMM.allreduce(maxrss_mib(), op=max_op)))

    from mpi4py import MPI
    max_op = MPI.MAX
    step("imports (floor)")
    n = a.nx * a.nx
    offs = split_offsets(n)
    ip, ix, v = poisson2d_rows(a.nx, int(offs[RANK]), int(offs[RANK + 1]))
    step("input CSR (NumPy, caller's)")
    dA = DSparseTensor.from_local_rows(torch.from_numpy(ip), torch.from_numpy(ix), torch.from_numpy(v), (n, n), COMM)
    step("from_local_rows")
    del ip, ix
    b = rhs_local(dA.n_local, dA.row_range[0])
    mat = None
    if a.backend == "petsc":
        mat = dA.to_petsc(mat_type="aij")
        step("to_petsc (Mat + snapshot)")
    kw = dict(rtol=1e-6) if a.backend == "petsc" else dict(rtol=1e-30, maxiter=a.maxiter, raise_on_fail=False)
    for i in (1, 2):
        x, info = solve(dA, b, "cg", backend=a.backend, pc=a.pc, return_info=True, **kw)
        step(f"solve {i} ({info.iterations} its)")

    held: dict = {}
    seen: set = set()
    walk(dA.values, "dA.values", held, seen)
    walk(dA.local.pattern, "dA.pattern", held, seen)
    walk(dA._layout, "layout", held, seen)
    groups: dict = {}
    for p, nb in held.items():
        groups.setdefault(group(p), []).append((p, nb))
    vec = dA.n_local * 8
    if RANK == 0:
        print(f"# memory breakdown: 2-D Poisson n={n}, {COMM.Get_size()} rank(s), CG backend={a.backend} "
              f"pc={a.pc}; MiB, max over ranks for RSS, rank 0 for arrays")
        print(f"\n{'step':<32} {'RSS':>8} {'peak RSS':>9} {'RSS-floor':>10} {'peak-floor':>10}")
        fl = steps[0][1]
        for name, r, pk in steps:
            print(f"{name:<32} {r:>8.1f} {pk:>9.1f} {r - fl:>10.1f} {pk - fl:>10.1f}")
        print(f"\n{'held by slasolve (rank 0)':<60} {'MiB':>8}")
        tot = 0
        for g in sorted(groups):
            s = sum(nb for _, nb in groups[g])
            tot += s
            print(f"{g:<60} {s / 2**20:>8.1f}")
            for p, nb in sorted(groups[g], key=lambda t: -t[1]):
                if nb >= 2**19:
                    print(f"    {p:<56} {nb / 2**20:>8.1f}")
        if mat is not None:
            pb = petsc_mat_bytes(mat)
            tot += pb
            print(f"{'PETSc Mat arrays (C, estimated)':<60} {pb / 2**20:>8.1f}")
        print(f"{'solution x (caller), b (caller): 2 vectors':<60} {2 * vec / 2**20:>8.1f}")
        print(f"{'total held':<60} {(tot + 2 * vec) / 2**20:>8.1f}")
        print(f"(one vector of owned rows = {vec / 2**20:.1f} MiB; the Krylov work vectors are transient)")


if __name__ == "__main__":
    main()
