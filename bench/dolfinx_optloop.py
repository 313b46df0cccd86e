"""The user's optimisation iteration, slasolve's defaults against DOLFINx written by hand.

Run (DOLFINx 0.5 from Debian, ``apt-get install python3-dolfinx``; optional, never a
dependency of slasolve; the venv of ``scripts/install.sh`` sees it):

    mpirun -n 1 python bench/dolfinx_optloop.py            # 8k, 80k and 1M cells
    mpirun -n 2 python bench/dolfinx_optloop.py
    python bench/dolfinx_optloop.py --quick                # 8k cells only

Problem: P1 on the unit square cut into ``2 n^2`` triangles (the same triangles: slasolve's
``box_mesh(n, cell="triangle")`` and DOLFINx's ``create_unit_square(n, n, triangle,
diagonal=right)`` both cut each square along its low-left to top-right diagonal),
``-div(kappa grad u) = 1``, ``u = 0`` on the boundary, ``kappa = exp(theta)`` per cell with
``theta(c) = 0.5 sin(3 x + 0.3 k) cos(2 y)`` at the cell's centroid in iteration ``k``
(every value changes every iteration), ``J = 1/2 sum over nodes (u - d)^2``,
``d = 0.05 x y``. One **iteration**: new theta -> assemble K(kappa) with the Dirichlet rows
-> CG + GAMG, rtol 1e-8 -> J -> adjoint -> dJ/dtheta per cell.

* **slasolve** (defaults, what a user writes):
  ``theta.requires_grad_()``, ``K = space.stiffness(exp(theta))``,
  ``K_bc, f_bc = bc.apply(K, f)``, ``u = solve(K_bc, f_bc, "cg", pc="gamg", rtol=1e-8)``,
  ``J = global_sum(...)``, ``J.backward()`` -> ``theta.grad``.
* **dolfinx**: the compiled forms (JIT before timing), ``assemble_matrix`` into the same
  Mat with ``bcs`` (symmetric elimination, as slasolve), the load vector with lifting, a KSP
  configured as ``dolfinx.fem.petsc.LinearProblem`` does it (CG + GAMG, ``ksp_rtol 1e-8``,
  ``setFromOptions``: PETSc's defaults, i.e. the *preconditioned* residual norm and GAMG's
  interpolation reused across value changes), then the adjoint written by hand: one more
  ``KSPSolve`` with ``u - d`` (zero on the boundary) and the cellwise gradient
  ``-exp(theta) grad u . grad lambda`` assembled as a DG0 vector.
* **dolfinx_unprec**: the same with ``-ksp_norm_type unpreconditioned``: the stopping test
  slasolve uses (``||b - A x|| <= rtol ||b||``, SciPy's meaning of ``rtol``), so the two
  have the same accuracy guarantee.

**3-D linear elasticity** (``--problem elasticity``): P1 vectors on the unit cube cut into
``6 n^3`` tetrahedra (the same Kuhn tetrahedra: slasolve's ``box_mesh(n, cell="tetra")`` and
DOLFINx's ``create_unit_cube(n, n, n, tetrahedron)`` both cut each cube along its main diagonal),
Young's modulus ``exp(theta)`` per cell, ``nu = 0.3``, body force ``(0, 0, -1)``, clamped at
``x = 0``, ``d = 0.001 x y z`` per component; CG + GAMG with the rigid-body modes as
near-nullspace on both sides (``near_nullspace=rigid_body_modes(space)``;
``MatSetNearNullSpace`` as DOLFINx's elasticity demo does).

Answers are checked in the run against a reference (slasolve, rtol 1e-13): the relative
error of J and of two numbering-independent functionals of dJ/dtheta (its 2-norm and its
sum weighted by ``1 + x + y^2`` at the centroids). The contenders alternate (order flipped
every trial), each trial after a barrier, timed on the slowest rank; the table gives
the median and (min-max) of the per-trial ratios.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, RANK, SIZE, base_parser, fmt_t, rprint, stats, timed, write_json  # noqa: E402

import logging  # noqa: E402
import time  # noqa: E402
from typing import Callable  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh, rigid_body_modes  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402

RTOL = 1e-8


def dolfinx_available() -> bool:
    """Collective (every rank imports). Whether DOLFINx imports (a message on rank 0 if not); quiets
    the INFO logging that FFCx and the C compiler write for every JIT build."""
    try:
        import dolfinx  # noqa: F401
    except ImportError:
        rprint("DOLFINx is not importable (apt-get install python3-dolfinx): nothing to compare")
        return False
    logging.disable(logging.INFO)
    return True


def theta_of(c: np.ndarray, k: int) -> np.ndarray:
    """Local. The log conductivity of iteration ``k`` at centroids ``c`` ``(m, >=2)``."""
    return 0.5 * np.sin(3 * c[:, 0] + 0.3 * k) * np.cos(2 * c[:, 1])


def data_of(x: np.ndarray) -> np.ndarray:
    return 0.05 * x[:, 0] * x[:, 1]


def elastic_data_of(x: np.ndarray) -> np.ndarray:
    return 1e-3 * x[:, 0] * x[:, 1] * x[:, 2]


def weight_of(c: np.ndarray) -> np.ndarray:
    return 1.0 + c[:, 0] + c[:, 1] ** 2


def functionals(comm, J: float, g: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Collective. ``(J, ||g||_2, sum g w)``: independent of the cell numbering."""
    s = comm.allreduce(np.array([float(g @ g), float(g @ w)]), op=MPI.SUM)
    return np.array([J, np.sqrt(s[0]), s[1]])


