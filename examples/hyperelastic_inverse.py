"""Recover a stiffness field from noisy large-deformation displacements (neo-Hookean, distributed).

    python examples/hyperelastic_inverse.py                                   # 32 x 16 quads, L-BFGS
    mpirun -n 4 python examples/hyperelastic_inverse.py --nx 64 --ny 32 --iters 40 --output out/mu.pvtu
    mpirun -n 2 python examples/hyperelastic_inverse.py --check               # small, asserts success
    mpirun -n 4 python examples/hyperelastic_inverse.py --mesh plate.msh --clamp 1 --load 2   # a 2-D mesh file

Forward model: a compressible neo-Hookean plate ``[0, 2] x [0, 1]`` in plane strain
(Q1 quads of :func:`slasolve.fem.box_mesh`, :class:`slasolve.fem.NeoHookean`), clamped on
its left edge, with two load cases on its right edge (traction per unit reference
length): a downward shear that bends the plate (tip deflection about a third of its
length) and an oblique pull. Each is a nonlinear solve
(:func:`slasolve.nonlinear_solve`, Newton with a line search, warm-started from the
previous solution of the same load case). The shear modulus is per cell,
``mu = 0.1 + softplus(theta)`` (positive for any ``theta``), ``lambda = 4`` is known. The
truth has a stiff and a soft smooth inclusion; the observations are the true
displacements at every node plus Gaussian noise (``--noise`` times the largest
displacement), hashed from (seed, global dof, load case): the same at every rank count.

Objective (global sums over ranks):

    J(theta) = 1/(2 N sigma^2) sum (u(theta) - d)^2  +  alpha/2 theta^T L theta

with ``L`` the graph Laplacian of edge-adjacent cells (:func:`slasolve.fem.cell_laplacian`).
``loss.backward()`` differentiates through ``nonlinear_solve`` by the implicit function
theorem: one adjoint solve with the transposed tangent per load case, then the
residual's autograd graph in ``mu`` (the per-cell stress integrals). Why a hyperelastic
problem rather than nonlinear diffusion: in a large deformation the data depend on
``mu`` through the geometry as well as through the stress, and the loss is evaluated at
solutions far from the linear regime; a linearised model would misplace the
inclusions.

``--optimizer lbfgs`` (default): ``torch.optim.LBFGS`` with a strong-Wolfe line search on
a *replicated* ``theta`` (every rank holds all cells; see
``examples/inverse_conductivity.py``); ``--optimizer adam``: only the rank's own cells.
Rank 0 prints the objective, misfit, the relative L2 error of ``mu`` and its correlation
with the truth per iteration. ``--output`` writes the displacements (point data; use
ParaView's *Warp By Vector*), the data, and the recovered and true ``mu`` (cell data)
with :func:`slasolve.fem.write_mesh`. ``--check`` runs a small case and exits with status
1 unless the objective falls by a factor of 10 and the recovered ``mu`` correlates with
the truth (Pearson r >= 0.6).

``--mesh FILE`` runs the same inverse problem on a 2-D mesh file (XDMF + HDF5 read in
parallel slices and partitioned with PT-Scotch, or a gmsh ``.msh`` converted once to XDMF
next to it): the facets of physical group ``--clamp`` are clamped and those of ``--load``
carry the two load cases' tractions, the inclusions sit at the same places relative to the
mesh's bounding box (mapped onto the plate's ``[0, 2] x [0, 1]``), the regulariser is the
graph Laplacian of the mesh's dual graph (:func:`slasolve.fem.dual_graph_laplacian`) and
the noise is hashed from the file's node ids (the same data at every rank count).
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

from slasolve import global_sum as allreduce_sum
from slasolve.fem import (Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh, cell_laplacian,
                          dual_graph_laplacian, read_mesh, tagged_facets, tagged_nodes, write_mesh, write_xdmf)
from slasolve.testing import local_slice, normal_by_id
from slasolve import nonlinear_solve
from slasolve import parse_args as parse_petsc_args  # noqa: E402

LENGTH, HEIGHT = 2.0, 1.0
MU_MIN, LAMBDA = 0.1, 4.0
#: right-edge tractions of the load cases (force per unit reference length)
LOADS = ((0.0, -0.06), (0.12, 0.06))


def true_mu(c: torch.Tensor) -> torch.Tensor:
    """Local. Shear modulus at points ``(k, 2)``: background 1, a stiff (x3) and a soft (x0.4) inclusion."""
    def bump(x0, y0, r):
        return torch.exp(-((c[:, 0] - x0) ** 2 + (c[:, 1] - y0) ** 2) / (2 * r * r))
    return torch.exp(math.log(3.0) * bump(0.6, 0.6, 0.15) - math.log(2.5) * bump(1.35, 0.4, 0.15))


def mu_of(theta: torch.Tensor) -> torch.Tensor:
    return MU_MIN + torch.nn.functional.softplus(theta)


def theta_of(mu: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`mu_of`."""
    y = mu - MU_MIN
    return y + torch.log(-torch.expm1(-y))


