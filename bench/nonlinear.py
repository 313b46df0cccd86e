"""Newton-Krylov: ``slasolve.nonlinear_solve`` vs raw petsc4py SNES on the same FEM residual.

Run: ``mpirun -n 1 python bench/nonlinear.py`` and ``mpirun -n 2 python bench/nonlinear.py``
(``--quick`` for small sizes, ``--json PATH`` for the record ``bench/run_all.py`` collects).

Problem: the FEM layer's :class:`slasolve.fem.NonlinearDiffusion`,
``-div(kappa (1 + u^2) grad u) = 4 + 2x`` on the unit square, P1 triangles (``box_mesh``,
``n x n`` squares cut in two: ``2 n^2`` cells), Dirichlet ``u = 0.5 + y`` on ``x = 0``,
Neumann flux ``1 + y`` on ``x = 1``, ``kappa = 1 + 0.5 sin(3 x_c) y_c`` per cell (``x_c`` the
cell centroid). The tangent is not symmetric: GMRES + GAMG. Sizes: ``--n 64`` (8192 cells, a
notebook size) and ``--n-large 500`` (500k cells, 251k unknowns); ``--quick``: 24 and 64.

**What is measured: the solver pipeline around the same FEM code.** Both contenders evaluate
the residual and the Jacobian with slasolve's own FEM assembly
(``P.residual(u, kappa)``, ``P.jacobian(u, kappa)``), so the difference is what each solver
pipeline adds around it: the torch <-> PETSc conversions, the Jacobian copy into PETSc, the
set-up, slasolve's collective argument / result checks and its final residual re-check.
Assembly itself is *not* compared with anything here (``bench/fem.py`` does that).

* ``slasolve``: ``u, info = slasolve.nonlinear_solve(P.residual, u0, kappa, jacobian=P.jacobian,
  rtol=1e-8, linear_solver=dict(method="gmres", pc="gamg", rtol=1e-8), return_info=True)``
  (PETSc backend: a fresh SNES each call), with ``kappa`` requiring grad; then
  ``loss = slasolve.global_sum((w * u).sum())`` and ``loss.backward()`` (implicit function
  theorem: Jacobian at the solution, ONE transposed GMRES + GAMG solve at rtol 1e-10, one
  residual evaluation with autograd) -> ``kappa.grad``.
* ``raw_snes``: what a petsc4py user writes by hand, objects made once: one SNES
  ``newtonls`` with line search ``bt``, ``rtol`` 1e-8, ``atol`` = ``stol`` = 0, max 50
  iterations, no function-evaluation limit, no divergence test; KSP ``gmres`` (restart 30,
  right preconditioning, unpreconditioned norm, ``rtol`` 1e-8, ``atol`` 0) + PC ``gamg``
  with ``-pc_gamg_reuse_interpolation false`` -- exactly the settings slasolve's SNES backend
  makes. Residual callback: ``X`` -> torch (one copy) -> ``P.residual`` -> ``F``; Jacobian
  callback: ``P.jacobian`` -> ``Mat.setValuesCSR`` (int32 index arrays made once) +
  ``assemble``. Gradient by hand: ``P.jacobian`` at the solution into a second Mat, a KSP
  (GMRES + GAMG, rtol 1e-10, as slasolve's adjoint) ``solveTranspose(w, lam)``, then
  ``-(dR/dkappa)^T lam`` by ``torch.autograd.grad`` through one ``P.residual``.

Forward (the solve) and gradient are timed separately (barrier before each, slowest rank);
contenders alternate, order flipped every trial, after a warm-up. Reported: forward ratio
slasolve / raw (target <= 1.15), Newton and total linear iterations of both (must be equal),
gradient / forward for each, solution and gradient relative max differences, and slasolve's
time split (SNES set-up, solve, and the rest).
"""
from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, SIZE, base_parser, fmt_t, rprint, stats, timed_call, write_json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, NonlinearDiffusion, boundary_dofs, box_mesh  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

