"""Shared helpers for the slasolve benchmarks.

* Timing: every comparison runs its contenders *alternately* inside one process
  (A, B, A, B, ...), repeated ``trials`` times, and reports the median and the
  spread (min, max, and the interquartile range) of each, plus the ratio of
  medians and the median of the per-trial ratios. Timings are collective: every
  trial starts after a barrier and the time of a trial is the slowest rank's.
* Problems: 2-D and 3-D Poisson (5- / 7-point) matrices built *per rank*: each
  rank creates only its own rows (PETSc's PETSC_DECIDE split), so no rank ever
  holds the global matrix.
* Output: a table on rank 0 and, with ``--json path``, a JSON record that
  ``bench/run_all.py`` collects.

The thread count is pinned to one per rank (``OMP_NUM_THREADS=1`` and
``torch.set_num_threads(1)``) so a rank uses one core, as a PETSc rank does.
"""
from __future__ import annotations

import json
import os
import platform
import resource
import socket
import statistics
import sys
import time
from typing import Callable, Dict, List, Optional, Sequence

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

from mpi4py import MPI  # noqa: E402

COMM = MPI.COMM_WORLD
RANK = COMM.Get_rank()
SIZE = COMM.Get_size()


def rprint(*args, **kwargs):
    """Print on rank 0 only (flushed)."""
    if RANK == 0:
        print(*args, **kwargs, flush=True)


