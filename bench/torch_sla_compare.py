"""slasolve vs torch-sla (0.4.0) on the same matrices, in the same run.

Run: ``mpirun -n 1 python bench/torch_sla_compare.py`` (torch-sla's single-process
``SparseTensor``) and ``mpirun -n 2 ...`` (torch-sla's distributed
``DSparseTensor`` over ``torch.distributed`` with the gloo backend).

torch-sla documents ``torchrun --standalone --nproc_per_node=P script.py`` for its
distributed mode. torchrun only sets the ``torch.distributed`` environment
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``); here both libraries must run in the *same* processes (slasolve
needs MPI), so the script is launched with ``mpirun`` and sets those variables
from the MPI rank (``MASTER_ADDR=127.0.0.1``, port from ``--port``) before
``dist.init_process_group("gloo")`` -- the same process group torchrun would
have created.

Sections (contenders alternate, one thread per rank):

* matvec -- ``dA @ x`` (slasolve row shard) vs torch-sla ``A @ x`` /
  ``D @ x_dt`` (DTensor[Shard(0)]), 2-D Poisson.
* cg     -- CG + Jacobi to ``||r|| <= rtol ||b||``: slasolve torch backend,
  slasolve petsc backend, torch-sla ``solve(..., method="cg",
  preconditioner="jacobi")``. torch-sla's single-process pytorch backend
  overwrites the caller's ``rtol`` with 1e-10 (torch_sla/linear_solve.py), so it
  gets ``atol = rtol * ||b||`` (its test is ``||r|| < max(atol, rtol ||b||)``),
  which gives the same stopping rule; the final relative residuals are reported.
* eigsh  -- the 4 smallest eigenvalues (``which="SA"``): slasolve ``eigsh``
  (SLEPc and torch backends) vs torch-sla ``eigsh`` (LOBPCG), errors against
  the analytic eigenvalues of the Poisson matrix.

Build time of each library's distributed matrix is reported too: torch-sla's
``DSparseTensor.partition`` takes the *global* matrix on every rank (its
documented constructor), slasolve's ``from_local_rows`` only the rank's rows.
"""
from __future__ import annotations

import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COMM, RANK, SIZE, base_parser, build_dpoisson2d, compare, fmt_t,  # noqa: E402
                    poisson2d_rows, ratio, rhs_local, rprint, stats, write_json)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

warnings.filterwarnings("ignore", message="Sparse invariant checks")
warnings.filterwarnings("ignore", message="Sparse CSR tensor support")
warnings.filterwarnings("ignore", message=".*is in beta.*")


def init_dist(port: int):
    import torch.distributed as dist
    if SIZE == 1:
        return None
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(port))
    os.environ["RANK"] = str(RANK)
    os.environ["WORLD_SIZE"] = str(SIZE)
    os.environ["LOCAL_RANK"] = str(RANK)
    dist.init_process_group("gloo", rank=RANK, world_size=SIZE)
    from torch.distributed.device_mesh import init_device_mesh
    return init_device_mesh("cpu", (SIZE,))


def global_coo(nx):
    n = nx * nx
    ip, ix, v = poisson2d_rows(nx, 0, n)
    row = torch.from_numpy(np.repeat(np.arange(n, dtype=np.int64), np.diff(ip)))
    return torch.from_numpy(v), row, torch.from_numpy(ix), n