RTOL = 1e-8          # Newton: ||F(u)|| <= RTOL ||F(u0)||
LIN_RTOL = 1e-8      # inner GMRES
ADJ_RTOL = 1e-10     # the adjoint solve (what nonlinear_solve's backward uses: min(inner rtol, 1e-10))
MAXIT = 50
EPS = 1e-12


def rel(comm, a, b) -> float:
    num = comm.allreduce(float(np.abs(np.asarray(a) - np.asarray(b)).max(initial=0.0)), op=MPI.MAX)
    den = comm.allreduce(float(np.abs(np.asarray(b)).max(initial=0.0)), op=MPI.MAX)
    return num / max(den, 1e-300)


class Problem:
    def __init__(self, n: int, comm=COMM):
        self.comm = comm
        mesh = box_mesh((n, n), cell="triangle", comm=comm)
        V = Assembler(mesh)
        bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS), lambda x: 0.5 + x[:, 1])
        c = V.cell_coords.mean(1)
        self.kappa = (1.0 + 0.5 * torch.sin(3 * c[:, 0]) * c[:, 1]).contiguous()
        self.xc = c[:, 0].contiguous()
        self.P = NonlinearDiffusion(V, bc, kappa=1.0, source=lambda x: 4.0 + 2 * x[:, 0],
                                    neumann=(lambda x: 1.0 + x[:, 1], lambda x: x[:, 0] > 1 - EPS))
        self.V = V
        self.u0 = V.zeros()
        self.w = V.interpolate(lambda x: torch.sin(2 * x[:, 0]) + x[:, 1])   # loss weights
        self.n_cells = V.n_global_cells
        self.n_dofs = V.n_global_dofs

    def kappa_k(self, k: int) -> torch.Tensor:
        """The coefficient of solve ``k``: new values every solve (as in an optimisation loop), so
        no solver can reuse anything tied to the previous solve's values."""
        return self.kappa * (1.0 + 0.05 * torch.sin(0.7 * k + 5.0 * self.xc))


