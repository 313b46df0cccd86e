"""Krylov solves: slasolve (petsc and torch backends) vs raw petsc4py KSP vs SciPy.

Run: ``mpirun -n 1 python bench/krylov.py`` and ``mpirun -n 2 ...``.
Problem: 2-D 5-point Poisson (each rank builds its own rows), right-hand side
``sin(0.37 i) + 1``, zero initial guess, float64, one thread per rank.
Stopping test everywhere: unpreconditioned residual ``||b - Ax|| <= rtol ||b||``
(PETSc ``KSP_NORM_UNPRECONDITIONED``, SciPy's ``tol``).

Sections (contenders alternate inside each section, same run):

1. ``gamg``   -- CG + GAMG to ``rtol`` at the largest size: slasolve petsc backend
   vs a raw petsc4py KSP with identical options. "warm": both reuse their KSP
   (slasolve caches it per operator), "cold": KSP created and set up each time
   (slasolve's cache cleared). Target: slasolve <= 1.10x raw.
2. ``iter``   -- CG + Jacobi for a fixed number of iterations at the largest size:
   per-iteration time of slasolve petsc, slasolve torch, raw PETSc, SciPy
   (1 rank). Target: torch backend <= 1.5x PETSc per iteration.
3. ``sweep``  -- CG + Jacobi to ``rtol`` over smaller sizes: total time per backend.
4. ``adjoint`` -- forward vs forward+backward (``x.backward(w)``: the adjoint solve
   plus the value and right-hand-side gradients). Target: backward <= 1.2x forward.
5. With 2+ ranks: the same solves by rank 0 alone (``COMM_SELF``, other ranks
   asleep) as a contender in the same run, giving the speedup. Target >= 1.7x.
6. ``multirhs`` -- ``k`` right-hand sides (default 16) on 2-D Poisson ``--multirhs-nx``
   (default 500, n = 250k): ``solve(A, B)`` with ``B`` of shape ``(n, k)`` (one call)
   vs ``k`` single slasolve solves vs raw PETSc ``KSPMatSolve`` (dense B, X; called
   through ctypes: petsc4py 3.18 does not wrap it), for CG+GAMG and GMRES+hypre at that
   size and GMRES+ILU (block Jacobi/ILU with 2+ ranks; hundreds of iterations per column)
   at ``--multirhs-ilu-nx`` (default 200, n = 40k). Ratios: one call / k calls, one
   call / raw.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COMM, RANK, SIZE, Solo, base_parser, build_dpoisson2d, compare, fmt_t,  # noqa: E402
                    poisson2d_scipy, ratio, rhs_local, rprint, split_offsets, write_json)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402


def _solve_fn():
    try:
        from slasolve import solve  # public API once exported
    except ImportError:
        from slasolve.krylov import solve
    return solve


class RawKSP:
    """A raw petsc4py CG solve with the options slasolve's petsc backend sets."""

    def __init__(self, A, comm, pc: str, rtol: float, maxiter=None):
        from petsc4py import PETSc
        self.PETSc = PETSc
        self.A, self.comm, self.pc, self.rtol, self.maxiter = A, comm, pc, rtol, maxiter
        self.b = A.createVecLeft()
        self.x = A.createVecRight()
        self.ksp = None

    def set_rhs(self, b: torch.Tensor):
        self.b.getArray()[:] = b.numpy()

    def make(self):
        PETSc = self.PETSc
        ksp = PETSc.KSP().create(comm=self.comm)
        ksp.setOperators(self.A)
        ksp.setType("cg")
        ksp.getPC().setType(self.pc)
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        kw = {"rtol": self.rtol, "atol": 0.0}
        if self.maxiter is not None:
            kw["max_it"] = self.maxiter
        ksp.setTolerances(**kw)
        ksp.setFromOptions()
        ksp.setUp()
        return ksp

    def solve(self, cold: bool = False):
        if cold or self.ksp is None:
            if self.ksp is not None:
                self.ksp.destroy()
            self.ksp = self.make()
        self.x.set(0.0)
        self.ksp.solve(self.b, self.x)
        return self.ksp.getIterationNumber()


