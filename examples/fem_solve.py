"""Solve a Poisson or linear elasticity problem on a distributed box mesh.

    python examples/fem_solve.py                                  # P1 Poisson, 2-D
    mpirun -n 4 python examples/fem_solve.py --dim 3 --n 32
    python examples/fem_solve.py --problem elasticity --cell quad --output out/u.pvtu
    mpirun -n 2 python examples/fem_solve.py --check              # refinement study
    mpirun -n 4 python examples/fem_solve.py -ksp_monitor -log_view   # PETSc options pass through
    mpirun -n 4 python examples/fem_solve.py --mesh bracket.xdmf --problem elasticity   # a real geometry

With ``--mesh FILE`` (XDMF + HDF5, or a gmsh ``.msh`` that is converted once to XDMF next
to it) the mesh is read in parallel and partitioned with PT-Scotch (METIS without PETSc);
the facets tagged ``--clamp`` (a gmsh physical group, default 1) are clamped (``u = 0``),
the facets tagged ``--load`` (default 2) carry a traction ``--traction`` along the last axis
(elasticity) or a flux (Poisson), with the source 1 for Poisson.
``examples/gmsh_bracket.py`` makes such a file with gmsh. A ``.msh`` that mixes cell types
needs ``--collapse`` (Q1 on every cell: triangles, tetrahedra, pyramids and wedges as
collapsed quads / hexahedra) or ``--simplices`` (every cell split into triangles /
tetrahedra, P1).

The exact solutions are manufactured (``u = Π sin(π x_k)``, every displacement
component the same for elasticity, 2-D plane strain), with homogeneous Dirichlet
conditions on the whole boundary. The mesh is generated in parallel (each rank
makes its slab), assembled with :class:`slasolve.fem.Assembler` and solved with
:func:`slasolve.solve` (CG + GAMG by default; CG + Jacobi with the
native torch backend when petsc4py is not installed). Rank 0 prints the L2 error, the
iterations and the time of each phase. ``--check`` solves on ``n, 2n, 4n`` cells
per side and exits with status 1 unless the L2 error of the last refinement
converges at rate >= 1.8 (log-log slope; P1/Q1 give 2).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

try:  # run from a source checkout without installing
    import slasolve  # noqa: F401
except ImportError:  # pragma: no cover
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import write_mesh
from slasolve.fem.problems import convergence_rates, exact_elasticity, exact_poisson, manufactured_solve
from slasolve import parse_args as parse_petsc_args  # noqa: E402

CELLS = {2: ("triangle", "quad"), 3: ("tetra", "hexahedron")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problem", choices=("poisson", "elasticity"), default="poisson")
    p.add_argument("--dim", type=int, choices=(2, 3), default=2)
    p.add_argument("--n", type=int, default=None, help="cells per side (default 64 in 2-D, 16 in 3-D; "
                                                       "with --check the coarsest level, default 4)")
    p.add_argument("--cell", choices=("triangle", "quad", "tetra", "hexahedron"), default=None,
                   help="default: triangle (2-D) / tetra (3-D)")
    p.add_argument("--solver", default="cg", choices=("cg", "gmres", "minres", "bicgstab"))
    p.add_argument("--pc", default=None, help="preconditioner (default gamg with PETSc, jacobi with torch)")
    p.add_argument("--backend", choices=("petsc", "torch"), default=None,
                   help="default: petsc when petsc4py is installed, else torch")
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--young", type=float, default=1.0)
    p.add_argument("--nu", type=float, default=0.3)
    p.add_argument("--output", default=None, help="write the solution (.pvtu, one piece per rank)")
    p.add_argument("--check", action="store_true", help="refine n, 2n, 4n and require rate >= 1.8")
    p.add_argument("--levels", type=int, default=3, help="refinement levels for --check")
    p.add_argument("--mesh", default=None, help="solve on this mesh file (.xdmf, or .msh converted once)")
    p.add_argument("--clamp", type=int, default=1, help="facet tag of the clamped (u = 0) facets (--mesh)")
    p.add_argument("--load", type=int, default=2, help="facet tag of the loaded facets (--mesh)")
    p.add_argument("--traction", type=float, default=-1.0, help="traction along the last axis / flux (--mesh)")
    mixed = p.add_mutually_exclusive_group()
    mixed.add_argument("--collapse", action="store_true",
                       help="make every cell of a mixed .msh (triangles + quads; tetrahedra, pyramids, wedges, "
                            "hexahedra) a collapsed quad / hexahedron (Q1) when converting it (--mesh)")
    mixed.add_argument("--simplices", action="store_true",
                       help="split the cells of a mixed .msh into simplices (P1) when converting it (--mesh)")
    args = parse_petsc_args(p, argv)   # -ksp_monitor, -log_view ... go to PETSc
    if args.cell is None:
        args.cell = CELLS[args.dim][0]
    if args.cell not in CELLS[args.dim]:
        p.error(f"--cell {args.cell} is not a {args.dim}-D cell (choose from {', '.join(CELLS[args.dim])})")
    # without petsc4py (a pip-only install) the native torch backend runs, with Jacobi: on these
    # problems it beats the torch backend's other PCs (block ILU/IC is an exact local LU
    # without PETSc: 1 iteration, but 16.6 s against 0.07 s for Jacobi's 58 on 3-D n=32)
    args.backend_chosen = args.backend or slasolve.krylov.default_backend()
    if args.pc is None:
        args.pc = "gamg" if args.backend_chosen == "petsc" else "jacobi"
    if args.n is None:
        args.n = 4 if args.check else (64 if args.dim == 2 else 16)
    if args.n < 1 or args.levels < 2 and args.check:
        p.error("--n must be >= 1 and --levels >= 2")
    return args


def run_one(args, n, comm):
    return manufactured_solve(args.problem, n, args.dim, args.cell, comm, method=args.solver, pc=args.pc,
                              rtol=args.rtol, backend=args.backend, young=args.young, nu=args.nu)


def run_file(args, comm, say) -> int:
    """Collective. The tagged problem on the mesh file ``args.mesh`` (see the module doc)."""
    from slasolve.fem import (Assembler, DirichletBC, neumann_load, read_mesh, tagged_facets, tagged_nodes,
                              write_xdmf)
    from slasolve.fem.nullspace import rigid_body_modes
    from slasolve.fem.xdmf import convert_mesh

    times = {}
    t0 = time.perf_counter()
    path = args.mesh
    if not path.lower().endswith((".xdmf", ".xmf")):
        path = os.path.splitext(path)[0] + ".xdmf"
        convert_mesh(args.mesh, path, comm=comm, simplices=args.simplices, collapse=args.collapse)
        times["convert"] = time.perf_counter() - t0
        t0 = time.perf_counter()
    mesh = read_mesh(path, comm=comm)
    times["read+partition"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    dim = mesh.dim
    bs = 1 if args.problem == "poisson" else dim
    space = Assembler(mesh, bs)
    loaded = tagged_facets(mesh, args.load)
    if args.problem == "poisson":
        A = space.stiffness()
        b = space.load(1.0) + neumann_load(space, args.traction, facets=loaded)
    else:
        A = space.elasticity(args.young, args.nu)
        g = [0.0] * dim
        g[-1] = args.traction
        b = neumann_load(space, g, facets=loaded)
    nodes = tagged_nodes(mesh, args.clamp)
    dofs = (nodes[:, None] * bs + torch.arange(bs)).reshape(-1)
    n_clamped = comm.allreduce(int(nodes.shape[0]))
    n_loaded = comm.allreduce(len(loaded))
    if n_clamped == 0:
        say(f"no facet tagged {args.clamp} (--clamp): nothing is clamped")
        return 1
    A, b = DirichletBC(space, dofs, 0.0).apply(A, b)
    times["assemble"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    kw = {} if args.backend is None else {"backend": args.backend}
    if bs > 1 and args.backend_chosen == "petsc":
        kw["near_nullspace"] = rigid_body_modes(space)
    u, info = slasolve.solve(A, b, args.solver, rtol=args.rtol, pc=args.pc, return_info=True, **kw)
    times["solve"] = time.perf_counter() - t0
    umax = comm.allreduce(float(u.detach().abs().max()) if u.numel() else 0.0, op=MPI.MAX)
    if args.output:
        t0 = time.perf_counter()
        field = u.detach().reshape(-1, bs) if bs > 1 else u.detach()
        if args.output.endswith(".xdmf"):
            out = write_xdmf(args.output, mesh, point_data={"u": field},
                             cell_data={"rank": torch.full((mesh.n_local_cells,), comm.Get_rank())})
        else:
            out = write_mesh(args.output, mesh, point_data={"u": field})
        times["write"] = time.perf_counter() - t0
        say(f"wrote {out}")
    say(f"{mesh.n_global_cells} {mesh.cell_type} cells, {space.n_global_dofs} dofs; {n_clamped} clamped nodes "
        f"(tag {args.clamp}), {n_loaded} loaded facets (tag {args.load})")
    say(f"max |u| {umax:.6e}, {info.iterations} iterations ({getattr(info, 'reason', '')})")
    say("time [s]: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    return 0 if info.converged else 1


def main(argv=None, comm=None) -> int:
    """Collective. Run the example; returns the exit status (0 = success)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 else (lambda *a, **k: None)
    torch.set_default_dtype(torch.float64)
    why = "" if args.backend or args.backend_chosen == "petsc" else ", petsc4py not installed"
    where = f"mesh {args.mesh}" if args.mesh else f"{args.dim}-D {args.cell}"
    say(f"slasolve fem_solve: {args.problem}, {where}, {size} rank(s), "
        f"{args.solver} + {args.pc} ({args.backend_chosen} backend{why})")

    if args.mesh:
        return run_file(args, comm, say)
    if args.check:
        ns = [args.n * 2 ** k for k in range(args.levels)]
        results = [run_one(args, n, comm) for n in ns]
        errs = [r.error_l2 for r in results]
        rates = convergence_rates(errs, [r.h for r in results])
        say(f"{'n':>6} {'dofs':>10} {'L2 error':>12} {'rate':>6} {'its':>5}")
        for k, r in enumerate(results):
            rate = f"{rates[k - 1]:6.2f}" if k else " " * 6
            say(f"{r.n:>6} {r.n_dofs:>10} {r.error_l2:12.4e} {rate} {r.iterations:>5}")
        ok = bool(all(r.converged for r in results)) and math.isfinite(rates[-1]) and rates[-1] >= 1.8
        say(f"check: rate {rates[-1]:.3f} {'>=' if ok else '<'} 1.8 -> {'OK' if ok else 'FAILED'}")
        return 0 if ok else 1

    r = run_one(args, args.n, comm)
    times = dict(r.timings)
    if args.output:
        t0 = time.perf_counter()
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        comm.Barrier()
        space = r.space
        bs = space.bs
        exact = exact_poisson if args.problem == "poisson" else exact_elasticity
        ue = space.interpolate(exact)
        shape = (space.n_owned_nodes, bs) if bs > 1 else (space.n_owned_nodes,)
        path = write_mesh(args.output, r.mesh, point_data={"u": r.u.detach().reshape(shape),
                                                           "u_exact": ue.reshape(shape),
                                                           "error": (r.u.detach() - ue).reshape(shape)})
        comm.Barrier()
        times["write"] = time.perf_counter() - t0
        say(f"wrote {path}")
    say(f"global dofs {r.n_dofs}, h = 1/{r.n}")
    ran = f"{getattr(r.info, 'method', '?')} + {getattr(r.info, 'pc', '?')}"  # after -ksp_type etc.
    say(f"L2 error {r.error_l2:.6e}, {r.iterations} iterations of {ran} ({getattr(r.info, 'reason', '')})")
    say("time [s]: " + ", ".join(f"{k} {v:.3f}" for k, v in times.items()))
    return 0 if r.converged else 1


if __name__ == "__main__":
    sys.exit(main())