# ---------------------------------------------------------------------------
class RawSNES:
    """The hand-written petsc4py SNES: SNES, Mats, KSPs, Vecs made once, reused every solve."""

    def __init__(self, Pb: Problem):
        self.Pb = Pb
        P, comm = Pb.P, Pb.comm
        m = Pb.u0.shape[0]
        J0 = P.jacobian(Pb.u0, Pb.kappa)
        loc = J0.local
        self.ip = loc.indptr.numpy().astype(PETSc.IntType)
        self.ix = loc.indices.numpy().astype(PETSc.IntType)
        N = Pb.n_dofs

        def mat(v):
            A = PETSc.Mat().createAIJ(size=((m, N), (m, N)), csr=(self.ip, self.ix, v), comm=comm)
            A.setOption(PETSc.Mat.Option.NEW_NONZERO_ALLOCATION_ERR, True)
            A.assemble()
            return A
        v0 = loc.values.numpy()
        self.J, self.Jadj = mat(v0), mat(v0)
        self.X = PETSc.Vec().createMPI((m, N), comm=comm)
        self.F = self.X.duplicate()
        opts = PETSc.Options()
        opts["snes_linesearch_type"] = "bt"
        opts["pc_gamg_reuse_interpolation"] = "false"
        opts["snes_divergence_tolerance"] = "-1"
        snes = PETSc.SNES().create(comm=comm)
        snes.setType("newtonls")
        snes.setFunction(self._function, self.F)
        snes.setJacobian(self._jacobian, self.J)
        snes.setTolerances(rtol=RTOL, atol=0.0, stol=0.0, max_it=MAXIT)
        snes.setMaxFunctionEvaluations(-1)
        self.ksp = self._ksp(snes.getKSP(), LIN_RTOL)
        snes.setFromOptions()
        adj = PETSc.KSP().create(comm=comm)
        adj.setOperators(self.Jadj)
        self.adj = self._ksp(adj, ADJ_RTOL)
        adj.setFromOptions()
        for k in ("snes_linesearch_type", "pc_gamg_reuse_interpolation", "snes_divergence_tolerance"):
            opts.delValue(k)
        self.snes = snes
        self.wv = self.X.duplicate()
        self.wv.getArray()[:] = Pb.w.numpy()
        self.lam = self.X.duplicate()
        self.kappa = Pb.kappa
        self.u = self.grad = None
        self.nfev = self.njev = 0

    @staticmethod
    def _ksp(ksp, rtol):
        ksp.setType("gmres")
        ksp.setGMRESRestart(30)
        ksp.setPCSide(PETSc.PC.Side.RIGHT)
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
        ksp.getPC().setType("gamg")
        ksp.setTolerances(rtol=rtol, atol=0.0, divtol=1e300, max_it=10000)
        return ksp

    def _function(self, snes, X, F):
        self.nfev += 1
        u = torch.from_numpy(X.getArray(readonly=True).copy())
        with torch.no_grad():
            r = self.Pb.P.residual(u, self.kappa)
        F.getArray()[:] = r.numpy()

    def _jacobian(self, snes, X, J, Pm):
        self.njev += 1
        u = torch.from_numpy(X.getArray(readonly=True).copy())
        with torch.no_grad():
            dJ = self.Pb.P.jacobian(u, self.kappa)
        Pm.setValuesCSR(self.ip, self.ix, dJ.local.values.numpy(), PETSc.InsertMode.INSERT_VALUES)
        Pm.assemble()

    def solve(self, kappa):
        self.kappa = kappa
        self.X.getArray()[:] = self.Pb.u0.numpy()
        self.snes.solve(None, self.X)
        self.reason = self.snes.getConvergedReason()
        self.its = self.snes.getIterationNumber()
        self.lits = self.snes.getLinearSolveIterations()
        self.u = torch.from_numpy(self.X.getArray(readonly=True).copy())

    def gradient(self):
        P = self.Pb.P
        t0 = time.perf_counter()
        with torch.no_grad():
            dJ = P.jacobian(self.u, self.kappa)
        self.Jadj.setValuesCSR(self.ip, self.ix, dJ.local.values.numpy(), PETSc.InsertMode.INSERT_VALUES)
        self.Jadj.assemble()
        t1 = time.perf_counter()
        self.lam.set(0.0)
        self.adj.setOperators(self.Jadj)
        self.adj.setUp()
        t2 = time.perf_counter()
        self.adj.solveTranspose(self.wv, self.lam)
        t3 = time.perf_counter()
        lam = torch.from_numpy(self.lam.getArray(readonly=True).copy())
        k = self.kappa.detach().requires_grad_(True)
        with torch.enable_grad():
            r = P.residual(self.u, k)
            (g,) = torch.autograd.grad(r, k, lam)
        self.grad = -g
        self.adj_its = self.adj.getIterationNumber()
        self.gtimes = {"jacobian": t1 - t0, "pc_setup": t2 - t1, "adjoint_solve": t3 - t2,
                       "residual_vjp": time.perf_counter() - t3}


class SlaNewton:
    def __init__(self, Pb: Problem):
        self.Pb = Pb
        self.u = self.info = self.loss = self.kappa = None

    def solve(self, kappa):
        Pb = self.Pb
        self.kappa = kappa.clone().requires_grad_(True)
        self.u, self.info = slasolve.nonlinear_solve(
            Pb.P.residual, Pb.u0, self.kappa, jacobian=Pb.P.jacobian, rtol=RTOL, maxiter=MAXIT,
            linear_solver=dict(method="gmres", pc="gamg", rtol=LIN_RTOL), return_info=True, comm=Pb.comm)
        self.loss = slasolve.global_sum((Pb.w * self.u).sum(), Pb.comm)

    def gradient(self):
        self.loss.backward()
        self.grad = self.kappa.grad


