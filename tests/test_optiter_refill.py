"""The optimisation iteration's fast paths against references: the per-cell assembly operator's
gradient against central finite differences, the in-place refill of the cached AIJ Mat against a
raw petsc4py Mat built from the SciPy assembly of the same element matrices, and CG + GAMG with a
user's non-CG eigenvalue estimator (the natural-norm defaults must then stay out).

Run serially and under mpirun -n 2 / 3 with --with-mpi.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh, elasticity_stiffness, stiffness

PETSc = pytest.importorskip("petsc4py.PETSc", reason="petsc4py is not installed")

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD

CASES = [("triangle", 1, (5, 6)), ("tetra", 3, (2, 3, 3)), ("triangle", 2, (4, 5))]


def operator(space, bs, c):
    return space.stiffness(c) if bs == 1 else space.elasticity(c, 0.3)


def element_matrices(coords, bs, c, cell):
    if bs == 1:
        return stiffness(coords, c, cell)
    return elasticity_stiffness(coords, c, 0.3, cell, kind="plane_strain" if coords.shape[-1] == 2 else "3d")


def theta_of(space, k):
    x = space.cell_coords.mean(1)
    return 0.4 * torch.sin(3.0 * x[:, 0] + k) * torch.cos(2.0 * x[:, 1] - 0.5 * k)


@pytest.mark.parametrize("cell,bs,n", CASES)
def test_value_gradient_matches_finite_differences(cell, bs, n):
    space = Assembler(box_mesh(n, cell=cell, comm=COMM), bs)
    g = torch.Generator().manual_seed(1 + COMM.Get_rank())
    w = torch.rand(space.template.values.shape, generator=g, dtype=torch.float64)
    theta = theta_of(space, 0.3).clone().requires_grad_()

    def f(t):
        return slasolve.global_sum((operator(space, bs, torch.exp(t)).values * w).sum(), COMM)

    f(theta).backward()
    d = torch.rand(theta.shape, generator=g, dtype=torch.float64) - 0.5
    h = 1e-6
    with torch.no_grad():
        fd = (f(theta + h * d) - f(theta - h * d)) / (2 * h)
    ad = slasolve.global_sum((theta.grad * d).sum(), COMM)
    assert float(ad) == pytest.approx(float(fd), rel=1e-7)


def global_reference(cell, bs, n, k):
    serial = Assembler(box_mesh(n, cell=cell, comm=MPI.COMM_SELF), bs)
    c = torch.exp(theta_of(serial, k))
    Ke = element_matrices(serial.cell_coords, bs, c, cell).numpy()
    cells = serial.mesh.cells.numpy()
    E, nv = cells.shape
    dofs = (cells[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(E, nv * bs)
    r = np.repeat(dofs, nv * bs, axis=1).reshape(-1)
    cc = np.tile(dofs, (1, nv * bs)).reshape(-1)
    N = serial.n_global_dofs
    return sp.coo_matrix((Ke.reshape(-1), (r, cc)), shape=(N, N)).tocsr()


@pytest.mark.parametrize("cell,bs,n", CASES)
def test_refilled_mat_equals_raw_petsc_assembly(cell, bs, n):
    """Several value changes, each written into the cached Mat (after the first refill: straight
    into its arrays): the Mat equals a raw petsc4py Mat of the SciPy assembly every time, and
    its state moves with every change (PETSc rebuilds preconditioners)."""
    space = Assembler(box_mesh(n, cell=cell, comm=COMM), bs)
    r0, r1 = space.dof_range
    states = []
    for k in range(4):
        K = operator(space, bs, torch.exp(theta_of(space, float(k))))
        M = K.to_petsc(mat_type="aij")
        states.append(M.stateGet())
        ref = global_reference(cell, bs, n, float(k))[r0:r1]
        ref.sort_indices()
        R = PETSc.Mat().createAIJ(size=M.getSizes(), csr=(ref.indptr.astype(PETSc.IntType),
                                                          ref.indices.astype(PETSc.IntType), ref.data), comm=COMM)
        R.assemble()
        D = R.copy()
        D.axpy(-1.0, M, structure=PETSc.Mat.Structure.DIFFERENT_NONZERO_PATTERN)
        err = D.norm(PETSc.NormType.FROBENIUS) / R.norm(PETSc.NormType.FROBENIUS)
        R.destroy(), D.destroy()
        assert err <= 1e-14, (k, err)
    assert all(b > a for a, b in zip(states, states[1:]))


def test_loop_solutions_match_scipy_every_iteration():
    """An optimisation loop on one layout (refills into the cached Mat, interpolation reuse):
    every iteration's solution against SciPy's sparse direct solve of the gathered matrix."""
    import scipy.sparse.linalg as spla
    space = Assembler(box_mesh((12, 12), cell="triangle", comm=COMM))
    bc = DirichletBC(space, boundary_dofs(space), 0.0)
    f = space.load(1.0)
    r0, r1 = space.dof_range
    for k in range(4):
        K, b = bc.apply(space.stiffness(torch.exp(theta_of(space, float(k)))), f)
        u = slasolve.solve(K, b, "cg", pc="gamg", rtol=1e-10)
        A = sp.vstack(COMM.allgather(K.detach().local.to_scipy("csr"))).tocsc()
        ref = spla.spsolve(A, np.concatenate(COMM.allgather(b.detach().numpy())))
        assert np.linalg.norm(u.numpy() - ref[r0:r1]) <= 1e-7 * np.linalg.norm(ref)


@pytest.mark.parametrize("estimator", ["gmres", "cg"])
def test_gamg_with_a_users_eigenvalue_estimator(estimator):
    """``mg_levels_esteig_ksp_type`` given by the user: a GMRES estimator gets none of the CG-only
    settings slasolve adds for its CG estimators (PETSc would reject the natural norm), and both
    solve to the tolerance (the true residual, checked here with SciPy's product)."""
    space = Assembler(box_mesh((16, 16), cell="triangle", comm=COMM))
    bc = DirichletBC(space, boundary_dofs(space), 0.0)
    K, b = bc.apply(space.stiffness(torch.exp(theta_of(space, 0.7))), space.load(1.0))
    u, info = slasolve.solve(K, b, "cg", pc="gamg", rtol=1e-9, return_info=True,
                             petsc_options={"mg_levels_esteig_ksp_type": estimator})
    assert info.converged
    r = b - K.detach() @ u
    rn = float(slasolve.global_sum((r ** 2).sum(), COMM)) ** 0.5
    bn = float(slasolve.global_sum((b ** 2).sum(), COMM)) ** 0.5
    assert rn <= 1e-9 * bn * 1.0001
