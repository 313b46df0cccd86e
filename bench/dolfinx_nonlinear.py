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

**Neo-Hookean solid** (``--problem neohookean2d neohookean3d``): P1 vectors on the same triangles
(``2 n^2``, plane strain) or the unit cube's Kuhn tetrahedra (``6 n^3``: slasolve's
``box_mesh(n, cell="tetra")`` and DOLFINx's ``create_unit_cube`` cut each cube alike), the
compressible neo-Hookean energy ``W = mu/2 (tr C - d) - mu ln J + lambda/2 (ln J)^2`` (slasolve's
``NeoHookean``; DOLFINx: the same ``psi`` in UFL, ``P = diff(psi, F)``, the tangent by
``derivative``), ``mu = exp(theta)``, ``lambda = 1.5 exp(theta)`` per cell, clamped at ``x = 0``,
a dead body force ``(0, -0.2)`` / ``(0, 0, -0.2)``, ``u0 = 0``, ``J = 1/2 sum u^2`` over the dofs.
Both: Newton ``rtol`` 1e-10 on the residual, CG + GAMG ``rtol`` 1e-10 with the rigid-body modes
as GAMG's near-nullspace (slasolve: ``linear_solver=dict(method="cg", pc="gamg",
near_nullspace=rigid_body_modes(space))``; DOLFINx: ``MatSetNearNullSpace`` on the Newton
solver's Jacobian, as its elasticity demo does), the adjoint by one CG + GAMG solve with the
last tangent (symmetric) and ``dJ/dtheta = -lambda^T dR/dtheta`` assembled as a DG0 vector.
slasolve as its docs write a hyperelastic solve: the default backtracking line search with the
energy as its merit function (``objective=P.energy``); ``slasolve basic``:
``line_search="basic"``, the full Newton steps DOLFINx's ``NewtonSolver`` takes.

**dolfinx same test**: the same DOLFINx solver stopped by slasolve's (and PETSc SNES's) test
``||F(u_k)|| <= 1e-10 ||F(u0)||``. DOLFINx 0.5's ``NewtonSolver`` divides ``||F||`` by the norm
of the *first Newton update* ``||du_1||`` (its ``residual0``, set after iteration 1; at iteration 0
the relative test is ``inf``), not by ``||F(u0)||``: on the 2-D neo-Hookean 8k problem
``||du_1|| / ||F(u0)|| ~ 2700``, so ``rtol = 1e-10`` stops ~2700x earlier than slasolve's test.
This contender sets ``rtol = 0``, ``atol = 1e-10 ||F(u0)||``, with ``||F(u0)||`` from DOLFINx's own
assembly (``NonlinearProblem.F`` at ``u0 = 0``, the vector its Newton iteration 0 tests), computed
once per problem outside the timed region (``u0`` and ``theta`` are the same in every trial).
Both ``||F(u0)||`` (slasolve's and DOLFINx's: the same number up to rounding) are printed.

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
from dolfinx_optloop import data_of, dolfinx_available, functionals, rigid_body_nullspace, weight_of  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.fem import (Assembler, DirichletBC, NeoHookean, NonlinearDiffusion, boundary_dofs, box_mesh,  # noqa: E402
                          rigid_body_modes)
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


