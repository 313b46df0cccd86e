"""FEM solves: manufactured-solution convergence, rank-independent discrete solutions,
adjoint gradients through assembly + Dirichlet + solve, and examples/fem_solve.py --check.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import os

import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh, manufactured_solve
from slasolve.fem.problems import assemble_manufactured, convergence_rates
from slasolve.testing import local_slice, replicate

from example_loader import load_example

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


def gather_vec(x):
    return np.concatenate(COMM.allgather(x.detach().numpy()))


def serial_reference(result):
    """The same discrete problem assembled on one rank (COMM_SELF) and solved directly."""
    mesh = box_mesh(result.n, cell=result.cell, comm=MPI.COMM_SELF)
    _, A, b, _ = assemble_manufactured(result.problem, mesh)
    return spla.spsolve(A.local.to_scipy("csc"), b.detach().numpy())


# (problem, dim, cell, levels, pc)
CONVERGENCE = [
    pytest.param("poisson", 2, "triangle", (8, 16, 32), "gamg", marks=pytest.mark.petsc),
    pytest.param("poisson", 2, "quad", (8, 16, 32), "gamg", marks=pytest.mark.petsc),
    pytest.param("poisson", 3, "tetra", (4, 8, 16), "gamg", marks=pytest.mark.petsc),
    ("elasticity", 2, "triangle", (8, 16, 32), "jacobi"),
]


@pytest.mark.parametrize("problem,dim,cell,levels,pc", CONVERGENCE)
def test_manufactured_convergence(problem, dim, cell, levels, pc):
    results = [manufactured_solve(problem, n, dim, cell, COMM, pc=pc, rtol=1e-11) for n in levels]
    assert all(r.converged for r in results)
    errs = [r.error_l2 for r in results]
    rates = convergence_rates(errs, [r.h for r in results])
    assert rates[-1] >= 1.85, (errs, rates)
    assert rates[0] >= 1.6, (errs, rates)
    # every rank reports the same error, and the discrete solution does not depend on the rank count
    assert len({round(e, 14) for e in COMM.allgather(errs[-1])}) == 1
    coarse = results[0]
    u = gather_vec(coarse.u)
    u_ref = serial_reference(coarse)
    assert np.abs(u - u_ref).max() <= 1e-8 * np.abs(u_ref).max()


@pytest.mark.petsc  # manufactured_solve's default pc: gamg
def test_3d_elasticity_and_hexahedra_converge():
    r1, r2 = (manufactured_solve("elasticity", n, 3, "tetra", COMM, pc="jacobi") for n in (4, 8))
    assert convergence_rates([r1.error_l2, r2.error_l2], [r1.h, r2.h])[0] > 1.6
    h1, h2 = (manufactured_solve("poisson", n, 3, "hexahedron", COMM) for n in (4, 8))
    assert convergence_rates([h1.error_l2, h2.error_l2], [h1.h, h2.h])[0] > 1.8


# ---------------------------------------------------------------- gradients through the solve
def _allsum(t):
    return replicate(t.reshape(1), COMM).sum()


def _setup(n=(3, 4), cell="triangle"):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < 1e-12), 0.0)
    return V, bc


def _solve(A, b):
    return slasolve.solve(A, b, "cg", pc="jacobi", rtol=1e-13)


def test_gradcheck_compliance():
    """Compliance b.x with x = A(kappa)^{-1} b, w.r.t. per-element kappa (global, replicated)."""
    V, bc = _setup()
    c0, c1 = V.cell_range
    b0 = V.load(lambda x: 1.0 + x[:, 0])

    def compliance(kappa_g):
        A, b = bc.apply(V.stiffness(local_slice(kappa_g, c0, c1, COMM)), b0)
        x = _solve(A, b)
        return _allsum((b * x).sum())

    kappa = (1.0 + 0.5 * torch.rand(V.n_global_cells, generator=torch.Generator().manual_seed(3),
                                    dtype=torch.float64)).requires_grad_()
    assert torch.autograd.gradcheck(compliance, (kappa,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_misfit_kappa_and_source():
    """Data misfit ||x(kappa, f) - d||^2 w.r.t. per-element kappa and the nodal source f."""
    V, bc = _setup((3, 4), "quad")
    c0, c1 = V.cell_range
    offs = COMM.allgather(V.n_owned_dofs)
    s = int(np.sum(offs[:COMM.rank]))
    d = V.interpolate(lambda x: 0.05 * x[:, 0] * x[:, 1])

    def misfit(kappa_g, f_g):
        A = V.stiffness(local_slice(kappa_g, c0, c1, COMM))
        b = V.load(local_slice(f_g, s, s + V.n_owned_dofs, COMM))
        A, b = bc.apply(A, b)
        x = _solve(A, b)
        return _allsum(((x - d) ** 2).sum())

    g = torch.Generator().manual_seed(4)
    kappa = (1.0 + 0.5 * torch.rand(V.n_global_cells, generator=g, dtype=torch.float64)).requires_grad_()
    f = torch.rand(V.n_global_dofs, generator=g, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(misfit, (kappa, f), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_gradcheck_elasticity_young():
    mesh = box_mesh((2, 4), cell="quad", comm=COMM)
    V = Assembler(mesh, 2)
    c0, c1 = V.cell_range
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 1] < 1e-12), 0.0)
    b0 = V.load(torch.tensor([0.0, -1.0]))

    def compliance(young_g):
        A, b = bc.apply(V.elasticity(local_slice(young_g, c0, c1, COMM), 0.3), b0)
        return _allsum((b * _solve(A, b)).sum())

    young = torch.linspace(1.0, 2.0, V.n_global_cells, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(compliance, (young,), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_bad_solve_inputs_raise_everywhere():
    V, bc = _setup()
    last = COMM.rank == COMM.size - 1
    with pytest.raises(ValueError):
        bc.apply(V.stiffness(), torch.zeros(V.n_owned_dofs + (1 if last else 0)))


# ---------------------------------------------------------------- the example
def _load_example():
    return load_example("fem_solve")


def test_example_check(capsys):
    ex = _load_example()
    assert ex.main(["--check", "--n", "8", "--levels", "2"]) == 0
    assert ex.main(["--check", "--problem", "elasticity", "--cell", "quad", "--pc", "jacobi", "--n", "8",
                    "--levels", "2"]) == 0
    out = capsys.readouterr().out
    if COMM.rank == 0:
        assert "check: rate" in out and "OK" in out


def test_example_output(tmp_path_factory):
    ex = _load_example()
    d = COMM.bcast(str(tmp_path_factory.mktemp("fem")) if COMM.rank == 0 else None, root=0)
    path = os.path.join(d, "u.pvtu")
    assert ex.main(["--n", "8", "--output", path]) == 0
    COMM.Barrier()
    assert os.path.exists(path)
    assert os.path.exists(os.path.join(d, f"u_{COMM.rank:04d}.vtu"))