class Problem:
    """A 2-D Poisson problem on ``comm`` with every contender's objects."""

    def __init__(self, nx: int, comm, rtol: float, need_scipy: bool = False):
        self.nx, self.n, self.comm, self.rtol = nx, nx * nx, comm, rtol
        self.dA, self.t_assembly = build_dpoisson2d(nx, comm)
        r0, r1 = self.dA.row_range
        self.b = rhs_local(r1 - r0, r0)
        self.A = self.dA.to_petsc()
        self.S = poisson2d_scipy(nx) if need_scipy else None
        self.raw = {}

    def raw_ksp(self, pc, maxiter=None):
        key = (pc, maxiter)
        if key not in self.raw:
            r = RawKSP(self.A, self.comm, pc, self.rtol if maxiter is None else 1e-30, maxiter)
            r.set_rhs(self.b)
            self.raw[key] = r
        return self.raw[key]

    def sla(self, backend, pc, maxiter=None, cold=False, b=None, dA=None):
        solve = _solve_fn()
        dA = self.dA if dA is None else dA
        if cold:
            dA._layout.cache("solvers").clear()
        rtol = self.rtol if maxiter is None else 1e-30
        x, info = solve(dA, self.b if b is None else b, "cg", backend=backend, pc=pc, rtol=rtol,
                        maxiter=maxiter, return_info=True, raise_on_fail=maxiter is None)
        return x, info

    def scipy_cg(self, maxiter=None):
        import scipy.sparse.linalg as spla
        d = self.S.diagonal()
        Minv = spla.LinearOperator(self.S.shape, matvec=lambda r: r / d, dtype=np.float64)
        b = self.b.numpy()
        it = [0]

        def cb(_):
            it[0] += 1
        rtol = self.rtol if maxiter is None else 1e-30
        x, code = spla.cg(self.S, b, tol=rtol, atol=0.0, maxiter=maxiter, M=Minv, callback=cb)
        return x, it[0]


def rel_residual(dA, x, b) -> float:
    r = b - dA @ x
    num = COMM.allreduce(float(r.dot(r)))
    den = COMM.allreduce(float(b.dot(b)))
    return (num / den) ** 0.5