class HyperelasticProblem:
    """Collective (constructor). The forward model and the data (see the module doc)."""

    def __init__(self, nx: int = 32, ny: int = 16, noise: float = 0.002, seed: int = 1234, comm=None,
                 solver_opts=None, mesh_file: str | None = None, clamp_tag: int = 1, load_tag: int = 2):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.shape = (nx, ny)
        if mesh_file is None:
            self.mesh = box_mesh((nx, ny), upper=(LENGTH, HEIGHT), cell="quad", comm=self.comm)
        else:
            self.mesh = read_mesh_file(mesh_file, self.comm)
        self.space = sp = Assembler(self.mesh, 2)
        self.cell_range = sp.cell_range
        self.n_cells = sp.n_global_cells
        self.n_local = self.mesh.n_local_cells
        centroids = sp.cell_coords.mean(1)
        if mesh_file is None:
            clamp = DirichletBC(sp, boundary_dofs(sp, lambda x: x[:, 0] < 1e-12), 0.0)
            right = lambda x: x[:, 0] > LENGTH - 1e-12  # noqa: E731
            ids = np.arange(*sp.dof_range, dtype=np.int64)
        else:
            nodes = tagged_nodes(self.mesh, clamp_tag)
            right = tagged_facets(self.mesh, load_tag)
            if self.comm.allreduce(int(nodes.shape[0])) == 0 or self.comm.allreduce(len(right)) == 0:
                raise ValueError(f"--mesh {mesh_file}: no facet tagged {clamp_tag} (--clamp) or {load_tag} (--load)")
            clamp = DirichletBC(sp, (nodes[:, None] * 2 + torch.arange(2)).reshape(-1), 0.0)
            lo, hi = self.mesh.node_coords.min(0).values.numpy(), self.mesh.node_coords.max(0).values.numpy()
            self.comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
            self.comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
            lo, hi = torch.from_numpy(lo), torch.from_numpy(hi)
            centroids = (centroids - lo) / (hi - lo) * torch.tensor([LENGTH, HEIGHT])
            own = self.mesh.original_ids[self.mesh.owned_mask()].numpy()
            ids = (own[:, None] * 2 + np.arange(2)).reshape(-1)      # file dof ids: rank-independent noise
        self.models = [NeoHookean(sp, clamp, mu=1.0, lmbda=LAMBDA, traction=(list(t), right)) for t in LOADS]
        # warm starts make ||F(u0)|| tiny: an absolute tolerance relative to the loads' residual
        r0 = max(float(torch.sqrt(allreduce_sum((m.residual(sp.zeros()) ** 2).sum(), self.comm)))
                 for m in self.models)
        self.solver_opts = dict(rtol=1e-10, atol=1e-10 * r0,
                                linear_solver=dict(method="gmres", pc="jacobi", rtol=1e-10))
        self.solver_opts.update(solver_opts or {})
        self._warm = [sp.zeros() for _ in LOADS]
        self.newton_iterations = 0
        self.mu_true = true_mu(centroids)
        with torch.no_grad():
            u_true = self.displacements(theta_of(self.mu_true))
        umax = max(self.comm.allreduce(float(u.abs().max()), op=MPI.MAX) for u in u_true)
        self.sigma = float(noise) * umax
        self.data = [u + self.sigma * normal_by_id(ids, seed, k) for k, u in enumerate(u_true)]
        self.u_true = u_true
        self.free = ~clamp.constrained
        self.n_obs = int(allreduce_sum(self.free.sum().to(torch.float64), self.comm)) * len(LOADS)
        self.L = cell_laplacian(self.mesh, self.shape) if mesh_file is None else dual_graph_laplacian(self.mesh)
        self._warm = [sp.zeros() for _ in LOADS]

    def displacements(self, theta: torch.Tensor):
        """Collective. Displacements (owned dofs) of every load case for the local ``theta``."""
        mu = mu_of(theta)
        out = []
        for k, model in enumerate(self.models):
            u, info = nonlinear_solve(model.residual, self._warm[k], mu, jacobian=model.jacobian,
                                      return_info=True, comm=self.comm, **self.solver_opts)
            self.newton_iterations += info.iterations
            self._warm[k] = u.detach().clone()
            out.append(u)
        return out

    def misfit(self, theta: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/(2 N sigma^2) sum_obs (u - d)^2`` (replicated 0-d tensor)."""
        loc = sum(0.5 * ((u - d)[self.free] ** 2).sum() for u, d in zip(self.displacements(theta), self.data))
        return allreduce_sum(loc, self.comm) / (self.n_obs * self.sigma ** 2)

    def regulariser(self, theta: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/2 theta^T L theta``."""
        return allreduce_sum(0.5 * (theta * (self.L @ theta)).sum(), self.comm)

    def scores(self, theta: torch.Tensor):
        """Collective. ``(relative L2 error of mu, Pearson correlation with the truth)`` over all cells."""
        m, t = mu_of(theta.detach()), self.mu_true
        s = self.comm.allreduce(np.array([float(v) for v in (((m - t) ** 2).sum(), (t * t).sum(), m.sum(),
                                                             t.sum(), (m * m).sum(), (m * t).sum(),
                                                             float(m.numel()))]), op=MPI.SUM)
        n = s[6]
        cov = s[5] / n - s[2] * s[3] / n ** 2
        var_m, var_t = s[4] / n - (s[2] / n) ** 2, s[1] / n - (s[3] / n) ** 2
        corr = cov / math.sqrt(max(var_m * var_t, 1e-300))
        return math.sqrt(s[0] / s[1]), corr


def read_mesh_file(path: str, comm):
    """Collective. A 2-D mesh file read in parallel (a non-XDMF file converted once next to it)."""
    from slasolve.fem.xdmf import convert_mesh

    if not path.lower().endswith((".xdmf", ".xmf")):
        xdmf = os.path.splitext(path)[0] + ".xdmf"
        convert_mesh(path, xdmf, comm=comm)
        path = xdmf
    mesh = read_mesh(path, comm=comm)
    if mesh.dim != 2:     # the same mesh on every rank: every rank raises
        raise ValueError(f"--mesh {path}: the plane-strain problem is 2-D, this mesh is {mesh.dim}-D")
    return mesh


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nx", type=int, default=None, help="cells along x (default 32; 12 with --check)")
    p.add_argument("--ny", type=int, default=None, help="cells along y (default 16; 6 with --check)")
    p.add_argument("--iters", type=int, default=None, help="optimizer iterations (default 30; 10 with --check)")
    p.add_argument("--optimizer", choices=("lbfgs", "adam"), default="lbfgs")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1 for L-BFGS, 0.05 Adam)")
    p.add_argument("--alpha", type=float, default=None, help="regularisation weight (default 0.5)")
    p.add_argument("--noise", type=float, default=0.002, help="noise std, relative to the largest displacement")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--pc", default="jacobi", help="preconditioner of the inner GMRES solves")
    p.add_argument("--backend", choices=("petsc", "torch"), default=None)
    p.add_argument("--output", default=None, help="write the fields (.pvtu, one piece per rank; .xdmf: XDMF + HDF5)")
    p.add_argument("--mesh", default=None, help="a 2-D mesh file (.xdmf, or .msh converted once) instead of the plate")
    p.add_argument("--clamp", type=int, default=1, help="facet tag of the clamped facets (--mesh)")
    p.add_argument("--load", type=int, default=2, help="facet tag of the loaded facets (--mesh)")
    p.add_argument("--check", action="store_true", help="small case; exit 1 unless the objective falls by 10x "
                                                        "and corr(mu, mu_true) >= 0.6")
    p.add_argument("--quiet", action="store_true")
    args = parse_petsc_args(p, argv)   # -snes_monitor, -ksp_monitor, -log_view ... go to PETSc
    small = args.check
    args.nx = args.nx or (12 if small else 32)
    args.ny = args.ny or (6 if small else 16)
    args.iters = args.iters if args.iters is not None else (10 if small else 30)
    args.alpha = 0.5 if args.alpha is None else args.alpha
    if args.lr is None:
        args.lr = 1.0 if args.optimizer == "lbfgs" else 0.05
    return args


