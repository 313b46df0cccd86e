"""``nonlinear_solve``'s PETSc callbacks on ``slasolve.fem`` problems: the problems' NumPy kernels
(``iterate_kernels``) write the residual straight into SNES's Vec and the tangent's values into its
AIJ Mat. References: the problems' own ``residual`` / ``jacobian`` methods (the same operations:
equal bit for bit), the same solve through plain callables wrapping those methods (no kernels:
the same iterates, residual histories and answers, bit for bit), and the kernels' applicability
rules. Run serially and under mpirun -n 2 / 3 (marked ``mpi``).
"""
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import (Assembler, DirichletBC, NeoHookean, NonlinearDiffusion, boundary_dofs, box_mesh,
                          rigid_body_modes)
from slasolve.nonlinear import problem as problem_mod

pytestmark = pytest.mark.mpi
F64 = torch.float64


def _diffusion(comm, n=8, cell="triangle"):
    sp = Assembler(box_mesh(max(n, comm.Get_size()), cell=cell, comm=comm))
    bd = boundary_dofs(sp)
    g = torch.linspace(0.0, 0.3, len(bd), dtype=F64)
    return sp, NonlinearDiffusion(sp, DirichletBC(sp, bd, g), source=10.0)


def _solid(comm, dim, **kw):
    n = max(4, comm.Get_size())
    sp = Assembler(box_mesh((6, n) if dim == 2 else (3, 2, n), cell="triangle" if dim == 2 else "tetra",
                            comm=comm), dim)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    force = torch.zeros(dim, dtype=F64)
    force[-1] = -0.2
    return sp, NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), body_force=force, **kw)


def _coef(sp, scale=1.0):
    c = sp.cell_coords.mean(1)
    return scale * torch.exp(0.3 * torch.sin(3 * c[:, 0]) * torch.cos(2 * c[:, 1]))


class _Counted:
    """Counts the calls of the kernels ``Problem.iterate_kernels`` hands out."""

    def __init__(self, monkeypatch):
        self.made, self.res, self.tan = 0, 0, 0
        real = problem_mod.Problem.iterate_kernels
        outer = self

        def counted(prob):
            k = real(prob)
            if k is None:
                return None
            outer.made += 1
            r, t = k

            def r2(x, out):
                outer.res += 1
                return r(x, out)

            def t2(x):
                outer.tan += 1
                return t(x)
            return r2, t2
        monkeypatch.setattr(problem_mod.Problem, "iterate_kernels", counted)


def _cases(comm):
    sp, P = _diffusion(comm)
    yield "diffusion", sp, P, (_coef(sp),), dict(method="gmres", pc="gamg", rtol=1e-10), {}
    for dim in (2, 3):
        sp, P = _solid(comm, dim)
        mu = _coef(sp)
        ls = dict(method="cg", pc="gamg", rtol=1e-10, near_nullspace=rigid_body_modes(sp))
        yield f"neohookean{dim}d", sp, P, (mu, 1.5 * mu), ls, dict(objective=P.energy)


def test_kernels_equal_the_methods(comm):
    for name, sp, P, params, _, _ in _cases(comm):
        k = P.iterate_kernels(P.residual, P.jacobian, params)
        assert k is not None, name
        residual_into, tangent_values = k
        g = torch.Generator().manual_seed(3 + comm.rank)
        u = 0.02 * torch.rand(sp.n_owned_dofs, generator=g, dtype=F64)
        with torch.no_grad():
            r, J = P.residual(u, *params), P.jacobian(u, *params)
        x = u.numpy().copy()
        out = torch.empty_like(u).numpy()
        residual_into(x, out)
        assert torch.equal(torch.from_numpy(x), u)            # the iterate is not changed
        assert torch.equal(torch.from_numpy(out), r), name
        # the tangent where the latest residual was (its cell data kept), then elsewhere
        assert torch.equal(torch.from_numpy(tangent_values(x)), J.values), name
        v = u + 0.01 * torch.rand(sp.n_owned_dofs, generator=g, dtype=F64)
        with torch.no_grad():
            Jv = P.jacobian(v, *params)
        residual_into(x, out)
        assert torch.equal(torch.from_numpy(tangent_values(v.numpy().copy())), Jv.values), name
        assert torch.equal(torch.from_numpy(tangent_values(x)), J.values), name