def section_gamg(P: Problem, P1, trials: int) -> dict:
    raw = P.raw_ksp("gamg")
    info = {}

    def sla(cold=False):
        x, inf = P.sla("petsc", "gamg", cold=cold)
        info["sla"] = inf.iterations
        info["x"] = x
    its = {}

    def rawf(cold=False):
        its["raw"] = raw.solve(cold=cold)
    cont = {"slasolve_petsc": sla, "raw_petsc": rawf}
    solo = {}
    if P1 is not None:
        if RANK == 0:
            raw1 = P1.raw_ksp("gamg")
            solo["sla"] = lambda: P1.sla("petsc", "gamg")
            solo["raw"] = lambda: raw1.solve()
        cont["slasolve_petsc_1rank"] = Solo(lambda: solo["sla"]())
        cont["raw_petsc_1rank"] = Solo(lambda: solo["raw"]())
    warm = compare(cont, trials=trials)
    cold = compare({"slasolve_petsc": lambda: sla(True), "raw_petsc": lambda: rawf(True)},
                   trials=max(3, trials // 2), warmup=0)
    out = {"pc": "gamg", "rtol": P.rtol, "n": P.n, "ranks": SIZE, "warm": warm, "cold": cold,
           "iterations": {"slasolve_petsc": info["sla"], "raw_petsc": its["raw"]},
           "rel_residual": rel_residual(P.dA, info["x"], P.b),
           "ratio_warm": ratio(warm, "slasolve_petsc", "raw_petsc"),
           "ratio_cold": ratio(cold, "slasolve_petsc", "raw_petsc")}
    if P1 is not None:
        out["speedup_slasolve_petsc"] = ratio(warm, "slasolve_petsc_1rank", "slasolve_petsc")
        out["speedup_raw_petsc"] = ratio(warm, "raw_petsc_1rank", "raw_petsc")
    return out


def section_iter(P: Problem, P1, trials: int, iters: int) -> dict:
    raw = P.raw_ksp("jacobi", maxiter=iters)
    cont = {"slasolve_petsc": lambda: P.sla("petsc", "jacobi", maxiter=iters),
            "raw_petsc": lambda: raw.solve(),
            "slasolve_torch": lambda: P.sla("torch", "jacobi", maxiter=iters)}
    if SIZE == 1 and P.S is not None:
        cont["scipy"] = lambda: P.scipy_cg(maxiter=iters)
    solo = {}
    if P1 is not None:
        if RANK == 0:
            raw1 = P1.raw_ksp("jacobi", maxiter=iters)
            solo["torch"] = lambda: P1.sla("torch", "jacobi", maxiter=iters)
            solo["raw"] = lambda: raw1.solve()
        cont["slasolve_torch_1rank"] = Solo(lambda: solo["torch"]())
        cont["raw_petsc_1rank"] = Solo(lambda: solo["raw"]())
    res = compare(cont, trials=trials)
    # iteration counts actually run
    _, i_p = P.sla("petsc", "jacobi", maxiter=iters)
    _, i_t = P.sla("torch", "jacobi", maxiter=iters)
    n_its = {"slasolve_petsc": i_p.iterations, "slasolve_torch": i_t.iterations,
             "raw_petsc": raw.solve()}
    if "scipy" in cont:
        n_its["scipy"] = P.scipy_cg(maxiter=iters)[1]
    per_it = {k: res[k]["median"] / max(1, n_its.get(k, iters)) for k in res}
    out = {"pc": "jacobi", "iterations": n_its, "n": P.n, "ranks": SIZE, "times": res,
           "per_iteration_s": per_it,
           "ratio_torch_over_petsc": ratio(res, "slasolve_torch", "raw_petsc"),
           "ratio_slasolve_petsc_over_raw": ratio(res, "slasolve_petsc", "raw_petsc")}
    if "scipy" in res:
        out["ratio_scipy_over_petsc"] = ratio(res, "scipy", "raw_petsc")
    if P1 is not None:
        out["speedup_slasolve_torch"] = ratio(res, "slasolve_torch_1rank", "slasolve_torch")
        out["speedup_raw_petsc"] = ratio(res, "raw_petsc_1rank", "raw_petsc")
    return out


def section_sweep(nxs, rtol: float, trials: int) -> list:
    rows = []
    for nx in nxs:
        P = Problem(nx, COMM, rtol, need_scipy=(SIZE == 1))
        raw = P.raw_ksp("jacobi")
        its = {}

        def run(name, f):
            def g():
                its[name] = f()
            return g
        cont = {"slasolve_petsc": run("slasolve_petsc", lambda: P.sla("petsc", "jacobi")[1].iterations),
                "slasolve_torch": run("slasolve_torch", lambda: P.sla("torch", "jacobi")[1].iterations),
                "raw_petsc": run("raw_petsc", lambda: raw.solve())}
        if SIZE == 1:
            cont["scipy"] = run("scipy", lambda: P.scipy_cg()[1])
        res = compare(cont, trials=trials)
        rows.append({"nx": nx, "n": P.n, "ranks": SIZE, "pc": "jacobi", "rtol": rtol, "times": res,
                     "iterations": dict(its), "assembly_s": P.t_assembly,
                     "per_iteration_s": {k: res[k]["median"] / max(1, its[k]) for k in res}})
    return rows


def section_adjoint(P: Problem, backend: str, pc: str, trials: int) -> dict:
    solve = _solve_fn()
    vals = P.dA.values.detach().clone().requires_grad_(True)
    dAg = P.dA.with_values(vals)
    b = P.b.clone().requires_grad_(True)
    # dL/dx of the same kind as b (smooth part + oscillation, global numbering), so the
    # adjoint solve is as hard as the forward one (an oscillatory w alone converges far faster)
    r0, _ = P.dA.row_range
    w = rhs_local(b.numel(), r0, seed=1)

    def fwd():
        return solve(dAg, b, "cg", backend=backend, pc=pc, rtol=P.rtol)

    def fwd_bwd():
        x = fwd()
        x.backward(w)
        vals.grad = None
        b.grad = None
    res = compare({"forward": fwd, "forward_backward": fwd_bwd}, trials=trials)
    bw = [fb - f for fb, f in zip(res["forward_backward"]["samples"], res["forward"]["samples"])]
    from common import stats
    bw_ratio = stats([x / f for x, f in zip(bw, res["forward"]["samples"])])
    return {"backend": backend, "pc": pc, "n": P.n, "ranks": SIZE, "rtol": P.rtol, "times": res,
            "backward_s": stats(bw), "backward_over_forward": bw_ratio}


class RawMatSolve:
    """Raw PETSc: one KSP, ``KSPMatSolve(ksp, B, X)`` on dense Mats (PETSc 3.18 solves the
    columns one after the other in C for every KSP type but HPDDM), with the options
    slasolve's petsc backend sets (unpreconditioned norm, right preconditioning for GMRES)."""

    def __init__(self, A, comm, method: str, pc: str, rtol: float, B: torch.Tensor):
        import ctypes
        from petsc4py import PETSc
        self.A, self.comm = A, comm
        n_loc, k = B.shape
        N = A.getSize()[0]
        self.Barr = np.asfortranarray(B.numpy())
        self.Xarr = np.zeros_like(self.Barr, order="F")
        self.B = PETSc.Mat().createDense(((n_loc, N), (PETSc.DECIDE, k)), array=self.Barr.reshape(-1, order="F"),
                                         comm=comm)
        self.X = PETSc.Mat().createDense(((n_loc, N), (PETSc.DECIDE, k)), array=self.Xarr.reshape(-1, order="F"),
                                         comm=comm)
        ksp = PETSc.KSP().create(comm=comm)
        ksp.setOperators(A)
        ksp.setType(method)
        pcname = "bjacobi" if pc == "ilu" and comm.Get_size() > 1 else pc
        ksp.getPC().setType(pcname)
        if method == "gmres":
            ksp.setPCSide(PETSc.PC.Side.RIGHT)
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        ksp.setTolerances(rtol=rtol, atol=0.0)
        ksp.setFromOptions()
        ksp.setUp()
        self.ksp = ksp
        # the same library petsc4py is linked against (already loaded: dlopen returns it)
        lib = ctypes.CDLL(PETSc.__file__)
        try:
            self._matsolve = lib.KSPMatSolve  # dlsym searches the module's dependencies (libpetsc)
        except AttributeError:
            self._matsolve = ctypes.CDLL("libpetsc_real.so.3.18").KSPMatSolve  # Debian's PETSc 3.18
        self._matsolve.argtypes = [ctypes.c_void_p] * 3
        self._matsolve.restype = ctypes.c_int

    def solve(self):
        self.Xarr[...] = 0.0
        ierr = self._matsolve(self.ksp.handle, self.B.handle, self.X.handle)
        if ierr:
            raise RuntimeError(f"KSPMatSolve failed with PETSc error code {ierr}")
        return self.Xarr


def section_multirhs(cases, k: int, rtol: float, trials: int) -> list:
    """k right-hand sides: one slasolve call vs k slasolve calls vs raw KSPMatSolve, for
    each ``(method, pc, nx)`` of ``cases``."""
    solve = _solve_fn()
    rows = []
    for method, pc, nx in cases:
        dA, _ = build_dpoisson2d(nx, COMM)
        r0, r1 = dA.row_range
        B = torch.stack([rhs_local(r1 - r0, r0, seed=j) for j in range(k)], 1).contiguous()
        A = dA.to_petsc()
        raw = RawMatSolve(A, COMM, method, pc, rtol, B)
        cols = [B[:, j].contiguous() for j in range(k)]
        its = {}

        def one_call():
            X, info = solve(dA, B, method, pc=pc, rtol=rtol, return_info=True)
            its["one_call"] = sum(i.iterations for i in info.per_rhs)
            return X

        def k_calls():
            n_it = 0
            for c in cols:
                _, info = solve(dA, c, method, pc=pc, rtol=rtol, return_info=True)
                n_it += info.iterations
            its["k_calls"] = n_it

        res = compare({"slasolve_one_call": one_call, "slasolve_k_calls": k_calls, "raw_matsolve": raw.solve},
                      trials=trials)
        X = one_call()
        Xr = torch.from_numpy(np.ascontiguousarray(raw.solve()))
        diff = COMM.allreduce(float(((X - Xr) ** 2).sum())) ** 0.5 / COMM.allreduce(float((Xr ** 2).sum())) ** 0.5
        rows.append({"method": method, "pc": pc, "k": k, "n": nx * nx, "ranks": SIZE, "rtol": rtol, "times": res,
                     "iterations": dict(its), "rel_diff_vs_raw": diff,
                     "ratio_one_over_k_calls": ratio(res, "slasolve_one_call", "slasolve_k_calls"),
                     "ratio_one_over_raw": ratio(res, "slasolve_one_call", "raw_matsolve"),
                     "ratio_k_calls_over_raw": ratio(res, "slasolve_k_calls", "raw_matsolve")})
        raw.ksp.destroy()
    return rows


def main():
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, default=None, help="grid size of the main problem (n = nx^2)")
    p.add_argument("--sweep", type=int, nargs="*", default=None, help="grid sizes of the sweep")
    p.add_argument("--iters", type=int, default=None, help="fixed iterations for the per-iteration section")
    p.add_argument("--rtol", type=float, default=1e-6)
    p.add_argument("--multirhs-nx", type=int, default=None, help="grid size of the multi-RHS section (n = nx^2)")
    p.add_argument("--multirhs-ilu-nx", type=int, default=None, help="grid size of the GMRES+ILU multi-RHS case")
    p.add_argument("--k", type=int, default=16, help="right-hand sides in the multi-RHS section")
    p.add_argument("--only", choices=["multirhs"], default=None, help="run only this section")
    a = p.parse_args()
    nx = a.nx or (200 if a.quick else 1000)
    sweep = a.sweep if a.sweep is not None else ([50, 100] if a.quick else [100, 200, 400])
    trials = a.trials or (3 if a.quick else 5)
    iters = a.iters or (50 if a.quick else 100)
    out = {"bench": "krylov", "ranks": SIZE, "trials": trials, "rtol": a.rtol,
           "problem": f"2-D 5-point Poisson nx={nx} (n={nx * nx}), rhs sin(0.37 i)+1, x0=0, float64",
           "options": "CG; unpreconditioned residual norm; atol=0; 1 thread per rank; "
                      "raw KSP: setType cg, PC type, NormType.UNPRECONDITIONED, setTolerances(rtol, atol=0)"}
    rprint(f"# krylov: 2-D Poisson n={nx * nx}, {SIZE} rank(s), rtol={a.rtol}, {trials} alternating trials")
    mnx = a.multirhs_nx or (150 if a.quick else 500)
    inx = a.multirhs_ilu_nx or (100 if a.quick else 200)
    mcases = [("cg", "gamg", mnx), ("gmres", "hypre", mnx), ("gmres", "ilu", inx)]
    if a.only == "multirhs":
        out["multirhs"] = _print_multirhs(section_multirhs(mcases, a.k, a.rtol, trials))
        write_json(a.json, out)
        return
    P = Problem(nx, COMM, a.rtol, need_scipy=(SIZE == 1))
    P1 = None
    if SIZE > 1:
        P1 = Problem(nx, MPI.COMM_SELF, a.rtol) if RANK == 0 else object()
    out["assembly_s"] = P.t_assembly

    g = section_gamg(P, P1, trials)
    out["gamg"] = g
    rprint(f"[gamg] CG+GAMG n={P.n}: slasolve petsc {fmt_t(g['warm']['slasolve_petsc']['median'])} "
           f"raw KSP {fmt_t(g['warm']['raw_petsc']['median'])} ratio {g['ratio_warm']['median']:.3f} "
           f"({g['ratio_warm']['min']:.3f}-{g['ratio_warm']['max']:.3f}) its {g['iterations']}; "
           f"cold (KSP setup each time) ratio {g['ratio_cold']['median']:.3f}")
    if SIZE > 1:
        rprint(f"        speedup {SIZE} ranks vs 1 (same run): slasolve {g['speedup_slasolve_petsc']['median']:.2f}x "
               f"raw {g['speedup_raw_petsc']['median']:.2f}x")

    it = section_iter(P, P1, trials, iters)
    out["iter"] = it
    rprint(f"[iter] CG+Jacobi, {iters} iterations, time per iteration:")
    for k, v in it["per_iteration_s"].items():
        rprint(f"        {k:<22} {fmt_t(v)}")
    rprint(f"        torch/petsc {it['ratio_torch_over_petsc']['median']:.3f} "
           f"({it['ratio_torch_over_petsc']['min']:.3f}-{it['ratio_torch_over_petsc']['max']:.3f}); "
           f"slasolve petsc/raw {it['ratio_slasolve_petsc_over_raw']['median']:.3f}")
    if SIZE > 1:
        rprint(f"        speedup {SIZE} vs 1 (same run): torch {it['speedup_slasolve_torch']['median']:.2f}x "
               f"raw petsc {it['speedup_raw_petsc']['median']:.2f}x")

    # adjoint at the sweep's largest size (keeps the 2-rank run inside run_all's timeout)
    Pm = Problem(sweep[-1], COMM, a.rtol) if sweep else P
    adj = [section_adjoint(Pm, "petsc", "gamg", trials), section_adjoint(Pm, "torch", "jacobi", trials)]
    out["adjoint"] = adj
    for r in adj:
        rprint(f"[adjoint] {r['backend']}+{r['pc']} n={r['n']}: forward {fmt_t(r['times']['forward']['median'])} "
               f"backward {fmt_t(r['backward_s']['median'])} backward/forward "
               f"{r['backward_over_forward']['median']:.3f} ({r['backward_over_forward']['min']:.3f}-"
               f"{r['backward_over_forward']['max']:.3f})")

    sw = section_sweep(sweep, a.rtol, trials)
    out["sweep"] = sw
    rprint("[sweep] CG+Jacobi to rtol, total time:")
    for r in sw:
        rprint(f"        n={r['n']:>8} " + "  ".join(f"{k} {fmt_t(v['median'])} ({r['iterations'][k]} it)"
                                                     for k, v in r["times"].items()))
    out["multirhs"] = _print_multirhs(section_multirhs(mcases, a.k, a.rtol, trials))
    write_json(a.json, out)


def _print_multirhs(rows):
    for r in rows:
        t = r["times"]
        rprint(f"[multirhs] {r['method']}+{r['pc']} n={r['n']} k={r['k']}: one call "
               f"{fmt_t(t['slasolve_one_call']['median'])}, {r['k']} calls {fmt_t(t['slasolve_k_calls']['median'])}, "
               f"raw KSPMatSolve {fmt_t(t['raw_matsolve']['median'])}; one/k-calls "
               f"{r['ratio_one_over_k_calls']['median']:.3f} ({r['ratio_one_over_k_calls']['min']:.3f}-"
               f"{r['ratio_one_over_k_calls']['max']:.3f}), one/raw {r['ratio_one_over_raw']['median']:.3f} "
               f"({r['ratio_one_over_raw']['min']:.3f}-{r['ratio_one_over_raw']['max']:.3f}), "
               f"k-calls/raw {r['ratio_k_calls_over_raw']['median']:.3f}; its {r['iterations']}, "
               f"|X - X_raw|/|X_raw| {r['rel_diff_vs_raw']:.1e}")
    return rows


if __name__ == "__main__":
    main()