def main(argv=None, comm=None) -> dict:
    """Collective. Run the example; returns ``{"history", "final", "rel_error", "corr", "theta",
    "problem", "ok"}`` (``ok``: the ``--check`` criteria, evaluated in every mode)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    rank, size = comm.Get_rank(), comm.Get_size()
    say = (print if rank == 0 else (lambda *a, **k: None)) if not args.quiet else (lambda *a, **k: None)
    torch.set_default_dtype(torch.float64)
    t0 = time.perf_counter()
    opts = {} if args.backend is None else {"backend": args.backend}
    opts["linear_solver"] = dict(method="gmres", pc=args.pc, rtol=1e-10)
    prob = HyperelasticProblem(args.nx, args.ny, args.noise, args.seed, comm, opts, mesh_file=args.mesh,
                               clamp_tag=args.clamp, load_tag=args.load)
    s, e = prob.cell_range
    where = f"{args.nx} x {args.ny} quads" if args.mesh is None else f"mesh {os.path.basename(args.mesh)}"
    say(f"slasolve hyperelastic inverse: {where}, {prob.n_cells} {prob.mesh.cell_type} cells, {size} rank(s), "
        f"{args.optimizer}, alpha {args.alpha:g}, noise sigma {prob.sigma:.2e}")
    theta0 = float(theta_of(torch.tensor(1.0)))               # initial guess mu = 1
    if args.optimizer == "lbfgs":
        param = torch.full((prob.n_cells,), theta0, requires_grad=True)
        opt = torch.optim.LBFGS([param], lr=args.lr, max_iter=1, max_eval=25, history_size=20,
                                line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=0.0)
        local = lambda: local_slice(param, s, e, comm)  # noqa: E731
    else:
        param = torch.full((prob.n_local,), theta0, requires_grad=True)
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
        rel, corr = prob.scores(theta)
        say(f"{it:>4} {obj:12.5e} {mis:12.5e} {reg:10.3e} {rel:8.4f} {corr:7.3f}")
        return theta, obj

    say(f"{'it':>4} {'objective':>12} {'misfit':>12} {'regul.':>10} {'rel.err':>8} {'corr':>7}")
    theta, obj = report(0)
    history = [obj]
    for it in range(args.iters):
        opt.step(closure)
        theta, obj = report(it + 1)
        history.append(obj)
    rel, corr = prob.scores(theta)
    ok = bool(history[-1] <= 0.1 * history[0] and corr >= 0.6)
    say(f"final objective {history[-1]:.5e} (initial {history[0]:.5e}), relative error of mu {rel:.4f}, "
        f"correlation {corr:.3f}, {prob.newton_iterations} Newton iterations, {time.perf_counter() - t0:.2f} s")
    if args.output:
        if rank == 0:
            os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        comm.Barrier()
        n = prob.space.n_owned_nodes
        with torch.no_grad():
            us = prob.displacements(theta)
        pdata = {}
        for k in range(len(LOADS)):
            pdata[f"u{k}"] = us[k].detach().reshape(n, 2)
            pdata[f"u{k}_true"] = prob.u_true[k].reshape(n, 2)
            pdata[f"data{k}"] = prob.data[k].reshape(n, 2)
        write = write_xdmf if args.output.lower().endswith(".xdmf") else write_mesh
        path = write(args.output, prob.mesh, point_data=pdata, cell_data={"mu": mu_of(theta), "mu_true": prob.mu_true})
        say(f"wrote {path}")
    if args.check:
        say(f"check: objective ratio {history[-1] / history[0]:.3g} (need <= 0.1), correlation {corr:.3f} "
            f"(need >= 0.6) -> {'OK' if ok else 'FAILED'}")
    return {"history": history, "final": history[-1], "rel_error": rel, "corr": corr, "theta": theta,
            "problem": prob, "ok": ok}


if __name__ == "__main__":
    out = main()
    sys.exit(0 if (out["ok"] or "--check" not in sys.argv) else 1)
