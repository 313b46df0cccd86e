"""Nonlinear solve + gradient, slasolve's defaults against DOLFINx's NewtonSolver + a hand adjoint.

Run (DOLFINx 0.5 from Debian, ``apt-get install python3-dolfinx``; optional, never a
dependency of slasolve; the venv of ``scripts/install.sh`` sees it):

    mpirun -n 1 python bench/dolfinx_nonlinear.py          # 8k and 500k cells
    mpirun -n 2 python bench/dolfinx_nonlinear.py
    python bench/dolfinx_nonlinear.py --quick              # 8k cells only

Problem (the quasilinear model problem of the FEniCS tutorial): P1 on the unit square cut
into ``2 n^2`` triangles (the same triangles in both: the low-left to top-right diagonal),
``-div(kappa (1 + u^2) grad u) = 10``, ``u = 0`` on the boundary, ``kappa = exp(theta)``
per cell, ``theta(c) = 0.3 sin(3 x) cos(2 y)`` at the centroid, ``u0 = 0``,
``J = 1/2 sum over nodes (u - d)^2``, ``d = 0.05 x y``; the gradient is ``dJ/dtheta`` per cell.

* **slasolve**: ``P = NonlinearDiffusion(space, bc, kappa, source=10)``,
  ``u = nonlinear_solve(P.residual, u0, kappa, jacobian=P.jacobian, rtol=1e-10,
  linear_solver=dict(method="gmres", pc="gamg", rtol=1e-10))``, ``J.backward()``.
* **dolfinx**: ``dolfinx.fem.petsc.NonlinearProblem`` + ``dolfinx.nls.petsc.NewtonSolver``
  (``rtol`` 1e-10, ``convergence_criterion="residual"``, GMRES + GAMG ``ksp_rtol 1e-10``),
  then the adjoint by hand: the tangent at the solution assembled (with the Dirichlet rows),
  one transposed GMRES + GAMG solve ``J^T lambda = u - d`` (zero on the boundary) with the
  Newton solver's own KSP, and ``dJ/dtheta = -lambda^T dF/dtheta`` assembled as a DG0 vector.

Timed: the forward (Newton) and forward + gradient, alternating contenders (order flipped
every trial), slowest rank, median and (min-max) of the per-trial ratios; Newton counts and
the answers (J and two numbering-independent functionals of the gradient: its 2-norm and
its sum weighted by ``1 + x + y^2``) are checked against each other in the run.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, SIZE, base_parser, fmt_t, rprint, stats, timed, write_json  # noqa: E402
from dolfinx_optloop import data_of, dolfinx_available, functionals, weight_of  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, NonlinearDiffusion, boundary_dofs, box_mesh  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

RTOL = 1e-10
SOURCE = 10.0


def theta_of(c: np.ndarray) -> np.ndarray:
    return 0.3 * np.sin(3 * c[:, 0]) * np.cos(2 * c[:, 1])


class Slasolve:
    def __init__(self, n: int, comm):
        self.comm = comm
        sp = self.space = Assembler(box_mesh(n, cell="triangle", comm=comm))
        bd = boundary_dofs(sp)
        self.P = NonlinearDiffusion(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64)),
                                    source=SOURCE)
        c = sp.cell_coords.mean(1).numpy()
        self.theta0 = torch.from_numpy(theta_of(c))
        self.w = weight_of(c)
        self.d = torch.from_numpy(data_of(sp.owned_coords().numpy()))
        self.info = None

    def run(self, gradient: bool):
        theta = self.theta0.clone().requires_grad_(gradient)
        u, self.info = slasolve.nonlinear_solve(
            self.P.residual, self.space.zeros(), torch.exp(theta), jacobian=self.P.jacobian, rtol=RTOL,
            linear_solver=dict(method="gmres", pc="gamg", rtol=RTOL), return_info=True)
        J = slasolve.global_sum(0.5 * ((u - self.d) ** 2).sum(), self.comm)
        if not gradient:
            return float(J), None
        J.backward()
        return float(J.detach()), theta.grad.numpy()


class Dolfinx:
    def __init__(self, n: int, comm):
        import ufl
        from dolfinx import fem, mesh
        from dolfinx.fem import petsc as fpetsc
        from dolfinx.nls.petsc import NewtonSolver
        self.fem, self.fpetsc, self.comm = fem, fpetsc, comm
        msh = mesh.create_unit_square(comm, n, n, mesh.CellType.triangle, diagonal=mesh.DiagonalType.right)
        V = fem.FunctionSpace(msh, ("Lagrange", 1))
        Q = fem.FunctionSpace(msh, ("DG", 0))
        self.theta, self.uh, self.lam = fem.Function(Q), fem.Function(V), fem.Function(V)
        v, q = ufl.TestFunction(V), ufl.TestFunction(Q)
        kappa = ufl.exp(self.theta)
        F = kappa * (1 + self.uh ** 2) * ufl.inner(ufl.grad(self.uh), ufl.grad(v)) * ufl.dx \
            - fem.Constant(msh, PETSc.ScalarType(SOURCE)) * v * ufl.dx
        msh.topology.create_connectivity(1, 2)
        facets = mesh.exterior_facet_indices(msh.topology)
        self.bc = fem.dirichletbc(PETSc.ScalarType(0.0), fem.locate_dofs_topological(V, 1, facets), V)
        self.problem = fpetsc.NonlinearProblem(F, self.uh, bcs=[self.bc])
        self.newton = NewtonSolver(comm, self.problem)
        self.newton.rtol, self.newton.atol = RTOL, 0.0
        self.newton.convergence_criterion = "residual"
        self.newton.max_it = 50
        ksp = self.newton.krylov_solver
        prefix = ksp.getOptionsPrefix() or ""
        opts = PETSc.Options()
        entries = {"ksp_type": "gmres", "pc_type": "gamg", "ksp_rtol": RTOL}
        for k, val in entries.items():
            opts[prefix + k] = val
        ksp.setFromOptions()
        for k in entries:
            opts.delValue(prefix + k)
        # the hand adjoint: dF/dtheta contracted with lambda, per cell (a DG0 vector)
        self.dFdtheta = fem.form(kappa * (1 + self.uh ** 2) * ufl.inner(ufl.grad(self.uh), ufl.grad(self.lam))
                                 * q * ufl.dx)
        self.a = self.problem.a
        self.A = fpetsc.create_matrix(self.a)
        self.r = fpetsc.create_vector(self.problem.L)
        self.gv = fpetsc.create_vector(self.dFdtheta)
        self.n_owned = V.dofmap.index_map.size_local
        self.n_cells = Q.dofmap.index_map.size_local
        self.d = data_of(V.tabulate_dof_coordinates()[: self.n_owned])
        c = Q.tabulate_dof_coordinates()[: self.n_cells]
        self.theta0, self.w = theta_of(c), weight_of(c)
        self.its = None

    def run(self, gradient: bool):
        self.theta.x.array[: self.n_cells] = self.theta0
        self.theta.x.scatter_forward()
        self.uh.x.array[:] = 0.0
        self.its, converged = self.newton.solve(self.uh)
        assert converged
        self.uh.x.scatter_forward()
        diff = self.uh.x.array[: self.n_owned] - self.d
        J = self.comm.allreduce(0.5 * float(diff @ diff), op=MPI.SUM)
        if not gradient:
            return J, None
        fpetsc = self.fpetsc
        self.A.zeroEntries()
        fpetsc.assemble_matrix(self.A, self.a, bcs=[self.bc])   # the tangent at the solution
        self.A.assemble()
        self.r.array[:] = diff
        fpetsc.set_bc(self.r, [self.bc])      # u is fixed on the boundary: no sensitivity there
        ksp = self.newton.krylov_solver
        ksp.setOperators(self.A)
        ksp.solveTranspose(self.r, self.lam.vector)
        self.lam.x.scatter_forward()
        with self.gv.localForm() as gl:
            gl.set(0.0)
        fpetsc.assemble_vector(self.gv, self.dFdtheta)            # dF/dtheta_e . lambda = that integral
        self.gv.ghostUpdate(addv=PETSc.InsertMode.ADD, mode=PETSc.ScatterMode.REVERSE)
        return J, -self.gv.array_r.copy()


def run_size(n: int, trials: int, comm) -> dict:
    sla, dfx = Slasolve(n, comm), Dolfinx(n, comm)
    out = {"n": n, "cells": 2 * n * n, "ranks": SIZE, "trials": trials}
    for gradient in (False, True):
        calls = {"slasolve": lambda: sla.run(gradient), "dolfinx": lambda: dfx.run(gradient)}
        for f in calls.values():
            f()   # warm-up: JIT, caches
        samples = {k: [] for k in calls}
        res = {}
        for t in range(trials):
            for name in (list(calls) if t % 2 == 0 else list(calls)[::-1]):
                box = {}
                samples[name].append(timed(lambda: box.__setitem__("r", calls[name]()), comm))
                res[name] = box["r"]
        key = "forward+gradient" if gradient else "forward"
        out[key] = {"times": {k: stats(v) for k, v in samples.items()}, "samples": samples,
                    "slasolve/dolfinx": stats([a / b for a, b in zip(samples["slasolve"], samples["dolfinx"])])}
        if gradient:
            fs = functionals(comm, res["slasolve"][0], res["slasolve"][1], sla.w)
            fd = functionals(comm, res["dolfinx"][0], res["dolfinx"][1], dfx.w)
            out["rel diff (J, |g|, g.w)"] = (np.abs(fs - fd) / np.abs(fd)).tolist()
        else:
            out["rel diff J"] = abs(res["slasolve"][0] - res["dolfinx"][0]) / abs(res["dolfinx"][0])
    out["newton its"] = {"slasolve": sla.info.iterations, "dolfinx": int(dfx.its)}
    return out


def main(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="*", default=None, help="cells per side (default 64 500)")
    args = p.parse_args(argv)
    if not dolfinx_available():
        return 0
    sizes = args.n or ([64] if args.quick else [64, 500])
    trials = args.trials or (3 if args.quick else 5)
    out = {"rtol": RTOL, "sizes": []}
    rprint(f"nonlinear diffusion, GMRES+GAMG {RTOL:g}, Newton rtol {RTOL:g}, {SIZE} rank(s)")
    rprint(f"{'cells':>9} {'fwd sla':>9} {'fwd dfx':>9} {'fwd ratio':>17} {'f+g sla':>9} {'f+g dfx':>9} "
           f"{'f+g ratio':>17}  newton (sla, dfx)  rel diff (J, |g|, g.w)")
    for n in sizes:
        r = run_size(n, trials, COMM)
        out["sizes"].append(r)
        f, g = r["forward"], r["forward+gradient"]
        rprint(f"{r['cells']:>9} {fmt_t(f['times']['slasolve']['median']):>9} "
               f"{fmt_t(f['times']['dolfinx']['median']):>9} "
               f"{f['slasolve/dolfinx']['median']:5.2f} ({f['slasolve/dolfinx']['min']:.2f}-"
               f"{f['slasolve/dolfinx']['max']:.2f}) {fmt_t(g['times']['slasolve']['median']):>9} "
               f"{fmt_t(g['times']['dolfinx']['median']):>9} "
               f"{g['slasolve/dolfinx']['median']:5.2f} ({g['slasolve/dolfinx']['min']:.2f}-"
               f"{g['slasolve/dolfinx']['max']:.2f})  {r['newton its']['slasolve']}, {r['newton its']['dolfinx']}"
               f"  {', '.join(f'{x:.0e}' for x in r['rel diff (J, |g|, g.w)'])}")
    write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"dolfinx_nonlinear_n{SIZE}.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
