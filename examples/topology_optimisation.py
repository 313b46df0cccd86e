"""SIMP topology optimisation of the MBB half-beam, distributed, with autograd sensitivities.

    python examples/topology_optimisation.py                         # 60 x 20, 50 iterations
    mpirun -n 4 python examples/topology_optimisation.py --nelx 120 --nely 40 --iters 100 --png mbb.png
    python examples/topology_optimisation.py --reuse lagged --warm   # reuse across OC iterations
    mpirun -n 4 python examples/topology_optimisation.py --mesh bracket.msh --clamp 1 --load 2 --output x.xdmf

The classic 88-line code (Andreassen, Clausen, Schevenels, Lazarov & Sigmund 2011):
``nelx x nely`` unit-square Q1 plane-stress elements, ``E = Emin + x^p (E0 - Emin)``
(``E0 = 1``, ``Emin = 1e-9``, ``nu = 0.3``, ``p = 3``), volume fraction 0.5, the density
filter of radius ``rmin`` and the optimality-criteria (OC) update with move limit 0.2.
The half beam is loaded downwards at its top-left corner, its left edge is a symmetry
line (``u_x = 0``) and the bottom-right corner is on a roller (``u_y = 0``).

Here the mesh is :func:`slasolve.fem.box_mesh` (each rank a slab of element rows), the
density filter a :class:`slasolve.fem.DensityFilter` (a distributed sparse matrix over
element ids), and the sensitivities ``dc/dx`` come from ``compliance.backward()``:
through the filter, the SIMP interpolation, the assembly, the Dirichlet elimination and
the adjoint of :func:`slasolve.solve`. Rank 0 prints the compliance, volume and change
per iteration and ``--png`` writes the final design (gathered to rank 0).

Every OC iteration changes the densities, hence the stiffness values, so by default the
solver rebuilds its preconditioner (GAMG) every iteration. ``--reuse`` opts into
:func:`slasolve.solve`'s ``reuse_pc``: ``pc`` (keep it), ``lagged`` (keep it until the
iteration count grows by ``LAG_GROWTH``), ``interpolation`` (GAMG keeps its prolongators,
recomputes coarse operators and smoothers); ``--warm`` starts each solve (and its adjoint)
from the previous iteration's solution (``x0="previous"``). The answers are checked against
the current matrix in every mode, so the compliance history is the same to the solver
tolerance (``bench/topopt.py`` measures time and difference).

``--mesh FILE`` optimises a part of the user's geometry instead (2-D plane stress or 3-D;
XDMF + HDF5 read in parallel slices and partitioned with PT-Scotch, or a gmsh ``.msh``
converted once to XDMF next to it): the facets of physical group ``--clamp`` are fixed,
those of ``--load`` carry the traction ``--traction`` along the last axis, the volume is
the cells' measure (``volfrac`` of the part's), and the density filter is the PDE
(Helmholtz) filter of Lazarov & Sigmund (2011), ``-r^2 lap(y) + y = x`` on the P1/Q1 nodes
with ``r = rmin / (2 sqrt 3)`` and the cell value the mean of its nodes' (the box filter
needs the box's cell grid; this one needs only the mesh; default ``rmin``: 2.5 times the
mean cell size). Sensitivities still come from ``compliance.backward()``, now through the
filter's solve as well. ``--output`` writes the physical densities and the displacement
(``.xdmf``: XDMF + HDF5; else ``.pvtu``).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

try:  # run from a source checkout without installing
    import slasolve  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np
import torch
from mpi4py import MPI

import slasolve
from slasolve import global_sum as allreduce_sum
from slasolve.fem import (Assembler, DensityFilter, DirichletBC, boundary_dofs, box_mesh, element_volume,
                          neumann_load, read_mesh, tagged_facets, tagged_nodes, write_mesh, write_xdmf)
from slasolve import parse_args as parse_petsc_args  # noqa: E402


#: --reuse choices -> slasolve.solve's reuse_pc
REUSE = {"none": False, "pc": True, "lagged": "lagged", "interpolation": "interpolation"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nelx", type=int, default=60)
    p.add_argument("--nely", type=int, default=20)
    p.add_argument("--volfrac", type=float, default=0.5)
    p.add_argument("--penal", type=float, default=3.0)
    p.add_argument("--rmin", type=float, default=None, help="filter radius (default 0.04 * nelx, >= 1.5)")
    p.add_argument("--iters", type=int, default=50, help="maximum OC iterations")
    p.add_argument("--tol", type=float, default=0.01, help="stop when max |x_new - x| < tol")
    p.add_argument("--solver", default="cg", choices=("cg", "gmres", "minres", "bicgstab"))
    p.add_argument("--pc", default=None, help="preconditioner (default: gamg with PETSc, jacobi with torch)")
    p.add_argument("--backend", choices=("petsc", "torch"), default=None)
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--reuse", default="none", choices=tuple(REUSE),
                   help="preconditioner reuse across OC iterations (slasolve.solve's reuse_pc)")
    p.add_argument("--warm", action="store_true", help="warm starts: x0='previous' (forward and adjoint)")
    p.add_argument("--png", default=None, help="write the final design as a PNG image (the box)")
    p.add_argument("--mesh", default=None, help="optimise on this mesh file (.xdmf, or .msh converted once)")
    p.add_argument("--clamp", type=int, default=1, help="facet tag of the clamped facets (--mesh)")
    p.add_argument("--load", type=int, default=2, help="facet tag of the loaded facets (--mesh)")
    p.add_argument("--traction", type=float, default=-1.0, help="traction along the last axis (--mesh)")
    p.add_argument("--output", default=None, help="write the design and displacement (--mesh; .xdmf or .pvtu)")
    p.add_argument("--quiet", action="store_true")
    args = parse_petsc_args(p, argv)   # -ksp_monitor, -log_view ... go to PETSc
    if args.rmin is None and args.mesh is None:
        args.rmin = max(1.5, 0.04 * args.nelx)
    return args


class MBB:
    """Collective (constructor). The distributed MBB half-beam problem (see the module doc).

    ``compliance(x)`` (collective, differentiable) returns the global compliance for the
    local design variables ``x`` (``(n_local_cells,)``, this rank's elements); ``filt``
    is the density filter (``None``: no filter, ``x`` are the physical densities).
    """

    def __init__(self, nelx: int, nely: int, rmin: float = 1.5, penal: float = 3.0, E0: float = 1.0,
                 Emin: float = 1e-9, nu: float = 0.3, comm=None, solve_opts=None, use_filter: bool = True):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.nelx, self.nely, self.penal, self.E0, self.Emin, self.nu = nelx, nely, penal, E0, Emin, nu
        # unit-square elements, y up; the slabs are rows of elements
        self.mesh = box_mesh((nelx, nely), upper=(nelx, nely), cell="quad", comm=self.comm)
        self.space = Assembler(self.mesh, block_size=2)
        sp = self.space
        eps = 1e-9
        left = boundary_dofs(sp, lambda x: x[:, 0] < eps, components=[0])
        roller = boundary_dofs(sp, lambda x: (x[:, 0] > nelx - eps) & (x[:, 1] < eps), components=[1])
        self.bc = DirichletBC(sp, torch.sort(torch.cat([left, roller])).values, 0.0)
        # unit downward load at the top-left node (0, nely): global node nely * (nelx + 1)
        f = sp.zeros()
        dof = 2 * (nely * (nelx + 1)) + 1
        d0, d1 = sp.dof_range
        if d0 <= dof < d1:
            f[dof - d0] = -1.0
        self.f = f
        self.filt = DensityFilter(self.mesh, (nelx, nely), rmin) if use_filter else None
        self.cell_range = sp.cell_range
        self.n_local = self.mesh.n_local_cells
        opts = dict(solve_opts or {})
        if opts.get("pc") is None:  # GAMG with PETSc, Jacobi with the native torch backend
            opts["pc"] = "gamg" if (opts.get("backend") or slasolve.krylov.default_backend()) == "petsc" \
                else "jacobi"
        self.solve_opts = dict(method="cg", rtol=1e-10)
        self.solve_opts.update(opts)
        self.last_u = None
        self.infos = []   # SolveInfo per compliance evaluation (iterations, reuse decisions)
        self.kind = "plane_stress"
        self.cell_volume = None                   # unit elements
        self.total_volume = float(nelx * nely)

    def young(self, xphys: torch.Tensor) -> torch.Tensor:
        return self.Emin + xphys ** self.penal * (self.E0 - self.Emin)

    def physical(self, x: torch.Tensor) -> torch.Tensor:
        """Collective. Filtered densities (differentiable)."""
        return self.filt(x) if self.filt is not None else x

    def compliance(self, x: torch.Tensor, filtered: bool = True) -> torch.Tensor:
        """Collective. ``c = f . u`` with ``K(E(x_phys)) u = f`` (a 0-d tensor, the same on every rank)."""
        xphys = self.physical(x) if filtered else x
        K = self.space.elasticity(self.young(xphys), self.nu, kind=self.kind)
        K_bc, f_bc = self.bc.apply(K, self.f)
        u, info = slasolve.solve(K_bc, f_bc, return_info=True, **self.solve_opts)
        self.infos.append(info)
        self.last_u = u.detach()
        return allreduce_sum((self.f * u).sum(), self.comm)

    def weighted(self, xphys: torch.Tensor) -> torch.Tensor:
        """Local. The cells' material volumes (the densities on unit elements)."""
        return xphys if self.cell_volume is None else xphys * self.cell_volume

    def volume(self, xphys: torch.Tensor) -> float:
        """Collective. Global material volume (the sum of the physical densities on the box)."""
        return float(allreduce_sum(self.weighted(xphys.detach()).sum(), self.comm))


class HelmholtzFilter:
    """Collective (constructor and call). The PDE density filter on any mesh (see the module
    doc): ``(r^2 K + M) y = T x``, ``T x = int x N_i`` (``x`` constant per cell), the result
    the mean of ``y`` over each cell's nodes. Differentiable in ``x`` (adjoint solve)."""

    def __init__(self, mesh, rmin: float, solve_opts: dict):
        self.space = sp = Assembler(mesh)
        r = float(rmin) / (2.0 * 3.0 ** 0.5)
        K, M = sp.stiffness(r * r), sp.mass(1.0)
        self.A = K.with_values(K.values + M.values)          # one pattern: the space's template
        self.nodes = torch.searchsorted(mesh.node_ids, mesh.cells)       # local node index per cell vertex
        self.opts = dict(solve_opts, method="cg", rtol=min(1e-12, solve_opts.get("rtol", 1e-12)))
        for k in ("reuse_pc", "x0"):
            self.opts.pop(k, None)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = slasolve.solve(self.A, self.space.load(x[:, None].expand(-1, self.nodes.shape[1])), **self.opts)
        return self.space.fetch_ghosts(y)[self.nodes].mean(1)


class MeshProblem(MBB):
    """Collective (constructor). Compliance minimisation on a mesh file with tagged facets
    (see the module doc); the same interface as :class:`MBB` for :func:`optimise`."""

    def __init__(self, path: str, clamp: int = 1, load: int = 2, traction: float = -1.0,
                 rmin: float | None = None, penal: float = 3.0, E0: float = 1.0, Emin: float = 1e-9,
                 nu: float = 0.3, comm=None, solve_opts=None):
        from slasolve.fem.xdmf import convert_mesh

        self.comm = comm = MPI.COMM_WORLD if comm is None else comm
        self.penal, self.E0, self.Emin, self.nu = penal, E0, Emin, nu
        if not path.lower().endswith((".xdmf", ".xmf")):
            xdmf = os.path.splitext(path)[0] + ".xdmf"
            convert_mesh(path, xdmf, comm=comm)
            path = xdmf
        self.path = path
        self.mesh = mesh = read_mesh(path, comm=comm)
        dim = mesh.dim
        self.kind = "plane_stress" if dim == 2 else None
        self.space = sp = Assembler(mesh, block_size=dim)
        nodes = tagged_nodes(mesh, clamp)
        if comm.allreduce(int(nodes.shape[0])) == 0:
            raise ValueError(f"--mesh {path}: no facet is tagged {clamp} (--clamp): nothing would be clamped")
        loaded = tagged_facets(mesh, load)
        if comm.allreduce(len(loaded)) == 0:
            raise ValueError(f"--mesh {path}: no facet is tagged {load} (--load): nothing would be loaded")
        self.bc = DirichletBC(sp, (nodes[:, None] * dim + torch.arange(dim)).reshape(-1), 0.0)
        g = [0.0] * dim
        g[-1] = float(traction)
        self.f = neumann_load(sp, g, facets=loaded)
        self.cell_volume = element_volume(sp.cell_coords, mesh.cell_type)
        self.total_volume = float(allreduce_sum(self.cell_volume.sum(), comm))
        n_cells = mesh.n_global_cells
        self.rmin = 2.5 * (self.total_volume / n_cells) ** (1.0 / dim) if rmin is None else float(rmin)
        self.cell_range = sp.cell_range
        self.n_local = mesh.n_local_cells
        opts = dict(solve_opts or {})
        if opts.get("pc") is None:
            opts["pc"] = "gamg" if (opts.get("backend") or slasolve.krylov.default_backend()) == "petsc" \
                else "jacobi"
        self.solve_opts = dict(method="cg", rtol=1e-10)
        self.solve_opts.update(opts)
        self.filt = HelmholtzFilter(mesh, self.rmin, self.solve_opts)
        self.last_u = None
        self.infos = []


def oc_update(prob: MBB, x: torch.Tensor, dc: torch.Tensor, dv: torch.Tensor, volfrac: float,
              move: float = 0.2):
    """Collective. The 88-line code's optimality-criteria update with bisection on the
    Lagrange multiplier of the volume constraint (every rank takes the same branch: the
    volume is an Allreduce). Returns the new local design variables."""
    target = volfrac * prob.total_volume
    l1, l2 = 0.0, 1e9
    ratio = torch.sqrt(torch.clamp(-dc, min=0.0) / dv)
    with torch.no_grad():
        while (l2 - l1) / (l1 + l2) > 1e-3:
            lmid = 0.5 * (l2 + l1)
            xnew = torch.maximum(torch.zeros_like(x), torch.maximum(
                x - move, torch.minimum(torch.ones_like(x), torch.minimum(x + move, x * ratio / lmid ** 0.5))))
            if prob.volume(prob.physical(xnew)) > target:
                l1 = lmid
            else:
                l2 = lmid
    return xnew


def optimise(prob: MBB, volfrac: float = 0.5, iters: int = 50, tol: float = 0.01, say=None,
             x0: torch.Tensor | None = None):
    """Collective. Run the OC loop from the design ``x0`` (this rank's ``(n_local,)`` densities;
    default uniform ``volfrac``); returns ``(x, history)`` with ``history`` the compliance
    per iteration (a list of floats, the same on every rank). ``prob.solve_times`` gets this
    rank's seconds per iteration in the compliance evaluation and its gradient (assembly,
    solve, adjoint), ``prob.solve_cpu_times`` this process's CPU seconds in them."""
    comm = prob.comm
    if x0 is None:
        x = torch.full((prob.n_local,), float(volfrac), dtype=torch.float64)
    else:
        x = torch.as_tensor(x0, dtype=torch.float64).clone()
        bad = comm.allreduce(int(x.shape != (prob.n_local,)))  # raise on every rank, or on none
        if bad:
            raise ValueError(f"x0 must have shape (n_local,) = ({prob.n_local},) on every rank; "
                             f"{bad} rank(s) differ (this rank: {tuple(x.shape)})")
    history = []
    prob.solve_times, prob.solve_cpu_times = [], []
    for it in range(iters):
        xr = x.clone().requires_grad_(True)
        t0, c0 = time.perf_counter(), time.process_time()
        c = prob.compliance(xr)
        c.backward()
        prob.solve_times.append(time.perf_counter() - t0)
        prob.solve_cpu_times.append(time.process_time() - c0)
        dc = xr.grad
        # volume sensitivities through the filter, also by autograd
        xv = x.clone().requires_grad_(True)
        allreduce_sum(prob.weighted(prob.physical(xv)).sum(), comm).backward()
        dv = xv.grad
        xnew = oc_update(prob, x, dc, dv, volfrac)
        change = float(allreduce_max(torch.abs(xnew - x).max(), comm))
        x = xnew
        history.append(float(c.detach()))
        if say is not None:
            vol = prob.volume(prob.physical(x)) / prob.total_volume
            say(f" It.: {it + 1:4d}  Obj.: {history[-1]:11.4f}  Vol.: {vol:6.3f}  ch.: {change:6.3f}")
        if change < tol:
            break
    return x, history


def allreduce_max(t: torch.Tensor, comm) -> torch.Tensor:
    if comm.Get_size() == 1:
        return t
    return torch.tensor(comm.allreduce(float(t), op=MPI.MAX), dtype=t.dtype)


def gather_design(prob: MBB, xphys: torch.Tensor):
    """Collective. The ``(nely, nelx)`` physical densities on rank 0 (row 0 = bottom), else None."""
    parts = prob.comm.gather(xphys.detach().cpu().numpy(), root=0)
    if prob.comm.Get_rank() != 0:
        return None
    return np.concatenate(parts).reshape(prob.nely, prob.nelx)


def write_png(path: str, design: np.ndarray) -> None:
    """Local (rank 0). The full beam (the half beam mirrored at its symmetry line), black = solid."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    full = np.concatenate([design[:, ::-1], design], axis=1)
    ny, nx = full.shape
    fig, ax = plt.subplots(figsize=(max(4.0, nx / 15), max(1.5, ny / 15)))
    ax.imshow(1.0 - full, cmap="gray", origin="lower", vmin=0, vmax=1, interpolation="none")
    ax.set_axis_off()
    fig.tight_layout()
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None, comm=None) -> dict:
    """Collective. Run the example; returns ``{"history": [...], "x": local design, "problem": MBB}``."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (print if rank == 0 else (lambda *a, **k: None)) if not args.quiet else None
    t0 = time.perf_counter()
    opts = dict(method=args.solver, pc=args.pc, rtol=args.rtol, backend=args.backend,
                reuse_pc=REUSE[args.reuse], x0="previous" if args.warm else None)
    if args.mesh is None:
        prob = MBB(args.nelx, args.nely, rmin=args.rmin, penal=args.penal, comm=comm, solve_opts=opts)
        where = f"MBB {args.nelx} x {args.nely}"
    else:
        prob = MeshProblem(args.mesh, args.clamp, args.load, args.traction, rmin=args.rmin, penal=args.penal,
                           comm=comm, solve_opts=opts)
        args.rmin = prob.rmin
        where = (f"{os.path.basename(args.mesh)} ({prob.mesh.n_global_cells} {prob.mesh.cell_type} cells, "
                 f"clamp {args.clamp}, load {args.load}, Helmholtz filter)")
    if say:
        say(f"slasolve topology optimisation: {where}, volfrac {args.volfrac}, "
            f"penal {args.penal}, rmin {args.rmin:g}, {size} rank(s), {args.solver} + {prob.solve_opts['pc']} "
            f"({args.backend or slasolve.krylov.default_backend()} backend), reuse {args.reuse}"
            f"{', warm starts' if args.warm else ''}")
    x, history = optimise(prob, args.volfrac, args.iters, args.tol, say)
    xphys = prob.physical(x).detach()
    if args.output:
        u = prob.last_u.reshape(-1, prob.space.bs)
        write = write_xdmf if args.output.lower().endswith(".xdmf") else write_mesh
        path = write(args.output, prob.mesh, point_data={"u": u}, cell_data={"density": xphys})
        if say:
            say(f"wrote {path}")
    if args.png and args.mesh is None:
        design = gather_design(prob, xphys)
        if rank == 0:
            write_png(args.png, design)
        comm.Barrier()
        if say:
            say(f"wrote {args.png}")
    if say:
        its = sum(i.iterations for i in prob.infos)
        say(f"final compliance {history[-1]:.6f} after {len(history)} iterations, "
            f"{time.perf_counter() - t0:.2f} s ({sum(prob.solve_times):.2f} s in solves and gradients, "
            f"{its} forward Krylov iterations)")
    return {"history": history, "x": x, "xphys": xphys, "problem": prob}


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main()
    sys.exit(0)