class Slasolve:
    def __init__(self, n: int, comm, problem: str = "poisson"):
        self.comm = comm
        self.elasticity = problem == "elasticity"
        if self.elasticity:
            mesh = box_mesh(n, cell="tetra", comm=comm)
            self.space = sp = Assembler(mesh, 3)
            bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
            self.f = sp.load(torch.tensor([0.0, 0.0, -1.0], dtype=torch.float64))
            self.d = torch.from_numpy(elastic_data_of(sp.owned_dof_coords().numpy()))
            self.kw = dict(near_nullspace=rigid_body_modes(sp))
        else:
            mesh = box_mesh(n, cell="triangle", comm=comm)
            self.space = sp = Assembler(mesh)
            bd = boundary_dofs(sp)
            self.f = sp.load(1.0)
            self.d = torch.from_numpy(data_of(sp.owned_coords().numpy()))
            self.kw = {}
        self.bc = DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64))
        self.c = sp.cell_coords.mean(1).numpy()
        self.w = weight_of(self.c)
        self.info = None

    def operator(self, coefficient):
        return self.space.elasticity(coefficient, 0.3) if self.elasticity else self.space.stiffness(coefficient)

    def thetas(self, k):
        return torch.from_numpy(theta_of(self.c, k))

    def iteration(self, theta0: torch.Tensor, **solve_kw):
        theta = theta0.clone().requires_grad_()
        K = self.operator(torch.exp(theta))
        K_bc, f_bc = self.bc.apply(K, self.f)
        u, info = slasolve.solve(K_bc, f_bc, "cg", pc="gamg", rtol=solve_kw.pop("rtol", RTOL), return_info=True,
                                 **self.kw, **solve_kw)
        if not solve_kw:
            self.info = info
        J = slasolve.global_sum(0.5 * ((u - self.d) ** 2).sum(), self.comm)
        J.backward()
        return float(J.detach()), theta.grad.numpy()