def adjoint_info(sla: SlaNewton, kappa):
    """Collective. One more (untimed) slasolve solve + gradient with ``slasolve.solve`` wrapped to
    keep the SolveInfo of the adjoint solve the backward runs (its iterations and times)."""
    import importlib
    ks = importlib.import_module("slasolve.krylov.solve")   # the module (slasolve.krylov.solve is the function)
    orig, seen = ks.solve, []

    def spy(*args, **kw):
        kw["return_info"] = True
        x, info = orig(*args, **kw)
        seen.append(info)
        return x
    ks.solve = spy
    try:
        sla.solve(kappa)
        sla.gradient()
    finally:
        ks.solve = orig
    a = seen[-1].adjoint if seen else None
    return None if a is None else {"iterations": a.iterations, "times": dict(a.times)}


# ---------------------------------------------------------------------------
def run_size(n: int, trials: int, warmup: int, diag: bool = True) -> dict:
    Pb = Problem(n)
    comm = Pb.comm
    raw, sla = RawSNES(Pb), SlaNewton(Pb)
    S = {k: [] for k in ("sla_fwd", "sla_grad", "raw_fwd", "raw_grad")}
    split = {k: [] for k in ("setup", "solve", "rest")}
    gsplit = {}

    def one(name, k, record):
        kap = Pb.kappa_k(k)   # both contenders of trial k: the same coefficient; every trial a new one
        if name == "raw_snes":
            _, tf = timed_call(lambda: raw.solve(kap), comm)
            _, tg = timed_call(raw.gradient, comm)
            if record:
                S["raw_fwd"].append(tf), S["raw_grad"].append(tg)
                for k, v in raw.gtimes.items():
                    gsplit.setdefault(k, []).append(v)
        else:
            _, tf = timed_call(lambda: sla.solve(kap), comm)
            _, tg = timed_call(sla.gradient, comm)
            if record:
                S["sla_fwd"].append(tf), S["sla_grad"].append(tg)
                i = sla.info
                split["setup"].append(i.setup_time), split["solve"].append(i.solve_time)
                split["rest"].append(tf - i.setup_time - i.solve_time)

    names = ("slasolve", "raw_snes")
    k = 0
    for _ in range(warmup):
        for nm in names:
            one(nm, k, False)
        k += 1
    for t in range(trials):
        for nm in (names if t % 2 == 0 else names[::-1]):
            one(nm, k, True)
        k += 1
    # answers: the last trial's (same coefficient for both)
    info = sla.info
    err_u = rel(comm, sla.u.detach().numpy(), raw.u.numpy())
    err_g = rel(comm, sla.grad.detach().numpy(), raw.grad.detach().numpy())
    # the iterations and times of the adjoint solve slasolve's backward runs: one more (untimed)
    # solve + gradient, by default at the small size only
    adj = adjoint_info(sla, Pb.kappa_k(k)) if diag else None

    def pr(a, b):
        return stats([x / y for x, y in zip(S[a], S[b])])
    ok = int(raw.reason) > 0
    res = {"n": n, "cells": Pb.n_cells, "dofs": Pb.n_dofs, "ranks": SIZE, "trials": trials,
           "times": {k: dict(stats(v), samples=v) for k, v in S.items()},
           "ratio_forward": pr("sla_fwd", "raw_fwd"), "ratio_gradient": pr("sla_grad", "raw_grad"),
           "ratio_total": stats([(a + b) / (c + d) for a, b, c, d in
                                 zip(S["sla_fwd"], S["sla_grad"], S["raw_fwd"], S["raw_grad"])]),
           "gradient_over_forward_slasolve": pr("sla_grad", "sla_fwd"),
           "gradient_over_forward_raw": pr("raw_grad", "raw_fwd"),
           "slasolve_split": {k: float(np.median(v)) for k, v in split.items()},
           "raw_gradient_split": {k: float(np.median(v)) for k, v in gsplit.items()},
           "newton_iterations": {"slasolve": info.iterations, "raw_snes": int(raw.its)},
           "linear_iterations": {"slasolve": info.linear_iterations, "raw_snes": int(raw.lits)},
           "function_evaluations_per_solve": {"slasolve": info.function_evaluations},
           "raw_converged": ok, "slasolve_reason": info.reason, "residual_history": info.residual_history,
           "raw_adjoint_iterations": int(raw.adj_its), "slasolve_adjoint": adj,
           "rel_err_u": err_u, "rel_err_grad": err_g}
    raw.snes.destroy()
    return res


