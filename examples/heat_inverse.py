"""Recover a heat source from sparse late-time temperatures: a transient inverse problem.

    python examples/heat_inverse.py                                   # 24 x 24, 60 CN steps, 10 snapshots
    mpirun -n 4 python examples/heat_inverse.py --n 48 --steps 200 --checkpoints 20 --output out/heat.pvd
    python examples/heat_inverse.py --check                           # small run with pass/fail criteria

Forward model: the heat equation ``du/dt - div(kappa grad u) = q(x)`` on the unit square,
insulated boundary, ``u(0) = 0``, bilinear quads of :func:`slasolve.fem.box_mesh`: the mass
and stiffness matrices ``M``, ``K`` of :class:`slasolve.fem.Assembler`, Crank-Nicolson steps
``(M + dt/2 K) u_{n+1} = (M - dt/2 K) u_n + dt M q`` by
:class:`slasolve.timestepping.LinearTimeProblem` (one factorisation, or one Krylov set-up, for
all steps). The unknown is the nodal source ``q``; the synthetic truth is a hot and a cold
spot. The data are the temperatures at a sparse grid of sensors (every ``--stride``-th node
in each direction) at the last ``--obs-times`` output times, plus Gaussian noise (``--noise``
times the data range; a hash of the global node id and the time, so the same at every rank
count).

Objective (global sums):

    J(q) = 1/(2 N sigma^2) sum_{sensors, times} (u - d)^2  +  alpha/2 q^T K q

``loss.backward()`` runs the adjoint of the whole trajectory with ``--checkpoints`` snapshots
(binomial schedule from ``checkpoint_schedules``; ``0`` stores every step), one transposed
solve per step. L-BFGS (``--optimizer lbfgs``, default) keeps a replicated copy of ``q``
(its dot products must agree on every rank: O(global nodes) per rank, fine for an example);
``--optimizer adam`` keeps each rank's own nodes only. ``--output x.pvd`` writes a ParaView
time series (``.pvd`` naming one ``.pvtu`` per output time, one piece per rank) of the
temperature with the recovered source, and the recovered and true sources; ``--output x.xdmf``
the same as one XDMF + HDF5 file set, every rank writing its share (ParaView and DOLFINx read it).
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

import torch
from mpi4py import MPI

import slasolve
from slasolve import global_sum
from slasolve.fem import Assembler, box_mesh, write_mesh
from slasolve.testing import local_slice, normal_by_id, taylor_test
from slasolve.timestepping import LinearTimeProblem, integrate


class HeatSourceProblem:
    """Collective (constructor). The forward model, the sensors and the data (module doc)."""

    def __init__(self, n=24, steps=60, t_end=0.5, kappa=0.05, stride=3, obs_times=4, noise=0.01,
                 checkpoints=10, solver=None, comm=None):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.mesh = box_mesh(n, cell="quad", comm=self.comm)
        self.V = V = Assembler(self.mesh)
        self.M, self.K = V.mass(), V.stiffness(kappa)
        self.dt, self.steps = t_end / steps, steps
        self.checkpoints = checkpoints or None
        self.solver = dict(method="direct") if solver is None else dict(solver)
        self.problem = LinearTimeProblem(self.M, self.K, self.source, scheme="cn", **self.solver)
        x = V.owned_coords()
        ij = torch.round(x * n).to(torch.int64)
        self.sensors = ((ij[:, 0] % stride) == 0) & ((ij[:, 1] % stride) == 0)
        every = max(1, steps // 10)
        self.obs_steps = [steps - every * k for k in range(obs_times)][::-1]
        self.n_obs = int(global_sum(self.sensors.sum().to(torch.float64), self.comm)) * len(self.obs_steps)
        self.q_true = 2.0 * torch.exp(-((x[:, 0] - 0.3) ** 2 + (x[:, 1] - 0.65) ** 2) / 0.02) \
            - 1.5 * torch.exp(-((x[:, 0] - 0.7) ** 2 + (x[:, 1] - 0.3) ** 2) / 0.03)
        with torch.no_grad():
            clean = self.observe(self.q_true)
        ids = torch.arange(*V.dof_range)
        vmax = self.comm.allreduce(max(float(c.abs().max()) if c.numel() else 0.0 for c in clean), op=MPI.MAX)
        self.sigma = noise * max(vmax, 1e-12)
        self.data = [c + self.sigma * normal_by_id(ids, 0, k) for k, c in enumerate(clean)]

    def source(self, t: float, q: torch.Tensor) -> torch.Tensor:
        """Collective. The load vector ``M q`` of the nodal source (constant in time)."""
        return self.M @ q

    def observe(self, q: torch.Tensor):
        """Collective. The temperatures at the observation steps (owned rows, all nodes)."""
        u0 = self.V.zeros()
        return integrate(self.problem, u0, q, dt=self.dt, n_steps=self.steps, outputs=self.obs_steps,
                         checkpoints=self.checkpoints)

    def misfit(self, q: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/(2 N sigma^2) sum (u - d)^2`` over sensors and observation times."""
        s = sum(((u - d)[self.sensors] ** 2).sum() for u, d in zip(self.observe(q), self.data))
        return global_sum(0.5 * s, self.comm) / (self.n_obs * self.sigma ** 2)

    def regulariser(self, q: torch.Tensor) -> torch.Tensor:
        """Collective. ``1/2 q^T K q`` (the H1 seminorm of q, scaled by kappa)."""
        return global_sum(0.5 * (q * (self.K @ q)).sum(), self.comm)

    def relative_error(self, q: torch.Tensor) -> float:
        """Collective. ``||q - q_true||_M / ||q_true||_M``."""
        e = q.detach() - self.q_true
        s = global_sum(torch.stack([(e * (self.M @ e)).sum(), (self.q_true * (self.M @ self.q_true)).sum()]),
                       self.comm)
        return float(torch.sqrt(s[0] / s[1]))