class Dolfinx:
    def __init__(self, n: int, comm, unpreconditioned: bool, problem: str = "poisson"):
        import ufl
        from dolfinx import fem, mesh
        from dolfinx.fem import petsc as fpetsc
        self.fem, self.fpetsc = fem, fpetsc
        self.comm = comm
        if problem == "elasticity":
            msh = mesh.create_unit_cube(comm, n, n, n, mesh.CellType.tetrahedron)
            V = fem.VectorFunctionSpace(msh, ("Lagrange", 1))
        else:
            msh = mesh.create_unit_square(comm, n, n, mesh.CellType.triangle, diagonal=mesh.DiagonalType.right)
            V = fem.FunctionSpace(msh, ("Lagrange", 1))
        Q = fem.FunctionSpace(msh, ("DG", 0))
        self.theta, self.uh, self.lam = fem.Function(Q), fem.Function(V), fem.Function(V)
        u, v, q = ufl.TrialFunction(V), ufl.TestFunction(V), ufl.TestFunction(Q)
        kappa = ufl.exp(self.theta)
        tdim = msh.topology.dim
        if problem == "elasticity":
            nu = 0.3
            mu, lmbda = kappa / (2 * (1 + nu)), kappa * nu / ((1 + nu) * (1 - 2 * nu))

            def sigma(w):
                e = ufl.sym(ufl.grad(w))
                return 2 * mu * e + lmbda * ufl.tr(e) * ufl.Identity(3)
            self.a = fem.form(ufl.inner(sigma(u), ufl.sym(ufl.grad(v))) * ufl.dx)
            self.L = fem.form(ufl.inner(fem.Constant(msh, PETSc.ScalarType((0.0, 0.0, -1.0))), v) * ufl.dx)
            self.g = fem.form(-ufl.inner(sigma(self.uh), ufl.sym(ufl.grad(self.lam))) * q * ufl.dx)
            facets = mesh.locate_entities_boundary(msh, tdim - 1, lambda x: np.isclose(x[0], 0.0))
            zero = np.zeros(3, dtype=PETSc.ScalarType)
            self.bc = fem.dirichletbc(zero, fem.locate_dofs_topological(V, tdim - 1, facets), V)
        else:
            self.a = fem.form(kappa * ufl.inner(ufl.grad(u), ufl.grad(v)) * ufl.dx)
            self.L = fem.form(fem.Constant(msh, PETSc.ScalarType(1.0)) * v * ufl.dx)
            self.g = fem.form(-kappa * ufl.inner(ufl.grad(self.uh), ufl.grad(self.lam)) * q * ufl.dx)
            msh.topology.create_connectivity(tdim - 1, tdim)
            facets = mesh.exterior_facet_indices(msh.topology)
            self.bc = fem.dirichletbc(PETSc.ScalarType(0.0), fem.locate_dofs_topological(V, tdim - 1, facets), V)
        self.A = fpetsc.create_matrix(self.a)
        self.b = fpetsc.create_vector(self.L)
        self.r = fpetsc.create_vector(self.L)
        self.gv = fpetsc.create_vector(self.g)
        bs = V.dofmap.index_map_bs
        self.n_owned = V.dofmap.index_map.size_local * bs
        self.n_cells = Q.dofmap.index_map.size_local
        x = V.tabulate_dof_coordinates()[: V.dofmap.index_map.size_local]
        self.d = elastic_data_of(np.repeat(x, 3, axis=0)) if problem == "elasticity" else data_of(x)
        if problem == "elasticity":
            self.A.setNearNullSpace(rigid_body_nullspace(V))
        self.c = Q.tabulate_dof_coordinates()[: self.n_cells]
        self.w = weight_of(self.c)
        ksp = self.ksp = PETSc.KSP().create(comm)
        ksp.setOperators(self.A)
        prefix = f"dolfinx_optloop_{id(self)}_"
        ksp.setOptionsPrefix(prefix)
        opts = PETSc.Options()
        entries = {"ksp_type": "cg", "pc_type": "gamg", "ksp_rtol": RTOL}
        if unpreconditioned:
            entries["ksp_norm_type"] = "unpreconditioned"
        for k, val in entries.items():
            opts[prefix + k] = val
        ksp.setFromOptions()
        for k in entries:
            opts.delValue(prefix + k)

    def thetas(self, k):
        return theta_of(self.c, k)

    def iteration(self, theta: np.ndarray, phase: Callable[[str], None] = lambda name: None):
        """One iteration; ``phase(name)`` is called after each phase (:func:`phases` times them)."""
        fem, fpetsc = self.fem, self.fpetsc
        self.theta.x.array[: self.n_cells] = theta
        self.theta.x.scatter_forward()
        self.A.zeroEntries()
        fpetsc.assemble_matrix(self.A, self.a, bcs=[self.bc])
        self.A.assemble()
        phase("assemble K (with Dirichlet rows)")
        with self.b.localForm() as bl:
            bl.set(0.0)
        fpetsc.assemble_vector(self.b, self.L)
        fpetsc.apply_lifting(self.b, [self.a], bcs=[[self.bc]])
        self.b.ghostUpdate(addv=PETSc.InsertMode.ADD, mode=PETSc.ScatterMode.REVERSE)
        fpetsc.set_bc(self.b, [self.bc])
        phase("load vector, lifting")
        self.ksp.solve(self.b, self.uh.vector)
        phase("solve (set-up, KSP)")
        self.uh.x.scatter_forward()
        diff = self.uh.x.array[: self.n_owned] - self.d
        J = self.comm.allreduce(0.5 * float(diff @ diff), op=MPI.SUM)
        self.r.array[:] = diff                       # dJ/du, zero on the boundary (u is fixed there)
        fpetsc.set_bc(self.r, [self.bc])
        phase("J")
        self.ksp.solve(self.r, self.lam.vector)      # K is symmetric: the adjoint is K again
        self.lam.x.scatter_forward()
        with self.gv.localForm() as gl:
            gl.set(0.0)
        fpetsc.assemble_vector(self.gv, self.g)
        self.gv.ghostUpdate(addv=PETSc.InsertMode.ADD, mode=PETSc.ScatterMode.REVERSE)
        phase("adjoint solve, dJ/dtheta")
        return J, self.gv.array_r.copy()


