"""slasolve.testing.taylor_test: the first-order Taylor remainder of every differentiable
solver (solve, spsolve, eigsh, nonlinear_solve) converges at rate 2 at any rank count, and a
wrong gradient is reported (rate 1) on every rank. Time stepping: tests/test_timestepping.py.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import math

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, DirichletBC, NonlinearDiffusion, boundary_dofs, box_mesh
from slasolve.testing import TaylorTestError, poisson_matrix, taylor_test

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64


def allsum(t):
    return slasolve.global_sum(t, COMM)


def local_random(shape, seed):
    """A direction that depends on the rank (any direction is a valid Taylor test)."""
    g = torch.Generator().manual_seed(1000 * seed + COMM.rank)
    return torch.randn(shape, generator=g, dtype=DT)


def system(n=5, seed=0):
    """A nonsymmetric, well-conditioned matrix on an n x n grid, distributed by rows."""
    rng = np.random.default_rng(seed)
    A = poisson_matrix((n, n)).tocoo()
    A = sp.csr_matrix((A.data * (1 + 0.2 * rng.uniform(size=A.nnz)), (A.row, A.col)), shape=A.shape)
    A.sort_indices()
    return slasolve.DSparseTensor.from_global(A, COMM)


def test_polynomial_rates_and_a_wrong_gradient_fails_everywhere():
    x = 1.0 + local_random(7, 1) ** 2
    J = lambda x: allsum((x ** 3).sum() + torch.sin(x).sum())
    r = taylor_test(J, x, local_random(7, 2))
    assert r.passed and abs(r.rate - 2.0) < 0.05 and len(r.rates) == 3
    assert float(r) == r.rate
    # the zeroth-order remainders fall like h
    assert abs(math.log2(r.zeroth_order[-2] / r.zeroth_order[-1]) - 1.0) < 0.05
    with pytest.raises(TaylorTestError, match="falls like h|fall like h"):
        taylor_test(J, x, local_random(7, 2), dJdm=r.dJdm * 1.5)
    r = taylor_test(J, x, local_random(7, 2), dJdm=r.dJdm * 1.5, raise_on_fail=False)
    assert not r.passed and abs(r.rate - 1.0) < 0.2
    # J affine along dm: remainders at rounding, the gradient is exact
    assert taylor_test(lambda x: allsum(3.0 * x.sum()), x, local_random(7, 3)).rate == math.inf


def test_bad_input_raises_on_every_rank():
    x = torch.ones(3, dtype=DT)
    with pytest.raises(ValueError, match="shape"):
        taylor_test(lambda x: allsum(x.sum()), x, torch.ones(4 if COMM.rank == 0 else 3, dtype=DT))
    with pytest.raises(TypeError, match="scalar"):
        taylor_test(lambda x: x * 2, x, x)
    if COMM.size > 1:   # a local (not reduced) functional differs between ranks
        with pytest.raises(ValueError, match="differs between ranks"):
            taylor_test(lambda x: (x * (1 + COMM.rank)).sum(), x, x)


@pytest.mark.parametrize("backend", [pytest.param("petsc", marks=pytest.mark.petsc), "torch"])
def test_solve(backend):
    A = system()
    b = local_random(A.n_local, 4)

    def J(values, b):
        x = slasolve.solve(A.with_values(values), b, "gmres", backend=backend, rtol=1e-13, restart=60,
                           pc="jacobi")
        return allsum((x ** 2).sum() + x.sum())

    dv = 0.1 * A.values * local_random(A.values.shape, 5)
    r = taylor_test(J, [A.values, b], [dv, local_random(A.n_local, 6)])
    assert r.passed and r.rate > 1.9


@pytest.mark.petsc
def test_spsolve():
    A = system(seed=1)
    b = local_random(A.n_local, 7)

    def J(values, b):
        x = slasolve.spsolve(A.with_values(values), b)
        return allsum((x ** 2).sum())

    dv = 0.1 * A.values * local_random(A.values.shape, 8)
    assert taylor_test(J, [A.values, b], [dv, local_random(A.n_local, 9)]).rate > 1.9


@pytest.mark.parametrize("backend", [pytest.param("slepc", marks=pytest.mark.petsc), "torch"])
def test_eigsh(backend):
    n = 18
    rng = np.random.default_rng(3)
    A = (sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n)) + sp.diags(rng.uniform(0, 1, n))).tocsr()
    A.sort_indices()
    D = sp.triu(A).tocsr()
    D.data = rng.standard_normal(D.nnz)
    D = (D + sp.triu(D, 1).T).tocsr()     # symmetric, the pattern of A
    D.sort_indices()
    assert (D.indptr == A.indptr).all() and (D.indices == A.indices).all()
    dA, dD = slasolve.DSparseTensor.from_global(A, COMM), slasolve.DSparseTensor.from_global(D, COMM)
    c = torch.tensor([1.0, -0.5], dtype=DT)

    def J(values):
        w, V = slasolve.eigsh(dA.with_values(values), k=2, which="SA", backend=backend, tol=1e-13)
        return (w * c).sum() + allsum((V[:, 0] ** 4).sum())

    assert taylor_test(J, dA.values, 0.1 * dD.values).rate > 1.9


@pytest.mark.parametrize("backend", [pytest.param("petsc", marks=pytest.mark.petsc), "torch"])
def test_nonlinear_solve(backend):
    V = Assembler(box_mesh((4, 4), cell="quad", comm=COMM))
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < 1e-12), lambda x: 0.5 + x[:, 1])
    P = NonlinearDiffusion(V, bc, source=lambda x: 4.0 + 2 * x[:, 0])
    kappa = 1.0 + 0.3 * torch.cos(V.cell_coords.mean(1)[:, 0] * 3.0)
    w = V.interpolate(lambda x: torch.sin(2 * x[:, 0]) + x[:, 1])

    def J(kappa):
        u = slasolve.nonlinear_solve(P.residual, V.zeros(), kappa, jacobian=P.jacobian, backend=backend,
                                     rtol=1e-13, stol=1e-12, linear_solver={"method": "gmres", "rtol": 1e-13})
        return allsum((w * u).sum() + 0.5 * (u * u).sum())

    assert taylor_test(J, kappa, 0.2 * local_random(kappa.shape, 10)).rate > 1.9