# ---------------------------------------------------------------------------
# problems
def split_offsets(n: int, size: int = SIZE) -> np.ndarray:
    """PETSc's PETSC_DECIDE split of ``n`` rows over ``size`` ranks."""
    counts = np.full(size, n // size, dtype=np.int64)
    counts[: n % size] += 1
    return np.concatenate([[0], np.cumsum(counts)])


def poisson2d_rows(nx: int, rstart: int, rend: int):
    """CSR (indptr, global column ids, values) of rows ``[rstart, rend)`` of the
    2-D 5-point Poisson matrix on an ``nx x nx`` grid (Dirichlet, lexicographic
    numbering), built vectorised for these rows only. Columns sorted per row."""
    i = np.arange(rstart, rend, dtype=np.int64)
    ix, iy = i % nx, i // nx
    # column order per row: i-nx, i-1, i, i+1, i+nx (already sorted)
    cand = np.stack([i - nx, i - 1, i, i + 1, i + nx], axis=1)
    ok = np.stack([iy > 0, ix > 0, np.ones_like(ix, bool), ix < nx - 1, iy < nx - 1], axis=1)
    vals = np.where(cand == i[:, None], 4.0, -1.0)
    counts = ok.sum(1)
    indptr = np.zeros(rend - rstart + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, cand[ok], vals[ok].astype(np.float64)


def poisson3d_rows(n: int, rstart: int, rend: int):
    """Rows ``[rstart, rend)`` of the 3-D 7-point Poisson matrix on ``n^3`` nodes."""
    i = np.arange(rstart, rend, dtype=np.int64)
    ix, iy, iz = i % n, (i // n) % n, i // (n * n)
    nn = n * n
    cand = np.stack([i - nn, i - n, i - 1, i, i + 1, i + n, i + nn], axis=1)
    ok = np.stack([iz > 0, iy > 0, ix > 0, np.ones_like(ix, bool), ix < n - 1, iy < n - 1, iz < n - 1], axis=1)
    vals = np.where(cand == i[:, None], 6.0, -1.0)
    counts = ok.sum(1)
    indptr = np.zeros(rend - rstart + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return indptr, cand[ok], vals[ok].astype(np.float64)


def poisson3d_block(n: int, rows: int):
    """CSR of the first ``rows`` rows and columns of the ``n^3`` 3-D Poisson matrix (the
    diagonal block one rank would hold; the columns outside it dropped, a Dirichlet cut:
    still SPD), as ``(indptr, indices, values)``."""
    ip, ix, v = poisson3d_rows(n, 0, rows)
    keep = ix < rows
    r = np.repeat(np.arange(rows), np.diff(ip))[keep]
    indptr = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(r, minlength=rows), out=indptr[1:])
    return indptr, ix[keep], v[keep]


def poisson2d_scipy(nx: int):
    """The whole 2-D Poisson matrix as scipy CSR (single-process baselines only)."""
    import scipy.sparse as sp
    ip, ix, v = poisson2d_rows(nx, 0, nx * nx)
    return sp.csr_matrix((v, ix, ip), shape=(nx * nx, nx * nx))


def build_dpoisson2d(nx: int, comm=None, before_build: Optional[Callable[[], None]] = None):
    """Collective. A row-sharded slasolve ``DSparseTensor`` of the 2-D Poisson matrix,
    each rank building only its rows. Returns ``(dA, seconds)``. ``before_build`` runs
    between generating the CSR arrays and building the tensor (memory probes)."""
    from slasolve.dsparse import DSparseTensor
    comm = comm or COMM
    n = nx * nx
    offs = split_offsets(n, comm.Get_size())
    r = comm.Get_rank()
    comm.Barrier()
    t0 = time.perf_counter()
    ip, ix, v = poisson2d_rows(nx, int(offs[r]), int(offs[r + 1]))
    if before_build is not None:
        before_build()
    dA = DSparseTensor.from_local_rows(torch.from_numpy(ip), torch.from_numpy(ix), torch.from_numpy(v),
                                       (n, n), comm)
    t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return dA, t


def build_petsc_poisson2d(nx: int, comm=None, before_build: Optional[Callable[[], None]] = None):
    """Collective. The same matrix built directly as a PETSc MPIAIJ (raw petsc4py).
    Returns ``(Mat, seconds)``; ``before_build`` as in :func:`build_dpoisson2d`."""
    from petsc4py import PETSc
    comm = comm or COMM
    n = nx * nx
    offs = split_offsets(n, comm.Get_size())
    r = comm.Get_rank()
    comm.Barrier()
    t0 = time.perf_counter()
    ip, ix, v = poisson2d_rows(nx, int(offs[r]), int(offs[r + 1]))
    if before_build is not None:
        before_build()
    m = int(offs[r + 1] - offs[r])
    A = PETSc.Mat().createAIJ(size=((m, n), (m, n)), csr=(ip.astype(PETSc.IntType), ix.astype(PETSc.IntType), v),
                              comm=comm)
    A.assemble()
    t = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
    return A, t


def rhs_local(n_local: int, rstart: int, seed: int = 0) -> torch.Tensor:
    """A deterministic right-hand side: the same global vector whatever the rank count."""
    i = torch.arange(rstart, rstart + n_local, dtype=torch.float64)
    return torch.sin(0.37 * i + seed) + 1.0


# ---------------------------------------------------------------------------
# timing
class Solo:
    """A contender that runs on rank 0 alone (its objects built on ``COMM_SELF``) while
    the other ranks wait without spinning: the 1-rank baseline measured in the same
    run (same machine state) as the all-rank contender."""

    def __init__(self, fn: Callable[[], object]):
        self.fn = fn

    def __call__(self):
        if RANK == 0:
            self.fn()
        quiet_barrier()


def quiet_barrier(comm=None, poll: float = 2e-4) -> None:
    """Collective. A barrier whose waiters sleep (Open MPI's Barrier busy-polls a core)."""
    comm = comm or COMM
    if comm.Get_size() == 1:
        return
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def timed(fn: Callable[[], object], comm=None) -> float:
    """Collective. Seconds of one call (barrier before; max over ranks)."""
    comm = comm or COMM
    comm.Barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    return comm.allreduce(dt, op=MPI.MAX)


def timed_call(fn: Callable[[], object], comm=None):
    """Collective. ``(fn(), seconds)``: barrier first, slowest rank."""
    comm = comm or COMM
    comm.Barrier()
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    return out, comm.allreduce(dt, op=MPI.MAX)


def stats(samples: Sequence[float]) -> Dict[str, float]:
    s = sorted(samples)
    q = np.percentile(s, [25, 75]) if len(s) > 1 else [s[0], s[0]]
    return {"median": float(statistics.median(s)), "min": float(s[0]), "max": float(s[-1]),
            "q1": float(q[0]), "q3": float(q[1]), "n": len(s)}


def compare(contenders: Dict[str, Callable[[], object]], trials: int = 7, warmup: int = 1,
            inner: int = 1, comm=None) -> Dict[str, dict]:
    """Collective. Time the contenders alternately (A, B, A, B, ...) ``trials`` times,
    each sample the mean of ``inner`` back-to-back calls. Returns per contender
    ``stats`` plus the per-trial samples."""
    comm = comm or COMM
    names = list(contenders)
    for _ in range(warmup):
        for k in names:
            contenders[k]()
    samples: Dict[str, List[float]] = {k: [] for k in names}
    for t in range(trials):
        order = names if t % 2 == 0 else names[::-1]  # alternate who goes first
        for k in order:
            f = contenders[k]
            samples[k].append(timed(lambda: [f() for _ in range(inner)], comm) / inner)
    return {k: dict(stats(samples[k]), samples=samples[k]) for k in names}


def ratio(res: Dict[str, dict], a: str, b: str) -> Dict[str, float]:
    """Ratio a/b of medians and the spread of the per-trial ratios (same trials)."""
    pr = [x / y for x, y in zip(res[a]["samples"], res[b]["samples"])]
    s = stats(pr)
    return {"of_medians": res[a]["median"] / res[b]["median"], "median": s["median"],
            "min": s["min"], "max": s["max"]}


def fmt_t(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.1f} us"
    if s < 1:
        return f"{s * 1e3:.2f} ms"
    return f"{s:.3f} s"


def maxrss_mib() -> float:
    """Peak resident set of this process (MiB; Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ---------------------------------------------------------------------------
# environment and output
def machine_info() -> dict:
    info = {"host": socket.gethostname(), "platform": platform.platform(),
            "python": platform.python_version(), "cpus": os.cpu_count(),
            "mpi_size": SIZE, "torch": torch.__version__, "numpy": np.__version__,
            "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "mpi": MPI.Get_library_version().splitlines()[0].strip()}
    try:
        import scipy
        info["scipy"] = scipy.__version__
    except ImportError:
        pass
    try:
        from petsc4py import PETSc
        info["petsc"] = ".".join(str(v) for v in PETSc.Sys.getVersion())
    except ImportError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return info


def base_parser(description: str):
    import argparse
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--json", default=None, help="write the results as JSON to this path (rank 0)")
    p.add_argument("--quick", action="store_true", help="small sizes and few trials (development)")
    p.add_argument("--trials", type=int, default=None, help="timed trials per contender")
    return p


def write_json(path: Optional[str], payload: dict) -> None:
    """Rank 0 writes ``payload`` (plus machine info) to ``path``."""
    if path is None or RANK != 0:
        return
    payload = dict(payload)
    payload.setdefault("machine", machine_info())
    payload.setdefault("argv", sys.argv)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
