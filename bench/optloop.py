"""Optimisation-loop iteration: slasolve vs raw petsc4py doing the same work by hand.

Run: ``mpirun -n 1 python bench/optloop.py`` and ``mpirun -n 2 ...``.

One iteration of a gradient-based optimisation loop, with NEW matrix values every
iteration (a symmetric rescaling ``D_k A D_k`` of the assembled values, ``D_k`` the
positive diagonal ``1 + 0.3 sin(0.7 k + 2 pi i / N)`` of the global unknown ``i``: SPD,
every value changes, smooth over the domain). The values of
iteration ``k`` are made before the timed region (assembly excluded) and fed to both
contenders in their own storage order:

* **slasolve**: ``vals = tensor(v_k).requires_grad_()``, ``A_k = A.with_values(vals)``,
  ``x = slasolve.solve(A_k, b, "cg", pc="gamg", rtol=1e-8)``,
  ``loss = global_sum((x * c).sum())``, ``loss.backward()`` -> ``vals.grad``.
* **raw petsc4py**: ``Mat.setValuesCSR`` (same pattern, int32 index arrays made once)
  and ``assemble``, ``ksp.setOperators`` + ``ksp.setUp`` (GAMG rebuilt), ``ksp.solve``
  (forward), ``loss = x.dot(c)``, ``ksp.solve(c, lam)`` (adjoint: ``A`` is symmetric),
  ghost values of ``x`` by a ``VecScatter`` made once, then the value gradient
  ``-lam[row_k] * x[col_k]`` per nonzero in NumPy.

Both KSPs: CG + GAMG, unpreconditioned residual norm, ``rtol`` 1e-8, ``atol`` 0, and
``-pc_gamg_reuse_interpolation false`` (what slasolve sets, so the same preconditioner is
built). The answers are checked against each other (x and gradient, relative max error).

Cases: ``poisson2d`` -- the 2-D 5-point Poisson matrix on an ``nx x nx`` grid (the P1
stiffness matrix of the right-triangle mesh with Dirichlet nodes eliminated), rows built
per rank, ``nx = 1000`` (1M unknowns); ``elasticity3d`` -- 3-D P1 linear elasticity on
tetrahedra as ``examples/fem_solve.py --problem elasticity --dim 3`` assembles it
(:func:`slasolve.fem.problems.assemble_manufactured`, homogeneous Dirichlet conditions;
block size 3, no near-nullspace, as fem_solve), ``--elasticity-n`` cells per side.

Contenders alternate (order flipped every trial) after a warm-up; each trial starts after a
barrier and counts the slowest rank. Per-phase times: slasolve's ``info.times`` (forward)
and ``info.adjoint.times`` (backward's adjoint solve), the value gradient being the rest of
the backward; raw: each phase timed by hand. Phase figures are the per-rank mean over
the timed trials, then the max over ranks.
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COMM, RANK, SIZE, base_parser, fmt_t, poisson2d_rows, ratio, rhs_local,  # noqa: E402
                    rprint, split_offsets, stats, timed, write_json)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

RTOL = 1e-8


# ---------------------------------------------------------------------------
# problems: a row-sharded slasolve tensor plus the scalar CSR a raw user would hold
class Case:
    """The problem on this rank: ``dA`` (slasolve), ``b``, ``c`` (loss weights), and the
    scalar CSR (int32 indptr / global column ids) with ``perm`` taking slasolve's value
    order to that CSR order (``v_csr = v_sla.reshape(-1)[perm]``)."""

    def __init__(self, name: str, dA, b: torch.Tensor, bs: int = 1):
        self.name, self.dA, self.b, self.bs = name, dA, b.detach().contiguous(), bs
        self.comm = dA.comm
        r0, r1 = dA.row_range
        self.r0, self.m, self.N = r0, r1 - r0, dA.global_shape[0] * bs
        self.c = rhs_local(self.m, r0, seed=1)
        V0 = dA.values.detach()
        self.vshape = tuple(V0.shape)
        if bs > 1:   # scalar CSR of the block tensor and the permutation of the values
            ids = torch.arange(V0.numel(), dtype=torch.float64).reshape(V0.shape)
            sl = dA.with_values(ids).local.scalar()
            self.perm = sl.values.to(torch.int64).numpy()
            ip, ix = sl.indptr, sl.indices
        else:
            self.perm = None
            ip, ix = dA.local.indptr, dA.local.indices
        self.indptr = ip.numpy().astype(PETSc.IntType)
        self.indices = ix.numpy().astype(PETSc.IntType)
        self.rows = np.repeat(np.arange(self.m, dtype=np.int64), np.diff(self.indptr))  # local row per nz
        self.V0 = self.to_csr(V0.reshape(-1).numpy())
        self.nnz_global = self.comm.allreduce(int(self.indices.size))

    def to_csr(self, v_sla: np.ndarray) -> np.ndarray:
        return v_sla if self.perm is None else v_sla[self.perm]

    def to_sla(self, v_csr: np.ndarray) -> np.ndarray:
        if self.perm is None:
            return v_csr
        out = np.empty_like(v_csr)
        out[self.perm] = v_csr
        return out

    def values(self, k: int):
        """Values of iteration ``k``: ``D_k A D_k`` (CSR order, slasolve order)."""
        def d(i):  # smooth over the domain (GAMG's near-nullspace stays smooth)
            return 1.0 + 0.3 * np.sin(0.7 * k + 2 * np.pi * i / self.N)
        # d_i d_j first: exactly symmetric values for a symmetric A ((a d_i) d_j and (a d_j) d_i round apart)
        v = self.V0 * (d(self.rows + self.r0) * d(self.indices.astype(np.int64)))
        return v, self.to_sla(v).reshape(self.vshape)


def raw_mat(P) -> "PETSc.Mat":
    """Collective. The AIJ Mat a raw petsc4py user makes from the case's CSR (block size set)."""
    A = PETSc.Mat().createAIJ(size=((P.m, P.N), (P.m, P.N)), bsize=P.bs if P.bs > 1 else None,
                              csr=(P.indptr, P.indices, P.V0), comm=P.comm)
    A.setOption(PETSc.Mat.Option.NEW_NONZERO_ALLOCATION_ERR, True)
    A.assemble()
    return A