def rigid_body_nullspace(V):
    """The rigid-body modes of a P1 vector space (2-D: 3, 3-D: 6) as a PETSc MatNullSpace
    (orthonormalised), as DOLFINx's elasticity demo builds them."""
    from dolfinx import la
    im = V.dofmap.index_map
    bs = V.dofmap.index_map_bs
    n = im.size_local
    x = V.tabulate_dof_coordinates()[:n]
    basis = [la.create_petsc_vector(im, bs) for _ in range(3 if bs == 2 else 6)]
    arrays = [b.getArray() for b in basis]
    for k in range(bs):
        arrays[k][k::bs] = 1.0
    if bs == 2:
        arrays[2][0::2], arrays[2][1::2] = -x[:, 1], x[:, 0]
    else:
        arrays[3][0::3], arrays[3][1::3] = -x[:, 1], x[:, 0]
        arrays[4][0::3], arrays[4][2::3] = x[:, 2], -x[:, 0]
        arrays[5][2::3], arrays[5][1::3] = x[:, 1], -x[:, 2]
    for b in basis:
        b.assemble()
    la.orthonormalize(basis)
    return PETSc.NullSpace().create(vectors=basis)


def cpu_timed(fn, comm) -> float:
    """Collective. CPU seconds (this process, ``time.process_time``) of one call, the largest over
    the ranks (barrier before): on a shared, loaded machine far steadier than wall time at 1 rank;
    at several ranks it includes the time a rank spends polling in MPI waits."""
    comm.Barrier()
    t0 = time.process_time()
    fn()
    return comm.allreduce(time.process_time() - t0, op=MPI.MAX)


def run_size(n: int, trials: int, comm, problem: str = "poisson", clock: str = "wall") -> dict:
    sla = Slasolve(n, comm, problem)
    dfx = {"dolfinx": Dolfinx(n, comm, False, problem), "dolfinx_unprec": Dolfinx(n, comm, True, problem)}
    calls = {"slasolve": lambda k: sla.iteration(sla.thetas(k))}
    for name, d in dfx.items():
        calls[name] = (lambda d: lambda k: d.iteration(d.thetas(k)))(d)
    weights = {"slasolve": sla.w, **{name: d.w for name, d in dfx.items()}}
    names = list(calls)
    for name in names:  # warm-up: JIT, first set-up, caches
        calls[name](0)
    samples = {k: [] for k in names}
    errors = {k: [] for k in names}
    its = {}
    for t in range(trials):
        k = t + 1
        # a KSP of its own (another options prefix): the timed contender's reuse state stays its own
        J_ref, g_ref = sla.iteration(sla.thetas(k), rtol=1e-13, reuse_pc=False, options_prefix="reference_")
        ref = functionals(comm, J_ref, g_ref, sla.w)
        for name in (names if t % 2 == 0 else names[::-1]):
            out = {}
            samples[name].append((timed if clock == "wall" else cpu_timed)(
                lambda: out.__setitem__("r", calls[name](k)), comm))
            J, g = out["r"]
            errors[name].append(np.abs(functionals(comm, J, g, weights[name]) - ref) / np.abs(ref))
        its = {"dolfinx": dfx["dolfinx"].ksp.getIterationNumber(),
               "dolfinx_unprec": dfx["dolfinx_unprec"].ksp.getIterationNumber()}
    its["slasolve"] = sla.info.iterations
    res = {"problem": problem, "clock": clock, "n": n, "cells": 6 * n ** 3 if problem == "elasticity" else 2 * n * n, "ranks": SIZE, "trials": trials, "iterations (last adjoint/forward)": its,
           "times": {k: stats(v) for k, v in samples.items()}, "samples": samples,
           "max rel error (J, |g|, g.w)": {k: np.max(np.array(v), axis=0).tolist() for k, v in errors.items()}}
    for other in ("dolfinx", "dolfinx_unprec"):
        res[f"slasolve/{other}"] = stats([a / b for a, b in zip(samples["slasolve"], samples[other])])
    return res