class DolfinxNewton:
    """DOLFINx's NewtonSolver on ``residual(uh, v)`` with the Dirichlet condition ``bc`` and a KSP
    ``ksp_type`` + GAMG through the options database (as a DOLFINx user sets it), then the hand
    adjoint: the tangent at the solution, one solve ``J^T lambda = u - d`` (zero on the Dirichlet
    rows) with the Newton solver's KSP, and ``dJ/dtheta = -lambda^T dR/dtheta`` as a DG0 vector."""

    def _set_up(self, comm, V, Q, residual, bc, ksp_type: str, near_nullspace=None, data=None):
        import ufl
        from dolfinx import fem
        from dolfinx.fem import petsc as fpetsc
        from dolfinx.nls.petsc import NewtonSolver
        self.fpetsc, self.comm, self.bc = fpetsc, comm, bc
        v, q = ufl.TestFunction(V), ufl.TestFunction(Q)
        self.problem = fpetsc.NonlinearProblem(residual(self.uh, v), self.uh, bcs=[bc])
        self.newton = NewtonSolver(comm, self.problem)
        self.newton.rtol, self.newton.atol = RTOL, 0.0
        self.newton.convergence_criterion = "residual"
        self.newton.max_it = 50
        ksp = self.newton.krylov_solver
        prefix = ksp.getOptionsPrefix() or ""
        opts = PETSc.Options()
        entries = {"ksp_type": ksp_type, "pc_type": "gamg", "ksp_rtol": RTOL}
        for k, val in entries.items():
            opts[prefix + k] = val
        ksp.setFromOptions()
        for k in entries:
            opts.delValue(prefix + k)
        # the hand adjoint: lambda^T dR/dtheta per cell (a DG0 vector)
        self.dFdtheta = fem.form(ufl.derivative(residual(self.uh, self.lam), self.theta, q))
        self.a = self.problem.a
        self.A = fpetsc.create_matrix(self.a)
        if near_nullspace is not None:
            self.newton.A.setNearNullSpace(near_nullspace)
            self.A.setNearNullSpace(near_nullspace)
        self.r = fpetsc.create_vector(self.problem.L)
        self.gv = fpetsc.create_vector(self.dFdtheta)
        self.n_owned = V.dofmap.index_map.size_local * V.dofmap.index_map_bs
        self.n_cells = Q.dofmap.index_map.size_local
        self.d = 0.0 if data is None else data(V.tabulate_dof_coordinates()[: V.dofmap.index_map.size_local])
        c = Q.tabulate_dof_coordinates()[: self.n_cells]
        self.theta0, self.w = theta_of(c), weight_of(c)
        self.its = {}
        self.f0 = None

    def residual0(self) -> float:
        """Collective. ``||F(u0)||`` (``u0 = 0``, ``theta0``) by DOLFINx's assembly: the vector
        its NewtonSolver tests at iteration 0 (with the Dirichlet rows ``u - g``)."""
        self.theta.x.array[: self.n_cells] = self.theta0
        self.theta.x.scatter_forward()
        self.uh.x.array[:] = 0.0
        self.uh.x.scatter_forward()
        b = self.fpetsc.create_vector(self.problem.L)
        self.problem.F(self.uh.vector, b)
        self.f0 = b.norm()
        b.destroy()
        return self.f0

    def run(self, gradient: bool, same_test: bool = False):
        """Collective. ``same_test``: stop at ``||F|| <= rtol ||F(u0)||`` (slasolve's test) instead
        of DOLFINx's ``||F|| <= rtol ||du_1||``."""
        if same_test and self.f0 is None:
            self.residual0()
        self.newton.rtol, self.newton.atol = (0.0, RTOL * self.f0) if same_test else (RTOL, 0.0)
        self.theta.x.array[: self.n_cells] = self.theta0
        self.theta.x.scatter_forward()
        self.uh.x.array[:] = 0.0
        its, converged = self.newton.solve(self.uh)
        self.its["dolfinx same test" if same_test else "dolfinx"] = int(its)
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


class Dolfinx(DolfinxNewton):
    def __init__(self, n: int, comm):
        import ufl
        from dolfinx import fem, mesh
        msh = mesh.create_unit_square(comm, n, n, mesh.CellType.triangle, diagonal=mesh.DiagonalType.right)
        V = fem.FunctionSpace(msh, ("Lagrange", 1))
        Q = fem.FunctionSpace(msh, ("DG", 0))
        self.theta, self.uh, self.lam = fem.Function(Q), fem.Function(V), fem.Function(V)
        kappa = ufl.exp(self.theta)
        source = fem.Constant(msh, PETSc.ScalarType(SOURCE))

        def residual(w, test):
            return kappa * (1 + w ** 2) * ufl.inner(ufl.grad(w), ufl.grad(test)) * ufl.dx - source * test * ufl.dx
        msh.topology.create_connectivity(1, 2)
        facets = mesh.exterior_facet_indices(msh.topology)
        bc = fem.dirichletbc(PETSc.ScalarType(0.0), fem.locate_dofs_topological(V, 1, facets), V)
        self._set_up(comm, V, Q, residual, bc, "gmres", data=data_of)