def raw_vectors(obj, A, P) -> None:
    """Local (the scatter's creation is collective). On ``obj``: ``b``, ``cv`` (loss weights),
    ``x``, ``lam`` Vecs of ``A`` and the scatter ``sc`` of x's values at every column this rank's
    rows touch into ``xg`` (``colpos``: each stored entry's position there), as a raw petsc4py
    user writes the value gradient."""
    obj.b = A.createVecLeft()
    obj.b.getArray()[:] = P.b.numpy()
    obj.cv = A.createVecLeft()
    obj.cv.getArray()[:] = P.c.numpy()
    obj.x, obj.lam = A.createVecRight(), A.createVecRight()
    cols = np.unique(P.indices)
    obj.colpos = np.searchsorted(cols, P.indices)
    obj.xg = PETSc.Vec().createSeq(cols.size, comm=PETSc.COMM_SELF)
    isg = PETSc.IS().createGeneral(cols.astype(PETSc.IntType), comm=PETSc.COMM_SELF)
    obj.sc = PETSc.Scatter().create(obj.x, isg, obj.xg, None)


def poisson_case(nx: int) -> Case:
    from slasolve.dsparse import DSparseTensor
    n = nx * nx
    offs = split_offsets(n)
    r0, r1 = int(offs[RANK]), int(offs[RANK + 1])
    ip, ix, v = poisson2d_rows(nx, r0, r1)
    dA = DSparseTensor.from_local_rows(torch.from_numpy(ip), torch.from_numpy(ix), torch.from_numpy(v),
                                       (n, n), COMM)
    return Case("poisson2d", dA, rhs_local(r1 - r0, r0))


def elasticity_case(ncell: int) -> Case:
    from slasolve.fem import box_mesh
    from slasolve.fem.problems import assemble_manufactured
    mesh = box_mesh(ncell, cell="tetra", comm=COMM)
    space, A, b, _ = assemble_manufactured("elasticity", mesh)
    return Case("elasticity3d", A, b, bs=3)


