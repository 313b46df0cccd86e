"""Learn a closure: a neural network, sharded over the ranks, predicts a per-cell conductivity
that a distributed FEM solve consumes; trained through the solve with torch.optim.

    python examples/learned_closure.py                              # 16 x 16 box, FSDP2, Adam
    mpirun -n 4 python examples/learned_closure.py --n 32 --iters 100
    mpirun -n 2 python examples/learned_closure.py --parallel ddp --check

The model. ``-div(kappa grad u) = 0`` on the unit square (P1 triangles of
:func:`slasolve.fem.box_mesh`), two experiments, ``u = x`` and ``u = y`` on the boundary
(two right-hand sides, one solve). The conductivity of a cell is an unknown function (the
closure) of what is known about the cell: its centre ``(x, y)`` and a microstructure
indicator ``m(x, y)``. The truth is ``log kappa = 0.8 m + 0.5 (x - 1/2)``; the data are the
potentials it gives at the interior nodes.

The learning. A small MLP ``(x, y, m) -> log kappa`` is wrapped with FSDP2's ``fully_shard``
(``--parallel fsdp2``, default: parameters sharded over the ranks) or DDP (``--parallel
ddp``: replicated) on the :func:`slasolve.dtensor.device_mesh` of ``COMM_WORLD`` -- the
processes ``mpirun`` started, no ``torchrun``. Each rank runs it on its own cells (a
``DTensor`` of cell features, ``Shard(0)``); the predicted field crosses into the FEM
assembly (:func:`slasolve.dtensor.from_dtensor` moves the cells to the mesh's partition),
the right-hand sides go in as a ``DTensor`` and :func:`slasolve.solve` hands the potentials
back as one, and the misfit ``1/(2 N) sum_obs (u - d)^2`` is a ``DTensor`` reduction.
``loss.backward()`` runs the adjoint solve, the assembly's backward, the moves and the
network's backward; FSDP/DDP then reduce the parameter gradients.

Same loss history at every rank count: the network sees the same cells (features do not
depend on the partition), the parameters start from one seed, and the global loss is a sum;
what differs is rounding and the Krylov iterates (CG + GAMG or Jacobi to ``--rtol``), so the
histories agree to about ``rtol`` times the conditioning (``--check`` asserts ``1e-6``
relative and compares against a plain-tensor run on one process, ``COMM_SELF``, without
``torch.distributed``).
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
from slasolve import dtensor as sd
from slasolve import global_sum
from slasolve import parse_args as parse_petsc_args
from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh

#: --check: largest relative difference allowed between the loss histories (see the module doc)
CHECK_RTOL = 1e-6


def microstructure(c: torch.Tensor) -> torch.Tensor:
    """Local. The known indicator ``m`` at points ``(k, 2)``."""
    return torch.sin(3 * math.pi * c[:, 0]) * torch.sin(2 * math.pi * c[:, 1])


def true_log_kappa(feats: torch.Tensor) -> torch.Tensor:
    """Local. The closure the network has to learn, from features ``(x, y, m)``."""
    return 0.8 * feats[:, 2] + 0.5 * (feats[:, 0] - 0.5)


class Closure(torch.nn.Module):
    """``(x, y, m) -> log kappa``: an MLP, initialised from ``seed`` (the same on every rank)."""

    def __init__(self, hidden: int = 16, seed: int = 0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.net = torch.nn.Sequential(torch.nn.Linear(3, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) / math.sqrt(max(p.shape[-1], 1)))
            self.net[-1].weight.mul_(0.1)   # start near a constant field
            self.net[-1].bias.zero_()

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.net(feats).sum(-1)    # (cells,): a new tensor, not a view


class Experiment:
    """Collective (constructor). Mesh, boundary conditions, features and data on ``comm``."""

    def __init__(self, n: int, comm, solve_opts: dict):
        self.comm = comm
        self.mesh = box_mesh(n, cell="triangle", comm=comm)
        self.space = space = Assembler(self.mesh)
        self.solve_opts = solve_opts
        bdofs = boundary_dofs(space)
        xb = space.owned_coords()[bdofs - space.dof_range[0]]
        self.g = [xb[:, 0].clone(), xb[:, 1].clone()]
        self.bc = DirichletBC(space, bdofs, self.g[0])
        self.obs = (~self.bc.constrained).to(torch.float64).unsqueeze(1)   # (n_owned, 1)
        self.n_obs = float(global_sum(self.obs.sum(), comm))
        centres = space.cell_coords.mean(1)
        self.feats = torch.cat([centres, microstructure(centres)[:, None]], 1)
        self.cell_offsets = np.concatenate([[0], np.cumsum(comm.allgather(self.feats.shape[0]))])
        with torch.no_grad():
            self.data, _ = self.potentials(true_log_kappa(self.feats))

    def potentials(self, log_kappa: torch.Tensor):
        """Collective. The constrained operator and the right-hand sides of both experiments for
        the local cells' ``log kappa``; returns ``(U, A_bc)`` with ``U`` ``(n_owned, 2)``."""
        A = self.space.stiffness(torch.exp(log_kappa))
        zero = self.space.zeros()
        A_bc, b1 = self.bc.apply(A, zero, values=self.g[0])
        _, b2 = self.bc.apply(A, zero, values=self.g[1])
        return slasolve.solve(A_bc, torch.stack([b1, b2], 1), **self.solve_opts), A_bc

    def kappa_error(self, log_kappa: torch.Tensor) -> float:
        """Collective. ``||kappa - kappa_true|| / ||kappa_true||`` over the cells (equal areas)."""
        k, kt = torch.exp(log_kappa.detach()), torch.exp(true_log_kappa(self.feats))
        s = global_sum(torch.stack([((k - kt) ** 2).sum(), (kt ** 2).sum()]), self.comm)
        return float(torch.sqrt(s[0] / s[1]))