class TSla:
    """torch-sla's matrix for this run: SparseTensor (1 process) or DSparseTensor."""

    def __init__(self, nx, mesh):
        import torch_sla as ts
        self.ts = ts
        COMM.Barrier()
        t0 = time.perf_counter()
        val, row, col, n = global_coo(nx)
        self.n = n
        A = ts.SparseTensor(val, row, col, (n, n))
        if mesh is None:
            self.A, self.D = A, None
        else:
            self.A = A
            self.D = ts.DSparseTensor.partition(A, mesh, partition_method="simple")
        self.build_s = COMM.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        bg = torch.sin(0.37 * torch.arange(n, dtype=torch.float64)) + 1.0
        self.b_global = bg
        self.b = bg if self.D is None else self.D.scatter(bg)

    def matvec(self, x):
        return (self.A if self.D is None else self.D) @ x

    def cg(self, rtol, maxiter=20000):
        ts = self.ts
        bn = float(torch.linalg.vector_norm(self.b_global))
        return ts.solve(self.A if self.D is None else self.D, self.b, method="cg", backend="pytorch",
                        preconditioner="jacobi", rtol=rtol, atol=rtol * bn, maxiter=maxiter)

    def residual(self, x) -> float:
        if self.D is None:
            r = self.b_global - self.A @ x
            return float(torch.linalg.vector_norm(r) / torch.linalg.vector_norm(self.b_global))
        r = self.b - self.D @ x
        rl = r.to_local() if hasattr(r, "to_local") else r
        num = COMM.allreduce(float(rl.dot(rl)))
        return (num ** 0.5) / float(torch.linalg.vector_norm(self.b_global))

    def eigsh(self, k):
        if self.D is None:
            return self.A.eigsh(k=k, which="SA")
        return self.D.eigsh(k=k, which="SA", tol=1e-6, maxiter=1000)