# ---------------------------------------------------------------------------
# contenders
class Raw:
    """A competent petsc4py user's loop: Mat, KSP, work Vecs and the ghost scatter made once."""

    def __init__(self, P: Case):
        self.P = P
        self.A = A = raw_mat(P)
        opts = PETSc.Options()
        opts["pc_gamg_reuse_interpolation"] = "false"
        ksp = PETSc.KSP().create(comm=P.comm)
        ksp.setOperators(A)
        ksp.setType("cg")
        ksp.getPC().setType("gamg")
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        ksp.setTolerances(rtol=RTOL, atol=0.0, max_it=10000)
        ksp.setFromOptions()
        opts.delValue("pc_gamg_reuse_interpolation")
        self.ksp = ksp
        raw_vectors(self, A, P)
        self.times = {}
        self.grad = self.xout = None
        self.iterations = None

    def _t(self, key, t0):
        t = time.perf_counter()
        self.times[key] = self.times.get(key, 0.0) + t - t0
        return t

    def step(self, v_csr: np.ndarray) -> float:
        A, ksp = self.A, self.ksp
        t = t0 = time.perf_counter()
        A.setValuesCSR(self.P.indptr, self.P.indices, v_csr, PETSc.InsertMode.INSERT_VALUES)
        A.assemble()
        t = self._t("refill", t)
        ksp.setOperators(A)
        ksp.setUp()
        t = self._t("pc_setup", t)
        self.x.set(0.0)
        ksp.solve(self.b, self.x)
        self.iterations = ksp.getIterationNumber()
        loss = self.x.dot(self.cv)
        t = self._t("forward_solve", t)
        self.lam.set(0.0)
        ksp.solve(self.cv, self.lam)
        t = self._t("adjoint_solve", t)
        self.sc.scatter(self.x, self.xg, PETSc.InsertMode.INSERT_VALUES, PETSc.ScatterMode.FORWARD)
        lam = self.lam.getArray(readonly=True)
        xg = self.xg.getArray(readonly=True)
        self.grad = -lam[self.P.rows] * xg[self.colpos]
        t = self._t("value_grad", t)
        self.times["total"] = self.times.get("total", 0.0) + t - t0
        return loss


class Sla:
    """slasolve's loop: new values -> with_values -> solve -> loss -> backward."""

    def __init__(self, P: Case):
        self.P = P
        self.times = {}
        self.grad = self.x = None
        self.iterations = None

    def step(self, v_sla: np.ndarray) -> float:
        P = self.P
        t0 = time.perf_counter()
        vals = torch.from_numpy(v_sla).requires_grad_()
        Ak = P.dA.with_values(vals)
        x, info = slasolve.solve(Ak, P.b, "cg", pc="gamg", rtol=RTOL, return_info=True)
        loss = slasolve.global_sum((x * P.c).sum(), P.comm)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.grad, self.x, self.iterations = vals.grad, x.detach(), info.iterations
        ft, at = info.times, info.adjoint.times
        add = self.times

        def acc(k, v):
            add[k] = add.get(k, 0.0) + v
        acc("refill", ft.get("refill", 0.0))
        acc("pc_setup", ft.get("setup", 0.0))
        acc("forward_solve", ft.get("solve", 0.0) + ft.get("verify", 0.0))
        acc("forward_other", (t1 - t0) - ft.get("refill", 0.0) - ft.get("setup", 0.0)
            - ft.get("solve", 0.0) - ft.get("verify", 0.0))
        acc("adjoint_solve", at.get("total", 0.0))
        acc("adjoint_refill+setup", at.get("refill", 0.0) + at.get("setup", 0.0))
        acc("value_grad", (t2 - t1) - at.get("total", 0.0))
        acc("total", t2 - t0)
        return float(loss.detach())


PHASES = ("refill", "pc_setup", "forward_solve", "forward_other", "adjoint_solve", "adjoint_refill+setup",
          "value_grad", "total")


