"""``nonlinear_solve(..., linear_solver=dict(near_nullspace=Z))``: GAMG's near-nullspace on the
Newton tangents (rigid-body modes for a neo-Hookean solid), checked against the same Newton
solve with sparse direct inner solves (MUMPS / SciPy's factorisations: a reference slasolve's
Krylov code does not touch), at any rank count; bad input raises on every rank."""
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh, rigid_body_modes

pytestmark = pytest.mark.mpi
RTOL = 1e-10


def _solid(comm, n=4):
    sp = Assembler(box_mesh(n, cell="tetra", comm=comm), 3)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64)), mu=1.0, lmbda=1.5,
                   body_force=torch.tensor([0.0, 0.0, -0.3], dtype=torch.float64))
    mu = (1.0 + 0.5 * sp.cell_coords.mean(1)[:, 0]).to(torch.float64)
    return sp, P, mu


def _solve_and_grad(sp, P, mu, ls, backend=None):
    m = mu.clone().requires_grad_()
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), m, jacobian=P.jacobian, rtol=RTOL,
                                       linear_solver=ls, backend=backend, return_info=True)
    J = slasolve.global_sum((u ** 2).sum(), sp.comm)
    J.backward()
    return u.detach(), m.grad, info


def _close(a, b, rel, comm):
    num = slasolve.global_sum(((a - b) ** 2).sum(), comm)
    den = slasolve.global_sum((b ** 2).sum(), comm)
    return float(num.sqrt()) <= rel * float(den.sqrt())


@pytest.mark.petsc
def test_gamg_with_rigid_body_modes_matches_direct_newton(comm):
    sp, P, mu = _solid(comm)
    u_ref, g_ref, info_ref = _solve_and_grad(sp, P, mu, dict(method="direct"))
    Z = rigid_body_modes(sp)
    for _ in range(2):   # the second call runs on the kept SNES, its near-nullspace kept too
        u, g, info = _solve_and_grad(sp, P, mu, dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=Z))
        assert info.converged and info.iterations == info_ref.iterations
        assert _close(u, u_ref, 1e-8, comm) and _close(g, g_ref, 1e-7, comm)
    # the same span given on some ranks with other values (scaled): a new SNES, the same answer
    Z2 = Z * (2.0 if comm.rank == 0 else 1.0)
    u, g, info = _solve_and_grad(sp, P, mu, dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=Z2))
    assert info.converged and _close(u, u_ref, 1e-8, comm) and _close(g, g_ref, 1e-7, comm)


def test_torch_backend_accepts_and_ignores_the_hint(comm):
    # the native solvers take no near-nullspace: the same computation as without it
    sp, P, mu = _solid(comm, max(3, comm.size))
    u_ref, g_ref, _ = _solve_and_grad(sp, P, mu, dict(method="cg", rtol=RTOL), backend="torch")
    u, g, info = _solve_and_grad(sp, P, mu, dict(method="cg", rtol=RTOL, near_nullspace=rigid_body_modes(sp)),
                                 backend="torch")
    assert info.converged and torch.equal(u, u_ref) and torch.equal(g, g_ref)


@pytest.mark.parametrize("case", ["shape on rank 0", "nan", "matrix-free", "direct", "columns differ"])
def test_bad_near_nullspace_raises_on_every_rank(comm, case):
    sp, P, mu = _solid(comm, max(2, comm.size))
    Z = rigid_body_modes(sp)
    ls, jac = dict(method="cg", near_nullspace=Z), P.jacobian
    if case == "shape on rank 0" and comm.rank == 0:
        ls["near_nullspace"] = Z[1:]
    elif case == "nan":
        Z = Z.clone()
        Z[-1, 0] = float("nan") if comm.rank == comm.size - 1 else Z[-1, 0]
        ls["near_nullspace"] = Z
    elif case == "matrix-free":
        ls, jac = dict(near_nullspace=Z), None
    elif case == "direct":
        ls["method"] = "direct"
    elif case == "columns differ":
        if comm.size == 1:
            pytest.skip("needs 2+ ranks")
        ls["near_nullspace"] = Z[:, :3] if comm.rank == comm.size - 1 else Z
    with pytest.raises(ValueError, match="near_nullspace"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), mu, jacobian=jac, linear_solver=ls)