def poisson_eigs(nx, k):
    j = np.arange(1, nx + 1)
    lam1 = 2 - 2 * np.cos(j * np.pi / (nx + 1))
    return np.sort((lam1[:, None] + lam1[None, :]).ravel())[:k]


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, default=None, help="matvec grid (n = nx^2)")
    p.add_argument("--nx-cg", type=int, default=None)
    p.add_argument("--nx-eig", type=int, default=None)
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--port", type=int, default=29517)
    a = p.parse_args()
    nx = a.nx or (300 if a.quick else 1000)
    nx_cg = a.nx_cg or (100 if a.quick else 300)
    nx_eig = a.nx_eig or (40 if a.quick else 100)
    trials = a.trials or (3 if a.quick else 7)
    import torch_sla
    mesh = init_dist(a.port)
    mode = "SparseTensor (1 process)" if SIZE == 1 else \
        f"DSparseTensor over torch.distributed gloo, {SIZE} processes (env set from the MPI rank)"
    out = {"bench": "torch_sla", "ranks": SIZE, "trials": trials, "torch_sla": torch_sla.__version__,
           "torch_sla_mode": mode, "rtol": a.rtol,
           "problem": "2-D 5-point Poisson (Dirichlet), rhs sin(0.37 i)+1, float64, 1 thread per rank"}
    rprint(f"# slasolve vs torch-sla {torch_sla.__version__} ({mode}), {trials} alternating trials")
    from slasolve.krylov import solve

    # -- matvec ------------------------------------------------------------
    try:
        dA, t_sla = build_dpoisson2d(nx)
        T = TSla(nx, mesh)
        r0, r1 = dA.row_range
        x = rhs_local(r1 - r0, r0)
        xg = rhs_local(nx * nx, 0)
        xt = xg if T.D is None else T.D.scatter(xg)
        y1 = dA @ x
        y2 = T.matvec(xt)
        y2l = y2.to_local() if hasattr(y2, "to_local") else y2
        diff = COMM.allreduce(float(torch.linalg.vector_norm(y1 - y2l[: y1.numel()]) ** 2)) ** 0.5
        inner = max(1, int(2e6 // (nx * nx)))
        res = compare({"slasolve": lambda: dA @ x, "torch_sla": lambda: T.matvec(xt)}, trials=trials, inner=inner)
        out["matvec"] = {"n": nx * nx, "times": res, "ratio_torch_sla_over_slasolve": ratio(res, "torch_sla", "slasolve"),
                         "max_diff": diff, "build_s": {"slasolve_from_local_rows": t_sla,
                                                       "torch_sla": T.build_s}}
        rprint(f"[matvec] n={nx * nx}: slasolve {fmt_t(res['slasolve']['median'])} torch-sla "
               f"{fmt_t(res['torch_sla']['median'])} (torch-sla/slasolve "
               f"{out['matvec']['ratio_torch_sla_over_slasolve']['median']:.2f}); build: slasolve "
               f"{fmt_t(t_sla)}, torch-sla {fmt_t(T.build_s)}; |diff| {diff:.1e}")
        del T, dA
    except Exception as e:  # record and go on (the other sections are independent)
        out["matvec"] = {"error": repr(e)}
        rprint(f"[matvec] failed: {e!r}")

    # -- CG ------------------------------------------------------------------
    try:
        dA, _ = build_dpoisson2d(nx_cg)
        T = TSla(nx_cg, mesh)
        r0, r1 = dA.row_range
        b = rhs_local(r1 - r0, r0)
        info = {}

        def sla(backend):
            def f():
                x, inf = solve(dA, b, "cg", backend=backend, pc="jacobi", rtol=a.rtol, return_info=True)
                info[backend] = (x, inf.iterations)
            return f
        got = {}

        def tsf():
            got["x"] = T.cg(a.rtol)
        res = compare({"slasolve_torch": sla("torch"), "slasolve_petsc": sla("petsc"), "torch_sla": tsf},
                      trials=max(3, trials // 2))
        rr = {}
        for k in ("torch", "petsc"):
            xx = info[k][0]
            r = b - dA @ xx
            rr["slasolve_" + k] = (COMM.allreduce(float(r.dot(r))) / COMM.allreduce(float(b.dot(b)))) ** 0.5
        rr["torch_sla"] = T.residual(got["x"])
        out["cg"] = {"n": nx_cg * nx_cg, "pc": "jacobi", "times": res, "rel_residual": rr,
                     "iterations_slasolve": {k: v[1] for k, v in info.items()},
                     "ratio_torch_sla_over_slasolve_torch": ratio(res, "torch_sla", "slasolve_torch"),
                     "ratio_torch_sla_over_slasolve_petsc": ratio(res, "torch_sla", "slasolve_petsc")}
        rprint(f"[cg] CG+Jacobi n={nx_cg * nx_cg} rtol={a.rtol}: " + "  ".join(
            f"{k} {fmt_t(v['median'])} (res {rr[k]:.1e})" for k, v in res.items())
            + f"; slasolve iterations {out['cg']['iterations_slasolve']}")
        del T, dA
    except Exception as e:
        out["cg"] = {"error": repr(e)}
        rprint(f"[cg] failed: {e!r}")

    # -- eigsh ---------------------------------------------------------------
    try:
        from slasolve.eigen import eigsh
        k = 4
        dA, _ = build_dpoisson2d(nx_eig)
        T = TSla(nx_eig, mesh)
        exact = poisson_eigs(nx_eig, k)
        vals = {}

        def sla(backend):
            def f():
                # a square grid has repeated eigenvalues: use block methods everywhere
                # (SLEPc's LOBPCG; Krylov-Schur would return each repeated one once)
                opts = {"eps_type": "lobpcg", "st_pc_type": "jacobi"} if backend == "slepc" else None
                w, V = eigsh(dA, k=k, which="SA", tol=1e-6, backend=backend, petsc_options=opts)
                vals["slasolve_" + backend] = np.sort(w.detach().numpy())
            return f

        def tsf():
            w, V = T.eigsh(k)
            vals["torch_sla"] = np.sort(np.asarray(w.detach().cpu().numpy()).ravel())[:k]
        cont = {"slasolve_slepc": sla("slepc"), "slasolve_torch": sla("torch"), "torch_sla": tsf}
        res = compare(cont, trials=3 if SIZE == 1 else 2, warmup=0)
        err = {kk: float(np.max(np.abs(v - exact) / exact)) for kk, v in vals.items()}
        out["eigsh"] = {"n": nx_eig * nx_eig, "k": k, "which": "SA", "times": res, "max_rel_error": err,
                        "tol": "slasolve tol=1e-6; torch-sla 1-process eigsh has no tol argument (its default), "
                               "distributed tol=1e-6",
                        "ratio_torch_sla_over_slasolve_torch": ratio(res, "torch_sla", "slasolve_torch"),
                        "ratio_torch_sla_over_slasolve_slepc": ratio(res, "torch_sla", "slasolve_slepc")}
        rprint(f"[eigsh] k={k} SA n={nx_eig * nx_eig}: " + "  ".join(
            f"{kk} {fmt_t(v['median'])} (err {err[kk]:.1e})" for kk, v in res.items()))
    except Exception as e:
        out["eigsh"] = {"error": repr(e)}
        rprint(f"[eigsh] failed: {e!r}")
    write_json(a.json, out)
    if SIZE > 1:
        import torch.distributed as dist
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