def run_case(P: Case, trials: int, warmup: int) -> dict:
    raw, sla = Raw(P), Sla(P)
    k = 0
    names = ("slasolve", "raw_petsc4py")
    samples = {n: [] for n in names}

    def one(name, k, record):
        vc, vs = P.values(k)
        if name == "raw_petsc4py":
            f = lambda: raw.step(vc)  # noqa: E731
        else:
            f = lambda: sla.step(vs)  # noqa: E731
        dt = timed(f, P.comm)
        if record:
            samples[name].append(dt)

    for _ in range(warmup):
        for n in names:
            one(n, k, False)
        k += 1
    raw.times.clear(), sla.times.clear()
    for t in range(trials):
        for n in (names if t % 2 == 0 else names[::-1]):
            one(n, k, True)
        k += 1
    # the two contenders ran the same values last: compare the answers
    xr = raw.x.getArray(readonly=True)
    xs = sla.x.numpy()
    gs = P.to_csr(sla.grad.detach().reshape(-1).numpy())

    def rel(a, b):
        num = P.comm.allreduce(float(np.abs(a - b).max(initial=0.0)), op=MPI.MAX)
        den = P.comm.allreduce(float(np.abs(b).max(initial=0.0)), op=MPI.MAX)
        return num / max(den, 1e-300)
    err_x, err_g = rel(xs, xr), rel(gs, raw.grad)
    res = {n: dict(stats(samples[n]), samples=samples[n]) for n in names}
    phases = {}
    for name, c in (("slasolve", sla), ("raw_petsc4py", raw)):
        keys = [p for p in PHASES if p in c.times]
        loc = np.array([c.times[p] / trials for p in keys])
        P.comm.Allreduce(MPI.IN_PLACE, loc, op=MPI.MAX)
        phases[name] = dict(zip(keys, loc.tolist()))
    return {"case": P.name, "n": P.N, "nnz": P.nnz_global, "ranks": P.comm.Get_size(), "trials": trials,
            "times": res, "ratio": ratio(res, "slasolve", "raw_petsc4py"), "phases": phases,
            "iterations": {"slasolve": sla.iterations, "raw_petsc4py": raw.iterations},
            "rel_err_x": err_x, "rel_err_grad": err_g}


def report(r: dict) -> None:
    rq = r["ratio"]
    rprint(f"\n== {r['case']}: n = {r['n']}, nnz = {r['nnz']}, {r['ranks']} rank(s), CG + GAMG to rtol {RTOL:g}, "
           f"iterations slasolve {r['iterations']['slasolve']} / raw {r['iterations']['raw_petsc4py']}")
    for n in ("slasolve", "raw_petsc4py"):
        s = r["times"][n]
        rprint(f"  {n:14s} median {fmt_t(s['median'])}  (min {fmt_t(s['min'])}, max {fmt_t(s['max'])})")
    rprint(f"  ratio slasolve / raw: {rq['median']:.3f} (per-trial min {rq['min']:.3f}, max {rq['max']:.3f}; "
           f"of medians {rq['of_medians']:.3f})")
    rprint(f"  answers: max rel diff x {r['rel_err_x']:.1e}, value gradient {r['rel_err_grad']:.1e}")
    rprint(f"  {'phase (mean per iteration, slowest rank)':44s} {'slasolve':>10s} {'raw':>10s}")
    ps, pr = r["phases"]["slasolve"], r["phases"]["raw_petsc4py"]
    for p in PHASES:
        a = fmt_t(ps[p]) if p in ps else "-"
        b = fmt_t(pr[p]) if p in pr else "-"
        rprint(f"  {p:44s} {a:>10s} {b:>10s}")


def main(argv=None) -> int:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--nx", type=int, default=None, help="2-D Poisson grid side (default 1000; quick 200)")
    p.add_argument("--elasticity-n", type=int, default=None, help="3-D elasticity cells per side (default 20; "
                                                                  "quick 8)")
    p.add_argument("--cases", default="poisson2d,elasticity3d")
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    nx = a.nx or (200 if a.quick else 1000)
    ne = a.elasticity_n or (8 if a.quick else 20)
    trials = a.trials or (3 if a.quick else 5)
    torch.set_default_dtype(torch.float64)
    out = {"rtol": RTOL, "ranks": SIZE, "cases": []}
    for name in a.cases.split(","):
        P = poisson_case(nx) if name == "poisson2d" else elasticity_case(ne)
        r = run_case(P, trials, a.warmup)
        report(r)
        out["cases"].append(r)
        del P
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