LOAD = 0.2
SOLID_RATIO = 1.5   # lambda / mu


class SlasolveSolid:
    def __init__(self, n: int, comm, dim: int):
        self.comm = comm
        sp = self.space = Assembler(box_mesh(n, cell="triangle" if dim == 2 else "tetra", comm=comm), dim)
        bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
        force = torch.zeros(dim, dtype=torch.float64)
        force[-1] = -LOAD
        self.P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64)), body_force=force)
        self.Z = rigid_body_modes(sp)
        c = sp.cell_coords.mean(1).numpy()
        self.theta0 = torch.from_numpy(theta_of(c))
        self.w = weight_of(c)
        self.infos = {}

    def run(self, gradient: bool, line_search: str = "bt"):
        theta = self.theta0.clone().requires_grad_(gradient)
        mu = torch.exp(theta)
        u, info = slasolve.nonlinear_solve(
            self.P.residual, self.space.zeros(), mu, SOLID_RATIO * mu, jacobian=self.P.jacobian, rtol=RTOL,
            linear_solver=dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=self.Z), line_search=line_search,
            objective=self.P.energy if line_search == "bt" else None, return_info=True)
        self.infos[line_search] = info
        J = slasolve.global_sum(0.5 * (u ** 2).sum(), self.comm)
        if not gradient:
            return float(J), None
        J.backward()
        return float(J.detach()), theta.grad.numpy()


class DolfinxSolid(DolfinxNewton):
    def __init__(self, n: int, comm, dim: int):
        import ufl
        from dolfinx import fem, mesh
        if dim == 2:
            msh = mesh.create_unit_square(comm, n, n, mesh.CellType.triangle, diagonal=mesh.DiagonalType.right)
        else:
            msh = mesh.create_unit_cube(comm, n, n, n, mesh.CellType.tetrahedron)
        V = fem.VectorFunctionSpace(msh, ("Lagrange", 1))
        Q = fem.FunctionSpace(msh, ("DG", 0))
        self.theta, self.uh, self.lam = fem.Function(Q), fem.Function(V), fem.Function(V)
        mu = ufl.exp(self.theta)
        lmbda = SOLID_RATIO * mu
        force = np.zeros(dim, dtype=PETSc.ScalarType)
        force[-1] = -LOAD
        B = fem.Constant(msh, force)

        def residual(w, test):
            F = ufl.variable(ufl.Identity(dim) + ufl.grad(w))
            C = F.T * F
            lnJ = ufl.ln(ufl.det(F))
            psi = mu / 2 * (ufl.tr(C) - dim) - mu * lnJ + lmbda / 2 * lnJ ** 2
            return ufl.inner(ufl.diff(psi, F), ufl.grad(test)) * ufl.dx - ufl.inner(B, test) * ufl.dx
        facets = mesh.locate_entities_boundary(msh, dim - 1, lambda x: np.isclose(x[0], 0.0))
        bc = fem.dirichletbc(np.zeros(dim, dtype=PETSc.ScalarType), fem.locate_dofs_topological(V, dim - 1, facets), V)
        self._set_up(comm, V, Q, residual, bc, "cg", near_nullspace=rigid_body_nullspace(V))


PROBLEMS = {"diffusion": (Slasolve, Dolfinx, 2),
            "neohookean2d": (lambda n, comm: SlasolveSolid(n, comm, 2), lambda n, comm: DolfinxSolid(n, comm, 2), 2),
            "neohookean3d": (lambda n, comm: SlasolveSolid(n, comm, 3), lambda n, comm: DolfinxSolid(n, comm, 3), 3)}