def train_distributed(args, say) -> dict:
    """Collective. The DTensor path: the network wrapped by FSDP2 / DDP on the mesh of
    ``COMM_WORLD``, DTensors in and out of the solve."""
    from torch.distributed.tensor import DTensor, Shard
    comm = MPI.COMM_WORLD
    ex = Experiment(args.n, comm, solve_options(args))
    mesh = sd.device_mesh(comm)
    model = Closure(args.hidden, args.seed).double()
    if args.parallel == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh)
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    feats_d = sd.to_dtensor(ex.feats, ex.cell_offsets, mesh=mesh)    # the cells, DTensor's split
    _, A_bc = ex.potentials(true_log_kappa(ex.feats).detach())
    data_d = sd.to_dtensor(ex.data, A_bc, mesh=mesh)                 # the nodes, user numbering
    obs_d = sd.to_dtensor(ex.obs, A_bc, mesh=mesh)
    size = comm.Get_size()

    def loss_fn():
        theta_d = DTensor.from_local(model(feats_d.to_local()), mesh, [Shard(0)],
                                     shape=feats_d.shape[:1], stride=(1,))
        theta = sd.from_dtensor(theta_d, ex.cell_offsets)            # the mesh's cells
        A = ex.space.stiffness(torch.exp(theta))
        zero = ex.space.zeros()
        A_bc, b1 = ex.bc.apply(A, zero, values=ex.g[0])
        _, b2 = ex.bc.apply(A, zero, values=ex.g[1])
        U_d = slasolve.solve(A_bc, sd.to_dtensor(torch.stack([b1, b2], 1), A_bc, mesh=mesh), **ex.solve_opts)
        loss = (((U_d - data_d) ** 2) * obs_d).sum().full_tensor() / (2 * ex.n_obs)
        return loss, theta

    return _train(args, say, ex, opt, loss_fn, grad_scale=size)