def q(r):
    return f"{r['median']:.3f} ({r['min']:.3f}-{r['max']:.3f})"


def report(r: dict) -> None:
    t = r["times"]
    rprint(f"\n== NonlinearDiffusion P1, {r['cells']} cells, {r['dofs']} unknowns, {r['ranks']} rank(s), "
           f"GMRES + GAMG, {r['trials']} trials")
    rprint(f"  Newton iterations: slasolve {r['newton_iterations']['slasolve']}, raw SNES "
           f"{r['newton_iterations']['raw_snes']}; linear iterations: slasolve {r['linear_iterations']['slasolve']}, "
           f"raw {r['linear_iterations']['raw_snes']}; slasolve {r['slasolve_reason']}, raw converged "
           f"{r['raw_converged']}")
    rprint(f"  {'time (median, slowest rank)':30s} {'solve':>10s} {'gradient':>10s}")
    rprint(f"  {'slasolve.nonlinear_solve':30s} {fmt_t(t['sla_fwd']['median']):>10s} "
           f"{fmt_t(t['sla_grad']['median']):>10s}")
    rprint(f"  {'raw petsc4py SNES':30s} {fmt_t(t['raw_fwd']['median']):>10s} {fmt_t(t['raw_grad']['median']):>10s}")
    sp = r["slasolve_split"]
    rprint(f"  slasolve solve split: set-up {fmt_t(sp['setup'])}, SNES solve {fmt_t(sp['solve'])}, "
           f"rest {fmt_t(sp['rest'])}")
    gs = r["raw_gradient_split"]
    rprint(f"  raw gradient split (rank 0): " + ", ".join(f"{k} {fmt_t(v)}" for k, v in gs.items())
           + f"; adjoint GMRES iterations {r['raw_adjoint_iterations']}")
    a = r["slasolve_adjoint"]
    if a:
        rprint(f"  slasolve adjoint solve (rank 0): {a['iterations']} GMRES iterations, " +
               ", ".join(f"{k} {fmt_t(v)}" for k, v in a["times"].items()))
    rprint(f"  ratio solve slasolve / raw        {q(r['ratio_forward'])}   [target <= 1.15]")
    rprint(f"  ratio gradient slasolve / raw     {q(r['ratio_gradient'])}")
    rprint(f"  ratio solve+gradient              {q(r['ratio_total'])}")
    rprint(f"  gradient / solve, slasolve        {q(r['gradient_over_forward_slasolve'])}")
    rprint(f"  gradient / solve, raw             {q(r['gradient_over_forward_raw'])}")
    rprint(f"  answers: u max rel diff {r['rel_err_u']:.1e}, kappa gradient {r['rel_err_grad']:.1e}")


def main(argv=None) -> int:
    p = base_parser(__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=None, help="notebook size: squares per side (default 64: 8192 cells)")
    p.add_argument("--n-large", type=int, default=None,
                   help="large size: squares per side (default 500: 500k cells; 0 skips)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--adjoint-info", action="store_true",
                   help="also at the large size: one more solve + gradient to report slasolve's adjoint solve")
    a = p.parse_args(argv)
    sizes = [a.n or (24 if a.quick else 64)]
    nl = a.n_large if a.n_large is not None else (64 if a.quick else 500)
    if nl:
        sizes.append(nl)
    torch.set_default_dtype(torch.float64)
    out = {"rtol": RTOL, "linear_rtol": LIN_RTOL, "adjoint_rtol": ADJ_RTOL, "ranks": SIZE, "sizes": []}
    for i, n in enumerate(sizes):
        trials = a.trials or (3 if a.quick else (7 if i == 0 else 3))
        # the large size: no warm-up round (the small size warmed everything up) and no extra
        # diagnostic solve, to keep a run near 2 minutes
        r = run_size(n, trials, a.warmup if i == 0 else 0, diag=(i == 0 or a.adjoint_info))
        report(r)
        out["sizes"].append(r)
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