def test_solve_with_kernels_equals_solve_through_the_methods(comm, monkeypatch):
    for name, sp, P, params, ls, extra in _cases(comm):
        # GAMG keeps its prolongators from one call's last tangent to the next call's first (the
        # kept SNES): compare two calls that both follow a call that ended at the same solution
        for _ in range(2):
            ref, info_ref = slasolve.nonlinear_solve(
                lambda v, *p: P.residual(v, *p), sp.zeros(), *params, jacobian=lambda v, *p: P.jacobian(v, *p),
                rtol=1e-10, linear_solver=ls, return_info=True, **extra)
        count = _Counted(monkeypatch)
        u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), *params, jacobian=P.jacobian, rtol=1e-10,
                                           linear_solver=ls, return_info=True, **extra)
        monkeypatch.undo()
        assert info.converged and info_ref.converged
        if comm.Get_size() <= 2:
            assert torch.equal(u, ref), name
            assert info.residual_history == info_ref.residual_history, name
        else:   # PETSc's parallel sums at 3+ ranks (oversubscribed) differ run to run in the last bits
            diff = comm.allreduce(float((u - ref).abs().max()), op=MPI.MAX)
            assert diff <= 1e-10 * comm.allreduce(float(ref.abs().max()), op=MPI.MAX), name
        assert info.iterations == info_ref.iterations
        assert (info.function_evaluations, info.jacobian_evaluations) == \
            (info_ref.function_evaluations, info_ref.jacobian_evaluations)
        # the kernels did every evaluation, those at u0 too (after one collective input check)
        assert count.made >= 1
        assert count.res == info.function_evaluations
        assert count.tan == info.jacobian_evaluations


def test_gradient_through_a_solve_with_kernels(comm):
    # the backward differentiates the residual method (torch path): against central differences
    sp, P = _diffusion(comm)
    ls = dict(method="gmres", pc="gamg", rtol=1e-12)

    def J_of(kappa):
        u = slasolve.nonlinear_solve(P.residual, sp.zeros(), kappa, jacobian=P.jacobian, rtol=1e-12,
                                     linear_solver=ls)
        return slasolve.global_sum(0.5 * (u ** 2).sum(), comm)
    kappa = _coef(sp).requires_grad_(True)
    J_of(kappa).backward()
    g = torch.Generator().manual_seed(5)
    d = torch.randn(sp.mesh.n_local_cells, generator=g, dtype=F64)
    h = 1e-6
    with torch.no_grad():
        fd = (J_of(kappa + h * d) - J_of(kappa - h * d)) / (2 * h)
    dd = slasolve.global_sum((kappa.grad * d).sum(), comm)
    assert abs(float(dd) - float(fd)) <= 1e-6 * abs(float(fd))


def test_inversion_mid_solve_raises_on_every_rank_through_the_kernels(comm):
    sp = Assembler(box_mesh(max(4, comm.Get_size()), cell="triangle", comm=comm), 2)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), mu=1.0, lmbda=1.5,
                   body_force=torch.tensor([0.0, -200.0], dtype=F64), on_inversion="raise")
    assert P.iterate_kernels(P.residual, P.jacobian, ()) is not None
    with pytest.raises(ValueError, match="invert"):
        slasolve.nonlinear_solve(P.residual, sp.zeros(), jacobian=P.jacobian, line_search="basic",
                                 linear_solver=dict(method="direct"))


def test_no_kernels_where_they_do_not_apply(comm):
    sp, P = _diffusion(comm)
    assert P.iterate_kernels(P.residual, P.jacobian, ()) is not None
    assert P.iterate_kernels(P.residual, P.jacobian, (1.5,)) is not None
    # a callable coefficient may answer differently per call; the methods of another object
    assert P.iterate_kernels(P.residual, P.jacobian, (lambda x: 1.0 + x[:, 0],)) is None
    _, Q = _diffusion(comm)
    assert P.iterate_kernels(Q.residual, P.jacobian, ()) is None
    assert P.iterate_kernels(P.residual, Q.residual, ()) is None

    class Mine(NonlinearDiffusion):   # an overridden residual: the kernels would not be its formulas
        def residual(self, u, kappa=None):
            return super().residual(u, kappa) + 1.0
        residual.raises_collectively = True
    M = Mine(sp, P.bc, source=10.0)
    assert M.iterate_kernels(M.residual, M.jacobian, ()) is None
    # Q1 cells (the torch path's quadrature), the block tangent
    _, Pq = _diffusion(comm, cell="quad")
    assert Pq.iterate_kernels(Pq.residual, Pq.jacobian, ()) is None
    sb, S = _solid(comm, 2, block_jacobian=True)
    assert S.iterate_kernels(S.residual, S.jacobian, ()) is None