def train_reference(args, say) -> dict:
    """Local. The plain-tensor path on one process (``COMM_SELF``): no torch.distributed."""
    ex = Experiment(args.n, MPI.COMM_SELF, solve_options(args))
    model = Closure(args.hidden, args.seed).double()
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)

    def loss_fn():
        theta = model(ex.feats)
        U, _ = ex.potentials(theta)
        return (((U - ex.data) ** 2) * ex.obs).sum() / (2 * ex.n_obs), theta

    return _train(args, say, ex, opt, loss_fn, grad_scale=1)


def _train(args, say, ex, opt, loss_fn, grad_scale) -> dict:
    """Collective. ``args.iters`` optimizer steps; the loss before each."""
    history, errors = [], []
    say(f"{'it':>4} {'loss':>12} {'kappa err':>10}")
    for it in range(args.iters + 1):
        opt.zero_grad()
        loss, theta = loss_fn()
        history.append(float(loss.detach()))
        errors.append(ex.kappa_error(theta))
        say(f"{it:>4} {history[-1]:12.5e} {errors[-1]:10.4f}")
        if it == args.iters:
            break
        # FSDP / DDP average the ranks' gradients: each rank's backward of the global loss gives
        # its own cells' share, so the average of the shares times the rank count is their sum
        (loss * grad_scale).backward()
        opt.step()
    return {"history": history, "kappa_error": errors}


def solve_options(args) -> dict:
    backend = args.backend or slasolve.krylov.default_backend()
    pc = args.pc or ("gamg" if backend == "petsc" else "jacobi")
    return dict(method="cg", backend=backend, pc=pc, rtol=args.rtol)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16, help="cells per side (2 n^2 triangles)")
    p.add_argument("--iters", type=int, default=60, help="Adam steps")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=16, help="width of the hidden layers")
    p.add_argument("--seed", type=int, default=0, help="seed of the network's initial parameters")
    p.add_argument("--parallel", choices=("fsdp2", "ddp"), default="fsdp2")
    p.add_argument("--backend", choices=("petsc", "torch"), default=None)
    p.add_argument("--pc", default=None, help="preconditioner (default gamg with PETSc, jacobi with torch)")
    p.add_argument("--rtol", type=float, default=1e-10)
    p.add_argument("--check", action="store_true",
                   help="also train the plain-tensor model on one process and compare the loss histories")
    p.add_argument("--quiet", action="store_true")
    return parse_petsc_args(p, argv)


def main(argv=None) -> dict:
    """Collective. Run the example; returns ``{"history", "kappa_error"}`` (and ``"reference"``
    with ``--check``)."""
    args = parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    say = print if rank == 0 and not args.quiet else (lambda *a, **k: None)
    t0 = time.perf_counter()
    opts = solve_options(args)
    say(f"slasolve learned closure: {args.n} x {args.n} box, {2 * args.n ** 2} cells, {size} rank(s), "
        f"MLP 3-{args.hidden}-{args.hidden}-1 with {args.parallel}, Adam lr {args.lr:g}, "
        f"cg + {opts['pc']} ({opts['backend']} backend, rtol {args.rtol:g})")
    out = train_distributed(args, say)
    h = out["history"]
    say(f"loss {h[0]:.4e} -> {h[-1]:.4e}, kappa error {out['kappa_error'][0]:.4f} -> "
        f"{out['kappa_error'][-1]:.4f}, {time.perf_counter() - t0:.2f} s")
    if args.check:
        ref = train_reference(args, lambda *a, **k: None)
        out["reference"] = ref
        diff = max(abs(a - b) / abs(b) for a, b in zip(h, ref["history"]))
        say(f"check: largest relative difference to the one-process plain-tensor history {diff:.2e} "
            f"(allowed {CHECK_RTOL:g}); loss decreased by {h[0] / h[-1]:.1f}x")
        if not diff <= CHECK_RTOL:
            raise AssertionError(f"loss history differs from the one-process reference by {diff:.2e}")
        if not h[-1] < h[0]:
            raise AssertionError(f"the loss did not decrease: {h[0]:.4e} -> {h[-1]:.4e}")
    return out


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    main()
    sys.exit(0)