def _mpi_counts():
    """Local. ``mpi_counts_get`` of ``bench/mpi_counts.c`` when it is preloaded (``mpirun -x
    LD_PRELOAD=.../libmpicounts.so``; build: ``mpicc -O2 -shared -fPIC -o libmpicounts.so
    bench/mpi_counts.c``), else None: ``() -> [reductions, other collectives, sends, bytes]``."""
    import ctypes
    try:
        get = ctypes.CDLL(None).mpi_counts_get
    except AttributeError:
        return None
    buf = (ctypes.c_longlong * 4)()

    def counts():
        get(buf)
        return list(buf)
    return counts


def _petsc_event_times(names) -> dict:
    """Local. ``(seconds, count, flops)`` logged so far per PETSc event, summed over the log stages
    (slasolve's solves log in stages of their own). Counts and flops do not depend on the load."""
    out = {}
    for name in names:
        ev, t = PETSc.Log.Event(name), np.zeros(3)
        for stage in range(32):
            try:
                info = ev.getPerfInfo(stage)
            except Exception:
                break
            t += (info["time"], info["count"], info["flops"])
        out[name] = t
    return out


def phases(n: int, problem: str, comm, iters: int) -> dict:
    """Collective. Where one iteration's time goes, both sides (DOLFINx with slasolve's stopping
    test): wall time per phase (a barrier after each, so each phase counts its slowest rank),
    PETSc's event times inside (KSPSolve, PCSetUp, ...) with their counts and flops (load-independent),
    and, with the PMPI counter preloaded, the MPI reductions and point-to-point sends per phase.
    Mean per iteration over ``iters``."""
    sla, dfx = Slasolve(n, comm, problem), Dolfinx(n, comm, True, problem)
    counts = _mpi_counts()
    # KSPSetUp's flops: the smoothers' eigenvalue estimates; PCApply: one per Krylov iteration
    events = ("KSPSolve", "PCSetUp", "KSPSetUp", "PCApply", "MatMult", "MatPtAPNumeric")
    acc: dict = {}

    def mark(side, name, t, c):
        comm.Barrier()
        now, cn = time.perf_counter(), counts() if counts else None
        a = acc.setdefault(side, {}).setdefault(name, [0.0, 0, 0])
        a[0] += now - t
        if cn:
            a[1] += cn[0] - c[0]
            a[2] += cn[2] - c[2]
        return time.perf_counter(), counts() if counts else None

    def sla_iter(k):
        comm.Barrier()
        t, c = time.perf_counter(), counts() if counts else None
        theta = sla.thetas(k).clone().requires_grad_()
        K = sla.operator(torch.exp(theta))
        t, c = mark("slasolve", "assemble K", t, c)
        K_bc, f_bc = sla.bc.apply(K, sla.f)
        t, c = mark("slasolve", "Dirichlet rows", t, c)
        u = slasolve.solve(K_bc, f_bc, "cg", pc="gamg", rtol=RTOL, **sla.kw)
        t, c = mark("slasolve", "solve (refill, set-up, KSP, checks)", t, c)
        J = slasolve.global_sum(0.5 * ((u - sla.d) ** 2).sum(), sla.comm)
        t, c = mark("slasolve", "J", t, c)
        J.backward()
        mark("slasolve", "backward (adjoint solve, dJ/dtheta)", t, c)

    def dfx_iter(k):
        comm.Barrier()
        state = [time.perf_counter(), counts() if counts else None]

        def phase(name):
            state[:] = mark("dolfinx", name, *state)
        dfx.iteration(dfx.thetas(k), phase)

    PETSc.Log.begin()
    for k in range(3):
        sla_iter(k)
        dfx_iter(k)
    acc.clear()
    ev = {side: {name: np.zeros(3) for name in events} for side in ("slasolve", "dolfinx")}
    for k in range(iters):
        for side, fn in (("slasolve", sla_iter), ("dolfinx", dfx_iter))[::1 if k % 2 == 0 else -1]:
            e0 = _petsc_event_times(events)
            fn(k + 3)
            e1 = _petsc_event_times(events)
            for name in events:
                d = e1[name] - e0[name]   # the slowest rank's time, the ranks' counts and flops summed
                ev[side][name] += [comm.allreduce(d[0], op=MPI.MAX), *comm.allreduce(d[1:], op=MPI.SUM)]
    out = {"problem": problem, "n": n, "ranks": SIZE, "iterations": iters, "counted": counts is not None,
           "phases": {side: {name: {"ms": 1e3 * v[0] / iters, "reductions": v[1] / iters, "sends": v[2] / iters}
                             for name, v in ph.items()} for side, ph in acc.items()},
           "petsc events ms": {side: {k: 1e3 * v[0] / iters for k, v in e.items()} for side, e in ev.items()},
           "petsc events count": {side: {k: v[1] / iters for k, v in e.items()} for side, e in ev.items()},
           "petsc events Mflop": {side: {k: v[2] / iters / 1e6 for k, v in e.items()} for side, e in ev.items()}}
    rprint(f"{problem} n={n}, {SIZE} rank(s), mean of {iters} iterations (wall ms, barrier after each phase)"
           + (", MPI reductions / sends per phase (rank 0)" if counts else ""))
    for side, ph in out["phases"].items():
        tot = sum(v["ms"] for v in ph.values())
        rprint(f"  {side}: {tot:.2f} ms; PETSc inside: "
               + ", ".join(f"{k} {v:.2f}" for k, v in out["petsc events ms"][side].items()))
        rprint("    PETSc count / Mflop (summed over ranks): " + ", ".join(
            f"{k} {out['petsc events count'][side][k]:.0f} / {out['petsc events Mflop'][side][k]:.1f}" for k in events))
        for name, v in ph.items():
            rprint(f"    {name:40s} {v['ms']:8.2f}" + (f"  {v['reductions']:6.1f} {v['sends']:6.1f}" if counts else ""))
    return out


