"""The block size of ``nonlinear_solve``'s PETSc Jacobian Mat (``linear_solver`` ``block_size``, e.g.
a ``slasolve.fem`` problem's ``block_size``; default 1). The Mat and the SNES's vectors carry it;
answers match the scalar Mat, sparse direct Newton (MUMPS: a reference slasolve's Krylov code does
not touch), SciPy and central differences; without it the Mat stays scalar; a block size that does
not divide some rank's rows raises on every rank."""
import numpy as np
import pytest
import scipy.optimize as so
import torch

import slasolve
from slasolve import DSparseTensor
from slasolve.fem import Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh, rigid_body_modes

pytestmark = pytest.mark.mpi
RTOL = 1e-10
F64 = torch.float64


def _solid(comm, dim, n):
    sp = Assembler(box_mesh(n, cell="triangle" if dim == 2 else "tetra", comm=comm), dim)
    bd = boundary_dofs(sp, where=lambda x: x[:, 0] < 1e-12)
    force = torch.zeros(dim, dtype=F64)
    force[-1] = -0.3
    P = NeoHookean(sp, DirichletBC(sp, bd, torch.zeros(len(bd), dtype=F64)), mu=1.0, lmbda=1.5, body_force=force)
    mu = (1.0 + 0.5 * sp.cell_coords.mean(1)[:, 0]).to(F64)
    return sp, P, mu


def _loss(sp, P, mu, ls, backend=None, objective=True):
    """``(J, u, dJ/dmu, info)`` with ``J = sum u^2`` over the ranks."""
    m = mu.clone().requires_grad_()
    u, info = slasolve.nonlinear_solve(P.residual, sp.zeros(), m, jacobian=P.jacobian, rtol=RTOL,
                                       linear_solver=ls, backend=backend, objective=P.energy if objective else None,
                                       return_info=True)
    J = slasolve.global_sum((u ** 2).sum(), sp.comm)
    J.backward()
    return float(J.detach()), u.detach(), m.grad, info


def _kept_solvers(J):
    """The SNES solvers ``nonlinear_solve`` keeps on the layout of the Jacobian ``J``."""
    return list(J._layout.cache("nonlinear_solvers").values())


def _close(a, b, rel, comm):
    num = slasolve.global_sum(((a - b) ** 2).sum(), comm)
    den = slasolve.global_sum((b ** 2).sum(), comm)
    return float(num.sqrt()) <= rel * float(den.sqrt())


@pytest.mark.petsc
@pytest.mark.parametrize("dim", [2, 3])
def test_vector_problem_gets_the_block_size_and_the_same_answer(comm, dim):
    sp, P, mu = _solid(comm, dim, 8 if dim == 2 else 3)
    assert P.block_size == dim
    J_ref, u_ref, g_ref, info_ref = _loss(sp, P, mu, dict(method="direct"))
    Z = rigid_body_modes(sp)
    ls = dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=Z, block_size=P.block_size)
    J, u, g, info = _loss(sp, P, mu, ls)
    layout_J = P.jacobian(sp.zeros())
    # (two when the line search on the energy handed over to ||F||: a SNES of other tolerances)
    gamg = [s for s in _kept_solvers(layout_J) if s.types[2] == "gamg"]
    assert gamg and all(s.Jmat.getBlockSize() == dim and s.X.getBlockSize() == dim and s.F.getBlockSize() == dim
                        for s in gamg)
    assert info.converged and info.iterations == info_ref.iterations
    assert _close(u, u_ref, 1e-8, comm) and _close(g, g_ref, 1e-7, comm)
    # the default: the scalar Mat, the same Newton steps and answer, its own kept SNES
    J1, u1, g1, info1 = _loss(sp, P, mu, dict(method="cg", pc="gamg", rtol=RTOL, near_nullspace=Z))
    assert {s.Jmat.getBlockSize() for s in _kept_solvers(layout_J) if s.types[2] == "gamg"} == {1, dim}
    assert info1.iterations == info.iterations
    assert _close(u, u1, 1e-8, comm) and _close(g, g1, 1e-7, comm)
    # the gradient against a central difference of the loss along a direction
    torch.manual_seed(comm.rank)
    d = torch.rand(mu.shape, dtype=F64) - 0.5
    h = 1e-4
    Jp = _loss(sp, P, mu + h * d, ls)[0]
    Jm = _loss(sp, P, mu - h * d, ls)[0]
    fd = (Jp - Jm) / (2 * h)
    ad = float(slasolve.global_sum((g * d).sum(), comm))
    assert abs(fd - ad) <= 1e-5 * abs(ad) + 1e-9


