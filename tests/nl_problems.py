"""The nonlinear-solve tests' small shared problems on the unit square (P1 triangles): the
nonlinear diffusion ``-div((1 + u^2) grad u) = 10`` with ``u = 0`` on the boundary, and a plane
neo-Hookean strip clamped at ``x = 0`` under a downward body force. Collective (the mesh and the
spaces are distributed over ``comm``)."""
import torch

from slasolve.fem import Assembler, DirichletBC, NeoHookean, NonlinearDiffusion, boundary_dofs, box_mesh

F64 = torch.float64
#: a direct inner solver: runs compared to rounding (a kept SNES's GAMG reuses the previous run's
#: prolongators; MUMPS at 3+ ranks need not repeat itself bit for bit)
LU = dict(method="direct")


def diffusion(comm, n: int = 8):
    """``(space, NonlinearDiffusion)`` on an ``n`` x ``n`` square of triangles."""
    sp = Assembler(box_mesh(n, cell="triangle", comm=comm))
    bd = boundary_dofs(sp)
    return sp, NonlinearDiffusion(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), source=10.0)


def solid(comm, load: float):
    """``(space, NeoHookean)`` (mu 1, lambda 1.5) on a 4 x 8 strip clamped at ``x = 0``, body force
    ``(0, -load)``."""
    sp = Assembler(box_mesh((4, 8), cell="triangle", comm=comm), 2)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    return sp, NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), mu=1.0, lmbda=1.5,
                          body_force=torch.tensor([0.0, -load], dtype=F64))