def write_time_series(path: str, prob: HeatSourceProblem, q: torch.Tensor, every: int, comm) -> str:
    """Collective. The temperature driven by ``q`` and the sources ``q``, ``q_true`` at every
    ``every``-th step: ``path`` ending in ``.xdmf`` is one XDMF + HDF5 file set (every rank
    writes its share; needs h5py), else a ``.pvd`` naming one ``.pvtu`` per output step."""
    stem = os.path.splitext(path)[0]
    folder = os.path.dirname(os.path.abspath(path))
    if comm.rank == 0:
        os.makedirs(folder, exist_ok=True)
    comm.Barrier()
    steps = list(range(0, prob.steps + 1, every))
    if steps[-1] != prob.steps:
        steps.append(prob.steps)
    with torch.no_grad():
        states = integrate(prob.problem, prob.V.zeros(), q, dt=prob.dt, n_steps=prob.steps, outputs=steps)
    if path.endswith(".xdmf"):
        from slasolve.fem import write_xdmf
        write_xdmf(path, prob.mesh, point_data={"q": q.detach(), "q_true": prob.q_true})
        for n, u in zip(steps, states):
            write_xdmf(path, prob.mesh, point_data={"u": u}, time=n * prob.dt, append=True)
        return path
    entries = []
    for n, u in zip(steps, states):
        piece = write_mesh(f"{stem}_{n:05d}.pvtu", prob.mesh,
                           point_data={"u": u, "q": q.detach(), "q_true": prob.q_true})
        entries.append((n * prob.dt, os.path.basename(piece)))
    if comm.rank == 0:
        with open(path, "w") as f:
            f.write('<?xml version="1.0"?>\n<VTKFile type="Collection" version="0.1">\n  <Collection>\n')
            for t, name in entries:
                f.write(f'    <DataSet timestep="{t:.10g}" group="" part="0" file="{name}"/>\n')
            f.write("  </Collection>\n</VTKFile>\n")
    comm.Barrier()
    return path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=24, help="cells per side")
    p.add_argument("--steps", type=int, default=60, help="Crank-Nicolson steps to t = 0.5")
    p.add_argument("--checkpoints", type=int, default=10, help="snapshots for the adjoint (0: store all)")
    p.add_argument("--iters", type=int, default=25, help="optimizer iterations")
    p.add_argument("--optimizer", choices=("lbfgs", "adam"), default="lbfgs")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 1 L-BFGS, 0.1 Adam)")
    p.add_argument("--alpha", type=float, default=1e-3, help="regularisation weight")
    p.add_argument("--noise", type=float, default=0.01, help="noise, relative to the data range")
    p.add_argument("--stride", type=int, default=3, help="a sensor every stride-th node per direction")
    p.add_argument("--obs-times", type=int, default=4, help="observation times (the last ones)")
    p.add_argument("--method", default=None, help="'direct' (default with PETSc) or a Krylov method (cg)")
    p.add_argument("--output", default=None, help="ParaView time series: .xdmf (XDMF + HDF5) or .pvd "
                   "(+ one .pvtu per time)")
    p.add_argument("--check", action="store_true", help="small run; exit status 1 unless the criteria hold")
    p.add_argument("--quiet", action="store_true")
    args = slasolve.parse_args(p, argv)
    try:
        import checkpoint_schedules  # noqa: F401
    except ImportError:   # the `checkpointing` extra is missing: store every step instead
        args.checkpoints = 0
    if args.check:
        args.n, args.steps, args.iters, args.checkpoints = 8, 10, 3, 3
    if args.lr is None:
        args.lr = 1.0 if args.optimizer == "lbfgs" else 0.1
    return args


