"""Recover a conductivity field from noisy potentials: a distributed PDE-constrained inverse problem.

    python examples/inverse_conductivity.py                                  # 32 x 32, L-BFGS
    mpirun -n 4 python examples/inverse_conductivity.py --n 64 --iters 60 --output out/kappa.pvtu
    python examples/inverse_conductivity.py --optimizer adam --iters 200
    mpirun -n 4 python examples/inverse_conductivity.py --mesh plate.msh     # a 2-D mesh file

Forward model: ``-div(kappa grad u) = 0`` on the unit square (P1 triangles of
:func:`slasolve.fem.box_mesh`), with two experiments, ``u = x`` and ``u = y`` on the
boundary (solved together, two right-hand sides). The conductivity is piecewise
constant, ``kappa = exp(theta)`` per cell (positive for any ``theta``). The synthetic
truth has two smooth inclusions (one conducting, one resistive); the observations are the
true potentials at every interior node plus Gaussian noise (``--noise`` times the data
range). The noise is a hash of (seed, global node id, experiment), so it is the same at
every rank count.

Objective (global sums over ranks, with an autograd-aware Allreduce):

    J(theta) = 1/(2 N sigma^2) sum (u(theta) - d)^2  +  alpha/2 theta^T L theta

``L`` is the graph Laplacian of edge-adjacent cells (:func:`slasolve.fem.cell_laplacian`,
a distributed sparse matrix over cell ids). ``loss.backward()`` goes through the solve
(adjoint), the Dirichlet elimination and the assembly. ``--optimizer lbfgs`` (default)
uses ``torch.optim.LBFGS`` on a *replicated* parameter vector (L-BFGS takes global dot
products of the parameters, so every rank keeps the whole ``theta`` -- fine for examples,
O(global cells) memory per rank); ``--optimizer adam`` keeps only the rank's own cells
(elementwise updates need no communication). Rank 0 prints the objective and the relative
L2 error of the recovered conductivity per iteration; ``--output`` writes the recovered
and true fields (cell data) and the data (point data) with :func:`slasolve.fem.write_mesh`
(``.pvtu``) or :func:`slasolve.fem.write_xdmf` (``.xdmf``).

``--mesh FILE`` solves the same problem on a 2-D mesh file (XDMF + HDF5, read in parallel
slices and partitioned with PT-Scotch; a gmsh ``.msh`` or other meshio format is converted
once to XDMF next to it): the experiments are ``u = x`` and ``u = y`` on its whole boundary,
the inclusions sit at the same places relative to its bounding box, the regulariser is the
graph Laplacian of its dual graph (cells sharing an edge: :func:`slasolve.fem.dual_graph_laplacian`),
the noise is hashed from the file's node ids (the same data at every rank count) and the
error of ``kappa`` is weighted by the cell areas.
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

import numpy as np
import torch
from mpi4py import MPI

import slasolve
from slasolve import global_sum as allreduce_sum
from slasolve.fem import (Assembler, DirichletBC, boundary_dofs, box_mesh, cell_laplacian, dual_graph_laplacian,
                          element_volume, read_mesh, write_mesh, write_xdmf)
from slasolve.testing import local_slice, normal_by_id
from slasolve import parse_args as parse_petsc_args  # noqa: E402


def true_log_conductivity(c: torch.Tensor) -> torch.Tensor:
    """Local. ``log kappa`` at points ``(k, 2)``: a conducting and a resistive smooth inclusion."""
    def bump(x0, y0, r):
        return torch.exp(-((c[:, 0] - x0) ** 2 + (c[:, 1] - y0) ** 2) / (2 * r * r))
    return math.log(3.0) * bump(0.32, 0.62, 0.11) - math.log(2.5) * bump(0.68, 0.35, 0.11)


class ConductivityProblem:
    """Collective (constructor). The forward model and the data (see the module doc).

    Attributes: ``mesh``, ``space`` (scalar :class:`~slasolve.fem.Assembler`), ``cell_range``
    (global ids of the local cells), ``n_cells`` (global), ``theta_true`` (local cells),
    ``data`` ``(n_owned, 2)``, ``obs`` (bool mask of observed owned nodes), ``sigma``.
    """

    def __init__(self, n: int = 32, noise: float = 0.01, seed: int = 1234, comm=None, solve_opts=None,
                 mesh_file: str | None = None):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.n = n
        self.mesh = box_mesh(n, cell="triangle", comm=self.comm) if mesh_file is None \
            else read_mesh_file(mesh_file, self.comm)
        self.space = sp = Assembler(self.mesh)
        self.cell_range = sp.cell_range
        self.n_cells = sp.n_global_cells
        self.n_local = self.mesh.n_local_cells
        opts = dict(solve_opts or {})
        if opts.get("pc") is None:  # GAMG with PETSc, Jacobi with the native torch backend
            opts["pc"] = "gamg" if (opts.get("backend") or slasolve.krylov.default_backend()) == "petsc" \
                else "jacobi"
        self.solve_opts = dict(method="cg", rtol=1e-10)
        self.solve_opts.update(opts)
        bdofs = boundary_dofs(sp)
        xb = sp.owned_coords()[bdofs - sp.dof_range[0]]
        self.g = [xb[:, 0].clone(), xb[:, 1].clone()]          # u = x, u = y on the boundary
        self.bc = DirichletBC(sp, bdofs, self.g[0])
        self.obs = ~self.bc.constrained                           # observe the interior nodes
        self.n_obs = int(allreduce_sum(self.obs.sum().to(torch.float64), self.comm))
        centroids = sp.cell_coords.mean(1)
        if mesh_file is None:
            self.L = cell_laplacian(self.mesh, n)
            self.area = None                                      # equal areas
            ids = np.arange(*sp.dof_range, dtype=np.int64)
        else:
            self.L = dual_graph_laplacian(self.mesh)
            self.area = element_volume(sp.cell_coords, self.mesh.cell_type)
            lo, hi = self.mesh.node_coords.min(0).values.numpy(), self.mesh.node_coords.max(0).values.numpy()
            self.comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
            self.comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
            lo, hi = torch.from_numpy(lo), torch.from_numpy(hi)
            centroids = (centroids - lo) / (hi - lo)               # the inclusions relative to the bounding box
            ids = self.mesh.original_ids[self.mesh.owned_mask()].numpy()   # file node ids: rank-independent noise
        self.theta_true = true_log_conductivity(centroids)
        with torch.no_grad():
            u_true = self.potentials(self.theta_true)
        eta = torch.stack([normal_by_id(ids, seed, k) for k in range(2)], 1)
        self.sigma = float(noise)              # the data range of u = x, u = y is 1
        self.data = u_true + self.sigma * eta
        self.u_true = u_true

    def potentials(self, theta: torch.Tensor) -> torch.Tensor:
        """Collective. ``(n_owned, 2)`` potentials of both experiments for the local ``theta``."""
        A = self.space.stiffness(torch.exp(theta))
        zero = self.space.zeros()
        A_bc, b1 = self.bc.apply(A, zero, values=self.g[0])
        _, b2 = self.bc.apply(A, zero, values=self.g[1])
        return slasolve.solve(A_bc, torch.stack([b1, b2], 1), **self.solve_opts)

    def misfit(self, theta: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/(2 N sigma^2) sum_obs (u - d)^2`` (replicated 0-d tensor)."""
        r = (self.potentials(theta) - self.data)[self.obs]
        return allreduce_sum(0.5 * (r * r).sum(), self.comm) / (self.n_obs * self.sigma ** 2)

    def regulariser(self, theta: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/2 theta^T L theta = 1/2 sum over adjacent cells (theta_e - theta_f)^2``."""
        return allreduce_sum(0.5 * (theta * (self.L @ theta)).sum(), self.comm)

    def relative_error(self, theta: torch.Tensor) -> float:
        """Collective. ``||kappa - kappa_true|| / ||kappa_true||`` over all cells (L2: weighted by
        the cell areas; on the box they are equal)."""
        k, kt = torch.exp(theta.detach()), torch.exp(self.theta_true)
        w = 1.0 if self.area is None else self.area
        s = allreduce_sum(torch.stack([(w * (k - kt) ** 2).sum(), (w * kt ** 2).sum()]), self.comm)
        return float(torch.sqrt(s[0] / s[1]))


def read_mesh_file(path: str, comm) -> "slasolve.fem.Mesh":
    """Collective. A 2-D mesh file read in parallel (a non-XDMF file converted once next to it)."""
    from slasolve.fem.xdmf import convert_mesh

    if not path.lower().endswith((".xdmf", ".xmf")):
        xdmf = os.path.splitext(path)[0] + ".xdmf"
        convert_mesh(path, xdmf, comm=comm)
        path = xdmf
    mesh = read_mesh(path, comm=comm)
    if mesh.dim != 2:     # the same mesh on every rank: every rank raises
        raise ValueError(f"--mesh {path}: the conductivity problem is 2-D, this mesh is {mesh.dim}-D")
    return mesh


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=32, help="cells per side (2 n^2 triangles)")
    p.add_argument("--iters", type=int, default=40, help="optimizer iterations")
    p.add_argument("--optimizer", choices=("lbfgs", "adam"), default="lbfgs")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1 for L-BFGS, 0.05 Adam)")
    p.add_argument("--alpha", type=float, default=0.1, help="regularisation weight")
    p.add_argument("--noise", type=float, default=0.005, help="noise standard deviation")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pc", default=None, help="preconditioner (default gamg with PETSc, jacobi with torch)")
    p.add_argument("--backend", choices=("petsc", "torch"), default=None)
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--output", default=None, help="write the recovered field (.pvtu, one piece per rank; "
                                                   ".xdmf: XDMF + HDF5)")
    p.add_argument("--mesh", default=None, help="a 2-D mesh file (.xdmf, or .msh converted once) instead of "
                                                "the n x n box")
    p.add_argument("--quiet", action="store_true")
    args = parse_petsc_args(p, argv)   # -ksp_monitor, -log_view ... go to PETSc
    if args.lr is None:
        args.lr = 1.0 if args.optimizer == "lbfgs" else 0.05
    return args


def main(argv=None, comm=None) -> dict:
    """Collective. Run the example; returns ``{"history", "final", "rel_error", "theta", "problem"}``
    (``history``: the objective at the initial guess and after every iteration, ``theta``: the local cells' recovered log conductivity)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (print if rank == 0 else (lambda *a, **k: None)) if not args.quiet else (lambda *a, **k: None)
    t0 = time.perf_counter()
    prob = ConductivityProblem(args.n, args.noise, args.seed, comm,
                               dict(pc=args.pc, rtol=args.rtol, backend=args.backend), mesh_file=args.mesh)
    s, e = prob.cell_range
    where = f"{args.n} x {args.n} box" if args.mesh is None else f"mesh {os.path.basename(args.mesh)}"
    say(f"slasolve inverse conductivity: {where}, {prob.n_cells} {prob.mesh.cell_type} cells, {size} rank(s), "
        f"{args.optimizer}, alpha {args.alpha:g}, noise {args.noise:g}, cg + {prob.solve_opts['pc']} "
        f"({args.backend or slasolve.krylov.default_backend()} backend)")
    if args.optimizer == "lbfgs":
        # replicated parameters: L-BFGS's dot products and line search then agree on every rank
        param = torch.zeros(prob.n_cells, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([param], lr=args.lr, max_iter=1, max_eval=25, history_size=20,
                                line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=0.0)
        local = lambda: local_slice(param, s, e, comm)  # noqa: E731
    else:
        param = torch.zeros(prob.n_local, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([param], lr=args.lr)
        local = lambda: param  # noqa: E731

    def objective(theta):
        mis, reg = prob.misfit(theta), prob.regulariser(theta)
        return mis + 0.5 * args.alpha * reg, mis, reg

    def closure():
        opt.zero_grad()
        loss = objective(local())[0]
        loss.backward()
        return loss

    def report(it):
        with torch.no_grad():
            theta = local().detach().clone()
            obj, mis, reg = (float(t) for t in objective(theta))
        say(f"{it:>4} {obj:12.5e} {mis:12.5e} {reg:10.3e} {prob.relative_error(theta):8.4f}")
        return theta, obj

    say(f"{'it':>4} {'objective':>12} {'misfit':>12} {'regul.':>10} {'rel.err':>8}")
    theta, obj = report(0)
    history = [obj]
    for it in range(args.iters):
        opt.step(closure)
        theta, obj = report(it + 1)
        history.append(obj)
    final = history[-1]
    rel = prob.relative_error(theta)
    say(f"final objective {final:.5e}, relative error of kappa {rel:.4f} "
        f"(initial guess kappa = 1: {prob.relative_error(torch.zeros_like(theta)):.4f}), "
        f"{time.perf_counter() - t0:.2f} s")
    if args.output:
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        comm.Barrier()
        write = write_xdmf if args.output.lower().endswith(".xdmf") else write_mesh
        path = write(args.output, prob.mesh,
                     point_data={"data_x": prob.data[:, 0], "data_y": prob.data[:, 1]},
                     cell_data={"kappa": torch.exp(theta), "kappa_true": torch.exp(prob.theta_true)})
        say(f"wrote {path}")
    return {"history": history, "final": final, "rel_error": rel, "theta": theta, "problem": prob}


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main()
    sys.exit(0)