def test_torch_backend_accepts_and_ignores_it(comm):
    sp, P, mu = _solid(comm, 2, max(4, 2 * comm.size))
    _, u_ref, g_ref, _ = _loss(sp, P, mu, dict(method="cg", rtol=RTOL), backend="torch", objective=False)
    _, u, g, info = _loss(sp, P, mu, dict(method="cg", rtol=RTOL, block_size=2), backend="torch", objective=False)
    assert info.converged and torch.equal(u, u_ref) and torch.equal(g, g_ref)


class Chain:
    """``F(u) = A u + u^3 - 1`` with ``A = tridiag(-1, 2, -1)`` on ``n`` unknowns, rows split
    ``counts`` over the ranks (a user's scalar problem: plain functions)."""

    def __init__(self, comm, counts):
        self.comm = comm
        offs = np.concatenate([[0], np.cumsum(counts)])
        self.n = n = int(offs[-1])
        lo, hi = int(offs[comm.rank]), int(offs[comm.rank + 1])
        g = np.arange(lo, hi)
        cols = np.stack([g - 1, g, g + 1], 1)
        keep = (cols >= 0) & (cols < n)
        vals = np.broadcast_to(np.array([-1.0, 2.0, -1.0]), cols.shape)[keep]
        self.A = DSparseTensor.from_local_rows(np.concatenate([[0], np.cumsum(keep.sum(1))]), cols[keep],
                                               torch.tensor(vals, dtype=F64), (n, n), comm)
        self.diag = torch.as_tensor(np.flatnonzero((cols[keep] == np.repeat(g, keep.sum(1)))))
        self.n_local = hi - lo
        self.lo, self.hi = lo, hi

    def residual(self, u, c):
        return self.A @ u + c * u ** 3 - 1.0

    def jacobian(self, u, c):
        v = self.A.values.clone()
        v[self.diag] += 3 * c * u ** 2
        return self.A.with_values(v)

    def scipy_solution(self, c):
        A = np.diag(np.full(self.n, 2.0)) - np.diag(np.ones(self.n - 1), 1) - np.diag(np.ones(self.n - 1), -1)
        return so.root(lambda x: A @ x + c * x ** 3 - 1.0, np.zeros(self.n), tol=1e-13).x[self.lo:self.hi]


@pytest.mark.petsc
def test_user_scalar_problem_scalar_by_default_and_blocked_on_request(comm):
    prob = Chain(comm, [6] * comm.size)
    c = torch.tensor(0.5, dtype=F64)
    ref = torch.from_numpy(prob.scipy_solution(0.5))

    def solve(**ls):
        return slasolve.nonlinear_solve(prob.residual, torch.zeros(prob.n_local, dtype=F64), c,
                                        jacobian=prob.jacobian, rtol=RTOL,
                                        linear_solver=dict(method="gmres", pc="jacobi", **ls), return_info=True)
    u, info = solve()
    assert info.converged and _close(u, ref, 1e-8, comm)
    J = prob.jacobian(u, c)
    assert [s.Jmat.getBlockSize() for s in _kept_solvers(J)] == [1]
    for bs in (2, 3):
        u2, info2 = solve(block_size=bs)
        assert info2.converged and _close(u2, ref, 1e-8, comm)
    assert sorted(s.Jmat.getBlockSize() for s in _kept_solvers(J)) == [1, 2, 3]


@pytest.mark.parametrize("case", ["not dividing on rank 0", "zero", "float"])
def test_bad_block_size_raises_on_every_rank(comm, case):
    # rank 0 owns 5 rows, the others 4: block size 2 divides every rank's rows but rank 0's
    counts = [5] + [4] * (comm.size - 1) if case == "not dividing on rank 0" else [4] * comm.size
    prob = Chain(comm, counts)
    bs = {"not dividing on rank 0": 2, "zero": 0, "float": 2.0}[case]
    match = "does not divide this rank's 5 owned rows" if case.startswith("not") else "must be an int >= 1"
    with pytest.raises(ValueError, match=match):
        slasolve.nonlinear_solve(prob.residual, torch.zeros(prob.n_local, dtype=F64), torch.tensor(0.5, dtype=F64),
                                 jacobian=prob.jacobian, linear_solver=dict(method="gmres", block_size=bs))