def run_size(n: int, trials: int, comm, problem: str = "diffusion") -> dict:
    make_sla, make_dfx, dim = PROBLEMS[problem]
    sla, dfx = make_sla(n, comm), make_dfx(n, comm)
    out = {"problem": problem, "n": n, "cells": 2 * n * n if dim == 2 else 6 * n ** 3, "ranks": SIZE,
           "trials": trials}
    dfx.residual0()   # ||F(u0)|| for "dolfinx same test", outside the timed region
    baselines = ("dolfinx", "dolfinx same test")
    for gradient in (False, True):
        calls = {"slasolve": lambda: sla.run(gradient), "dolfinx": lambda: dfx.run(gradient)}
        if problem != "diffusion":   # DOLFINx's NewtonSolver takes full steps: slasolve's "basic"
            calls["slasolve basic"] = lambda: sla.run(gradient, "basic")
        calls["dolfinx same test"] = lambda: dfx.run(gradient, same_test=True)
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
        out[key] = {"times": {k: stats(v) for k, v in samples.items()}, "samples": samples}
        for name in calls:
            for base in baselines:
                if name not in baselines or (name, base) == ("dolfinx same test", "dolfinx"):
                    out[key][f"{name}/{base}"] = stats([a / b for a, b in zip(samples[name], samples[base])])
        for name in calls:
            for base in baselines:
                if name == base or (name, base) == ("dolfinx", "dolfinx same test"):
                    continue
                # against "dolfinx" the keys of before ("" for slasolve); against the same test: "vs"
                suffix = ("" if name == "slasolve" else f" ({name})") if base == "dolfinx" else f" ({name} vs {base})"
                if gradient:
                    fs = functionals(comm, res[name][0], res[name][1], dfx.w if name in baselines else sla.w)
                    fd = functionals(comm, res[base][0], res[base][1], dfx.w)
                    out["rel diff (J, |g|, g.w)" + suffix] = (np.abs(fs - fd) / np.abs(fd)).tolist()
                else:
                    out["rel diff J" + suffix] = abs(res[name][0] - res[base][0]) / abs(res[base][0])
    infos = {"slasolve": sla.info} if problem == "diffusion" else {"slasolve": sla.infos["bt"],
                                                                   "slasolve basic": sla.infos["basic"]}
    out["newton its"] = {**{k: v.iterations for k, v in infos.items()}, **dfx.its}
    out["||F(u0)||"] = {"slasolve": float(infos["slasolve"].residual_history[0]), "dolfinx": float(dfx.f0)}
    return out


def main(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="*", default=None,
                   help="cells per side (default: diffusion and neohookean2d 64 500, neohookean3d 11 44)")
    p.add_argument("--problem", nargs="*", default=["diffusion"], choices=sorted(PROBLEMS))
    args = p.parse_args(argv)
    if not dolfinx_available():
        return 0
    trials = args.trials or (3 if args.quick else 5)
    out = {"rtol": RTOL, "sizes": []}
    for problem in args.problem:
        default = [11, 44] if problem == "neohookean3d" else [64, 500]
        sizes = args.n or (default[:1] if args.quick else default)
        _run_problem(problem, sizes, trials, out)
    name = "dolfinx_nonlinear" if args.problem == ["diffusion"] else "dolfinx_nonlinear_" + "_".join(args.problem)
    write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"{name}_n{SIZE}.json"), out)
    return 0


def _run_problem(problem: str, sizes, trials: int, out: dict) -> None:
    solver = "GMRES+GAMG" if problem == "diffusion" else "CG+GAMG (rigid-body near-nullspace)"
    rprint(f"{problem}, {solver} {RTOL:g}, Newton rtol {RTOL:g}, {SIZE} rank(s); ratios median (min-max)")
    for n in sizes:
        r = run_size(n, trials, COMM, problem)
        out["sizes"].append(r)
        its = ", ".join(f"{k} {v}" for k, v in r["newton its"].items())
        f0 = r["||F(u0)||"]
        rprint(f"{r['cells']} cells: Newton steps {its}; ||F(u0)|| slasolve {f0['slasolve']:.6e}, "
               f"dolfinx {f0['dolfinx']:.6e}")
        for key in ("forward", "forward+gradient"):
            t = r[key]["times"]
            row = ", ".join(f"{k} {fmt_t(v['median'])}" for k, v in t.items())
            ratios = ", ".join(f"{k} {v['median']:.2f} ({v['min']:.2f}-{v['max']:.2f})"
                               for k, v in r[key].items() if "/" in k)
            rprint(f"  {key:>16}: {row}; {ratios}")
        for k, v in r.items():
            if k.startswith("rel diff"):
                rprint(f"  {k}: {', '.join(f'{x:.0e}' for x in np.atleast_1d(v))}")


if __name__ == "__main__":
    sys.exit(main())