def main(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, nargs="*", default=None, help="cells per side (default 64 200 707; "
                   "elasticity 8 20 40)")
    p.add_argument("--problem", nargs="*", default=["poisson", "elasticity"], choices=["poisson", "elasticity"])
    p.add_argument("--clock", default="wall", choices=["wall", "cpu"],
                   help="time each iteration by wall clock (default) or by CPU time (time.process_time, "
                        "the largest over the ranks: steadier on a loaded machine)")
    p.add_argument("--phases", type=int, default=0, metavar="ITERS",
                   help="instead of the comparison: where the time goes, per phase of both sides, mean of "
                        "ITERS iterations (with MPI counts when bench/mpi_counts.c is LD_PRELOADed)")
    args = p.parse_args(argv)
    if not dolfinx_available():
        return 0
    if args.phases:
        out = {"phases": [phases(n, pr, COMM, args.phases) for pr in args.problem
                          for n in (args.n or ([64] if pr == "poisson" else [8]))]}
        if args.json:
            write_json(args.json, out)
        return 0
    trials = args.trials or (3 if args.quick else 7)
    out = {"rtol": RTOL, "sizes": []}
    rprint(f"optimisation iteration, kappa / Young's modulus = exp(theta), CG+GAMG rtol {RTOL:g}, {SIZE} rank(s)")
    rprint(f"{'cells':>9} {'slasolve':>10} {'dolfinx':>10} {'dfx unprec':>10} {'sla/dfx':>18} "
           f"{'sla/dfx unprec':>18}  its (sla, dfx, dfx unprec)  max rel err J (sla, dfx, dfx unprec)")
    todo = [(pr, n) for pr in args.problem for n in (args.n or (
        ([64] if args.quick else [64, 200, 707]) if pr == "poisson" else ([8] if args.quick else [8, 20, 40])))]
    for problem, n in todo:
        big = n >= (500 if problem == "poisson" else 40)
        r = run_size(n, max(3, trials - 2) if big else trials, COMM, problem, args.clock)
        out["sizes"].append(r)
        t, e, i = r["times"], r["max rel error (J, |g|, g.w)"], r["iterations (last adjoint/forward)"]
        q = [r["slasolve/dolfinx"], r["slasolve/dolfinx_unprec"]]
        rprint(f"{problem[:4]} {r['cells']:>9} {fmt_t(t['slasolve']['median']):>10} {fmt_t(t['dolfinx']['median']):>10} "
               f"{fmt_t(t['dolfinx_unprec']['median']):>10} "
               + " ".join(f"{x['median']:5.2f} ({x['min']:.2f}-{x['max']:.2f})" for x in q)
               + f"  {i['slasolve']}, {i['dolfinx']}, {i['dolfinx_unprec']}"
               + "  " + ", ".join(f"{e[k][0]:.0e}/{e[k][1]:.0e}" for k in ("slasolve", "dolfinx", "dolfinx_unprec")))
    write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"dolfinx_optloop_n{SIZE}.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