def main(argv=None, comm=None) -> dict:
    """Collective. Run the example; returns ``{"history", "rel_error", "initial_rel_error", "q",
    "taylor_rate", "info", "passed"}`` (``passed``: the ``--check`` criteria, else None)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD if comm is None else comm
    say = print if comm.rank == 0 and not args.quiet else (lambda *a, **k: None)
    t0 = time.perf_counter()
    method = args.method or ("direct" if (comm.size == 1 or slasolve.krylov.default_backend() == "petsc")
                             else "cg")
    solver = dict(method="direct") if method == "direct" else dict(method=method, pc="jacobi", rtol=1e-12)
    prob = HeatSourceProblem(args.n, args.steps, stride=args.stride, obs_times=args.obs_times,
                             noise=args.noise, checkpoints=args.checkpoints, solver=solver, comm=comm)
    d0, d1 = prob.V.dof_range
    say(f"slasolve heat source inversion: {args.n} x {args.n} quads, {prob.V.n_global_dofs} nodes, "
        f"{comm.size} rank(s), {args.steps} CN steps ({method}), "
        f"{'all steps stored' if not args.checkpoints else f'{args.checkpoints} snapshots'}, "
        f"{prob.n_obs} observations, {args.optimizer}")

    def objective(q):
        mis, reg = prob.misfit(q), prob.regulariser(q)
        return mis + 0.5 * args.alpha * reg, mis, reg

    taylor_rate = None
    if args.check:   # the gradient of the whole objective, at a nonzero point
        q_probe = 0.5 * prob.q_true
        direction = torch.cos(3 * prob.V.owned_coords()[:, 0])
        taylor_rate = taylor_test(lambda q: objective(q)[0], q_probe, direction, raise_on_fail=False).rate
        say(f"Taylor test of the objective's gradient: minimum rate {taylor_rate:.3f}")
    if args.optimizer == "lbfgs":
        param = torch.zeros(prob.V.n_global_dofs, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.LBFGS([param], lr=args.lr, max_iter=1, max_eval=25, history_size=20,
                                line_search_fn="strong_wolfe", tolerance_grad=0.0, tolerance_change=0.0)
        local = lambda: local_slice(param, d0, d1, comm)  # noqa: E731
    else:
        param = torch.zeros(d1 - d0, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.Adam([param], lr=args.lr)
        local = lambda: param  # noqa: E731

    def closure():
        opt.zero_grad()
        loss = objective(local())[0]
        loss.backward()
        return loss

    say(f"{'it':>4} {'objective':>12} {'misfit':>12} {'regul.':>10} {'rel.err':>8}")
    history = []
    for it in range(args.iters + 1):
        if it:
            opt.step(closure)
        with torch.no_grad():
            q = local().detach().clone()
            obj, mis, reg = (float(t) for t in objective(q))
        history.append(obj)
        say(f"{it:>4} {obj:12.5e} {mis:12.5e} {reg:10.3e} {prob.relative_error(q):8.4f}")
    rel, rel0 = prob.relative_error(q), prob.relative_error(torch.zeros_like(q))
    # one more gradient, to report what the checkpointed adjoint did
    u_out, info = integrate(prob.problem, prob.V.zeros(), q.clone().requires_grad_(True), dt=prob.dt,
                            n_steps=prob.steps, checkpoints=prob.checkpoints, return_info=True)
    global_sum(u_out.sum(), comm).backward()
    say(f"final objective {history[-1]:.5e}, relative error of q {rel:.4f} (q = 0: {rel0:.4f}); "
        f"adjoint: {info.schedule}, {info.forward_steps} forward steps for {info.n_steps} "
        f"(recomputed {info.recomputed_steps}, optimum {info.optimal_recomputed_steps}), "
        f"{time.perf_counter() - t0:.2f} s")
    if args.output:
        path = write_time_series(args.output, prob, q, max(1, args.steps // 20), comm)
        say(f"wrote {path}")
    passed = None
    if args.check:
        passed = (taylor_rate > 1.9 and history[-1] < 0.05 * history[0] and rel < 0.8 * rel0
                  and info.recomputed_steps == (info.optimal_recomputed_steps or 0))
        say(f"check: {'PASSED' if passed else 'FAILED'} (Taylor rate {taylor_rate:.3f} > 1.9, objective "
            f"{history[-1] / history[0]:.3g} x initial < 0.05, error {rel / rel0:.3f} x initial < 0.8, "
            f"recomputations at the optimum)")
    return {"history": history, "rel_error": rel, "initial_rel_error": rel0, "q": q,
            "taylor_rate": taylor_rate, "info": info, "passed": passed}


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    result = main()
    sys.exit(0 if result["passed"] in (None, True) else 1)
