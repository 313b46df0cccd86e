"""Sparse direct solves: ``slasolve.spsolve`` vs raw petsc4py (MUMPS) vs SciPy SuperLU.

Run: ``mpirun -n 1 python bench/direct.py`` and ``mpirun -n 2 python bench/direct.py``
(``--quick`` for small sizes, ``--json PATH`` for the record ``bench/run_all.py`` collects).

What is measured (every trial gets NEW matrix values, ``D_k A D_k`` with ``D_k`` a smooth
positive diagonal as in ``bench/optloop.py``, so every contender refactorises numerically
in every trial and none ever finds the factors of the values it is given; MUMPS' symbolic
analysis is reused by all of them -- same nonzero pattern). The values are made before the
timed region and handed to each contender in its own storage order.

1. **factor + solve (+ adjoint)**, per factorisation kind:

   * ``raw_petsc4py``: what a competent petsc4py user writes by hand: one AIJ Mat
     (``createAIJ`` on the CSR, block size 3 for elasticity), one KSP ``preonly`` + PC
     ``lu`` (or ``cholesky``) with ``setFactorSolverType("mumps")``, made once. Forward:
     ``Mat.setValuesCSR`` + ``assemble``, ``ksp.solve(b, x)`` (PCSetUp refactorises
     numerically). Adjoint of ``loss = x . c``: ``ksp.solveTranspose(c, lam)`` with the
     same factors, ghost values of ``x`` by a VecScatter made once, value gradient
     ``-lam[row] x[col]`` per nonzero in NumPy.
   * ``spsolve``: ``vals = tensor(v_k).requires_grad_()``,
     ``x = slasolve.spsolve(dA.with_values(vals), b, factorization=kind)`` (forward), then
     ``slasolve.global_sum((x * c).sum()).backward()`` (backward: one transposed solve
     with the same factors + the value gradient) -> ``vals.grad``.
   * ``solve_direct``: ``slasolve.solve(dA.with_values(v_k), b, "direct", pc=kind)``
     (values without grad, forward only): the same code path as ``spsolve`` (it wraps it).

   Kinds: ``lu`` (``factorization="lu"`` vs PC ``lu``) -- the like-for-like comparison;
   ``auto`` (slasolve's default ``factorization=None``: an exact symmetry test of the new
   values on every refactorisation, then MUMPS Cholesky LDL^T since the matrices are
   symmetric) vs raw PC ``cholesky`` + MUMPS (a user who knows the matrix is symmetric).
   Forward and backward are timed separately (a barrier before each, the slowest rank
   each); ratios are per trial. Targets: forward slasolve / raw <= 1.10, backward / forward
   (slasolve) <= 0.3.
2. **solve only** (factors cached, values unchanged): ``spsolve(dA, b)`` vs ``ksp.solve``
   on the already factorised KSP (slasolve's per-call overhead: value comparison with the
   factorised snapshot, argument checks, backward-error check).
3. **SciPy** (one rank only, skipped in the 2-rank job): ``scipy.sparse.linalg.splu(A_csc)``
   + ``.solve(b)`` (new values each trial: SuperLU has no numeric-only refactorisation)
   vs ``slasolve.spsolve(..., backend="scipy")`` (SuperLU with Ruiz equilibration and a
   pivot check) vs ``slasolve.spsolve`` default backend (MUMPS LU).

Answers are checked in the run: after the timed trials the contenders solve the same
values once more and the relative max differences of ``x`` and of the value gradient
(slasolve vs raw; SciPy vs raw MUMPS) are printed and stored.

Problems: ``poisson2d`` -- 2-D 5-point Poisson on an ``nx x nx`` grid (rows built per rank
as ``common.poisson2d_rows``), default ``nx = 700`` (490k unknowns); ``elasticity3d`` --
3-D P1 linear elasticity on tetrahedra (:func:`slasolve.fem.problems.assemble_manufactured`,
as ``bench/optloop.py``), ``--elasticity-n`` cells per side (default 20: 27.8k unknowns).
Contenders alternate (order flipped every trial) after a warm-up; every sample starts after a
barrier and counts the slowest rank. Phase breakdown of slasolve from ``FactorizationInfo``
(``factor_time``, ``solve_time``; the rest is slasolve's own work).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COMM, RANK, SIZE, base_parser, compare, fmt_t, ratio, rprint, stats, timed_call,  # noqa: E402
                    write_json)
from optloop import Case, elasticity_case, poisson_case, raw_mat, raw_vectors  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

KINDS = {"lu": ("lu", "lu"), "auto": (None, "cholesky")}   # name -> (slasolve factorization, raw PC type)


def rel(comm, a, b) -> float:
    num = comm.allreduce(float(np.abs(np.asarray(a) - np.asarray(b)).max(initial=0.0)), op=MPI.MAX)
    den = comm.allreduce(float(np.abs(np.asarray(b)).max(initial=0.0)), op=MPI.MAX)
    return num / max(den, 1e-300)


def live_info(P: Case, fz):
    """Local. The live FactorizationInfo of the MUMPS factorisation ``spsolve`` caches on
    ``P.dA``'s layout for ``factorization=fz`` (None before the first call). Read for the
    phase breakdown only (the key is slasolve's internal cache key)."""
    cache = P.dA._layout.cache("factorizations")
    fac = cache.get(("petsc", fz or "auto", ()))
    return None if fac is None else fac.info


# ---------------------------------------------------------------------------
class RawDirect:
    """KSP preonly + PC lu/cholesky + MUMPS on one AIJ Mat, Vecs and ghost scatter made once."""

    def __init__(self, P: Case, pc_type: str):
        self.P = P
        self.A = A = raw_mat(P)
        ksp = PETSc.KSP().create(comm=P.comm)
        ksp.setOperators(A)
        ksp.setType("preonly")
        pc = ksp.getPC()
        pc.setType(pc_type)
        pc.setFactorSolverType("mumps")
        ksp.setFromOptions()
        self.ksp = ksp
        raw_vectors(self, A, P)
        self.grad = None

    def forward(self, v_csr):
        self.A.setValuesCSR(self.P.indptr, self.P.indices, v_csr, PETSc.InsertMode.INSERT_VALUES)
        self.A.assemble()
        self.ksp.setOperators(self.A)
        self.ksp.solve(self.b, self.x)
        return self.x.dot(self.cv)

    def solve_only(self):
        self.ksp.solve(self.b, self.x)

    def adjoint(self):
        self.ksp.solveTranspose(self.cv, self.lam)
        self.sc.scatter(self.x, self.xg, PETSc.InsertMode.INSERT_VALUES, PETSc.ScatterMode.FORWARD)
        lam = self.lam.getArray(readonly=True)
        xg = self.xg.getArray(readonly=True)
        self.grad = -lam[self.P.rows] * xg[self.colpos]

    def xarr(self):
        return self.x.getArray(readonly=True).copy()

    def destroy(self):
        for o in (self.sc, self.xg, self.x, self.lam, self.b, self.cv, self.ksp, self.A):
            o.destroy()


class SlaDirect:
    def __init__(self, P: Case, factorization):
        self.P, self.fz = P, factorization
        self.x = self.grad = self.loss = self.vals = None
        self.finfo = None

    def forward(self, v_sla, grad=True):
        P = self.P
        self.vals = torch.from_numpy(v_sla)
        if grad:
            self.vals.requires_grad_()
        x, self.finfo = slasolve.spsolve(P.dA.with_values(self.vals), P.b, factorization=self.fz,
                                         return_info=True)
        self.x = x
        self.loss = slasolve.global_sum((x * P.c).sum(), P.comm)

    def backward(self):
        self.loss.backward()
        self.grad = self.vals.grad

    def solve_direct(self, v_sla):
        P = self.P
        self.x = slasolve.solve(P.dA.with_values(torch.from_numpy(v_sla)), P.b, "direct", pc=self.fz)


# ---------------------------------------------------------------------------
def run_kind(P: Case, kind: str, trials: int, warmup: int, kcount) -> dict:
    fz, pc_type = KINDS[kind]
    comm = P.comm
    raw, sla = RawDirect(P, pc_type), SlaDirect(P, fz)
    names = ("spsolve", "raw_petsc4py", "solve_direct")
    S = {k: [] for k in ("spsolve_fwd", "spsolve_bwd", "raw_fwd", "raw_adj", "solve_direct_fwd")}
    ph = {k: [] for k in ("factor", "solve", "other")}

    def one(name, record):
        k = next(kcount)   # fresh values for every call: no contender ever finds cached factors
        vc, vs = P.values(k)
        if name == "raw_petsc4py":
            _, tf = timed_call(lambda: raw.forward(vc), comm)
            _, tb = timed_call(raw.adjoint, comm)
            if record:
                S["raw_fwd"].append(tf), S["raw_adj"].append(tb)
        elif name == "spsolve":
            f0 = live_info(P, fz)
            f0 = None if f0 is None else f0.copy()
            _, tf = timed_call(lambda: sla.forward(vs), comm)
            fi = live_info(P, fz).copy()   # before the backward adds its transposed solve
            _, tb = timed_call(sla.backward, comm)
            if record:
                S["spsolve_fwd"].append(tf), S["spsolve_bwd"].append(tb)
                if f0 is not None:   # this rank's MUMPS factor / solve time in the forward call
                    fac = fi.factor_time + fi.analysis_time - f0.factor_time - f0.analysis_time
                    sol = fi.solve_time - f0.solve_time
                    ph["factor"].append(fac), ph["solve"].append(sol), ph["other"].append(tf - fac - sol)
        else:
            _, tf = timed_call(lambda: sla.solve_direct(vs), comm)
            if record:
                S["solve_direct_fwd"].append(tf)

    for _ in range(warmup):
        for n in names:
            one(n, False)
    for t in range(trials):
        for n in (names if t % 2 == 0 else names[::-1]):
            one(n, True)
    # answers: the same values for every contender
    k = next(kcount)
    vc, vs = P.values(k)
    raw.forward(vc)
    raw.adjoint()
    sla.forward(vs)
    sla.backward()
    xs, gs = sla.x.detach().numpy(), P.to_csr(sla.grad.detach().reshape(-1).numpy())
    err_x, err_g = rel(comm, xs, raw.xarr()), rel(comm, gs, raw.grad)
    sla.solve_direct(vs)
    err_xd = rel(comm, sla.x.detach().numpy(), raw.xarr())
    fi = sla.finfo
    # solve only: factors cached, values unchanged (both now hold the factors of v_k)
    A_k = P.dA.with_values(torch.from_numpy(vs))
    slasolve.spsolve(A_k, P.b, factorization=fz)
    so = compare({"spsolve": lambda: slasolve.spsolve(A_k, P.b, factorization=fz),
                  "raw_petsc4py": raw.solve_only}, trials=trials, warmup=1, inner=2, comm=comm)
    raw.destroy()

    def st(key):
        return dict(stats(S[key]), samples=S[key])

    def pr(a, b):
        return stats([x / y for x, y in zip(S[a], S[b])])
    res = {"kind": kind, "slasolve_factorization": fi.factorization, "raw_pc": pc_type,
           "times": {k: st(k) for k in S},
           "ratio_forward": pr("spsolve_fwd", "raw_fwd"),
           "ratio_forward_solve_direct": pr("solve_direct_fwd", "raw_fwd"),
           "ratio_backward": pr("spsolve_bwd", "raw_adj"),
           "ratio_total": stats([(a + b) / (c + d) for a, b, c, d in
                                 zip(S["spsolve_fwd"], S["spsolve_bwd"], S["raw_fwd"], S["raw_adj"])]),
           "backward_over_forward": pr("spsolve_bwd", "spsolve_fwd"),
           "raw_adjoint_over_forward": pr("raw_adj", "raw_fwd"),
           "spsolve_phases": {k: float(np.median(v)) if v else None for k, v in ph.items()},
           "solve_only": {"times": so, "ratio": ratio(so, "spsolve", "raw_petsc4py")},
           "rel_err_x": err_x, "rel_err_grad": err_g, "rel_err_x_solve_direct": err_xd,
           "factor_nnz": fi.factor_nnz, "fill": fi.fill, "mumps_memory_mb": fi.memory_mb,
           "backward_error": fi.backward_error}
    return res


def run_scipy(P: Case, trials: int, warmup: int, kcount) -> dict:
    """One rank: SuperLU by hand vs slasolve's scipy backend vs slasolve MUMPS LU."""
    import scipy.sparse as sp
    import scipy.sparse.linalg as spla
    N = P.N
    b = P.b.numpy()
    out = {}

    def scipy_splu(vc):
        A = sp.csc_matrix(sp.csr_matrix((vc, P.indices, P.indptr), shape=(N, N)))
        out["splu"] = spla.splu(A).solve(b)

    def sla(vs, backend):
        out[backend] = slasolve.spsolve(P.dA.with_values(torch.from_numpy(vs)), P.b, backend=backend,
                                        factorization="lu").numpy()

    def mk(which):
        def f():
            vc, vs = P.values(next(kcount))
            if which == "scipy_splu":
                scipy_splu(vc)
            else:
                sla(vs, which.split("_")[1])
        return f
    names = ("scipy_splu", "slasolve_scipy", "slasolve_petsc")
    res = compare({n: mk(n) for n in names}, trials=trials, warmup=warmup, comm=MPI.COMM_SELF)
    vc, vs = P.values(next(kcount))
    scipy_splu(vc), sla(vs, "scipy"), sla(vs, "petsc")
    raw = RawDirect(P, "lu")
    raw.forward(vc)
    xr = raw.xarr()
    raw.destroy()
    return {"times": res, "ratio_slasolve_scipy_over_splu": ratio(res, "slasolve_scipy", "scipy_splu"),
            "ratio_slasolve_petsc_over_splu": ratio(res, "slasolve_petsc", "scipy_splu"),
            "rel_err_x_scipy_vs_raw_mumps": rel(MPI.COMM_SELF, out["splu"], xr),
            "rel_err_x_slasolve_scipy_vs_splu": rel(MPI.COMM_SELF, out["scipy"], out["splu"]),
            "rel_err_x_slasolve_petsc_vs_splu": rel(MPI.COMM_SELF, out["petsc"], out["splu"])}


def q(r):
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def report_head(case: dict) -> None:
    rprint(f"\n== {case['case']}: n = {case['n']}, nnz = {case['nnz']}, {case['ranks']} rank(s), "
           f"{case['trials']} trials, new values every call")


def report_kind(r: dict) -> None:
    t = r["times"]
    rprint(f"  -- factorisation {r['kind']}: slasolve -> {r['slasolve_factorization']}, raw PC {r['raw_pc']} "
           f"(MUMPS; factor nnz {r['factor_nnz']}, fill {r['fill']:.1f}, {r['mumps_memory_mb']:.0f} MB)")
    rprint(f"     {'time (median, slowest rank)':30s} {'forward':>10s} {'backward':>10s}")
    rprint(f"     {'spsolve':30s} {fmt_t(t['spsolve_fwd']['median']):>10s} {fmt_t(t['spsolve_bwd']['median']):>10s}")
    rprint(f"     {'solve(..., direct)':30s} {fmt_t(t['solve_direct_fwd']['median']):>10s} {'-':>10s}")
    rprint(f"     {'raw petsc4py (KSP preonly)':30s} {fmt_t(t['raw_fwd']['median']):>10s} "
           f"{fmt_t(t['raw_adj']['median']):>10s}")
    ph = r["spsolve_phases"]
    if ph.get("factor") is not None:
        rprint(f"     spsolve forward phases: factor {fmt_t(ph['factor'])}, MUMPS solve {fmt_t(ph['solve'])}, "
               f"slasolve other {fmt_t(ph['other'])}")
    rprint(f"     ratio forward spsolve / raw        {q(r['ratio_forward'])}   [target <= 1.10]")
    rprint(f"     ratio forward solve(direct) / raw  {q(r['ratio_forward_solve_direct'])}")
    rprint(f"     ratio backward spsolve / raw adj.  {q(r['ratio_backward'])}")
    rprint(f"     ratio fwd+bwd spsolve / raw        {q(r['ratio_total'])}")
    rprint(f"     backward / forward, slasolve       {q(r['backward_over_forward'])}   [target <= 0.3]")
    rprint(f"     adjoint / forward, raw             {q(r['raw_adjoint_over_forward'])}")
    so = r["solve_only"]
    rprint(f"     solve only (cached factors): spsolve {fmt_t(so['times']['spsolve']['median'])}, raw "
           f"{fmt_t(so['times']['raw_petsc4py']['median'])}, ratio {q(so['ratio'])}")
    rprint(f"     answers vs raw: x {r['rel_err_x']:.1e}, value gradient {r['rel_err_grad']:.1e}, "
           f"x of solve(direct) {r['rel_err_x_solve_direct']:.1e}; backward error {r['backward_error']:.1e}")


def report_scipy(s: dict) -> None:
    if s:
        t = s["times"]
        rprint(f"  -- one rank, n = {s['n']}, LU with new values each call: SciPy SuperLU vs slasolve")
        for k in ("scipy_splu", "slasolve_scipy", "slasolve_petsc"):
            rprint(f"     {k:30s} {fmt_t(t[k]['median']):>10s}  (min {fmt_t(t[k]['min'])}, max {fmt_t(t[k]['max'])})")
        rprint(f"     ratio slasolve scipy backend / splu  {q(s['ratio_slasolve_scipy_over_splu'])}")
        rprint(f"     ratio slasolve MUMPS / splu          {q(s['ratio_slasolve_petsc_over_splu'])}")
        rprint(f"     answers (x): splu vs raw MUMPS {s['rel_err_x_scipy_vs_raw_mumps']:.1e}, slasolve scipy vs "
               f"splu {s['rel_err_x_slasolve_scipy_vs_splu']:.1e}, slasolve MUMPS vs splu "
               f"{s['rel_err_x_slasolve_petsc_vs_splu']:.1e}")


def main(argv=None) -> int:
    import itertools
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--nx", type=int, default=None, help="2-D Poisson grid side (default 700; quick 120)")
    p.add_argument("--elasticity-n", type=int, default=None, help="3-D elasticity cells per side (default 20; "
                                                                  "quick 6)")
    p.add_argument("--cases", default="poisson2d,elasticity3d")
    p.add_argument("--kinds", default="lu,auto")
    p.add_argument("--no-scipy", action="store_true", help="skip the SciPy comparison (1 rank)")
    p.add_argument("--scipy-nx", type=int, default=None,
                   help="2-D Poisson grid side of the SciPy comparison (default 400: SuperLU with COLAMD "
                        "takes ~2 s per factorisation at 160k unknowns, far longer at 490k; quick 120)")
    p.add_argument("--warmup", type=int, default=1)
    a = p.parse_args(argv)
    nx = a.nx or (120 if a.quick else 700)
    snx = a.scipy_nx or (120 if a.quick else 400)
    ne = a.elasticity_n or (6 if a.quick else 20)
    trials = a.trials or (3 if a.quick else 5)
    torch.set_default_dtype(torch.float64)
    kcount = itertools.count()
    out = {"ranks": SIZE, "cases": []}
    for name in a.cases.split(","):
        P = poisson_case(nx) if name == "poisson2d" else elasticity_case(ne)
        case = {"case": P.name, "n": P.N, "nnz": P.nnz_global, "ranks": SIZE, "trials": trials, "kinds": []}
        report_head(case)
        for kind in a.kinds.split(","):
            case["kinds"].append(run_kind(P, kind, trials, a.warmup, kcount))
            report_kind(case["kinds"][-1])
        if SIZE == 1 and not a.no_scipy:
            Ps = P
            if name == "poisson2d" and snx != nx:
                P.dA._layout.cache("factorizations").clear()
                Ps = poisson_case(snx)
            case["scipy"] = run_scipy(Ps, max(3, trials - 2), a.warmup, kcount)
            case["scipy"].update(n=Ps.N, nnz=Ps.nnz_global)
            report_scipy(case["scipy"])
            del Ps
        out["cases"].append(case)
        P.dA._layout.cache("factorizations").clear()   # free the cached MUMPS factors
        del P
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
