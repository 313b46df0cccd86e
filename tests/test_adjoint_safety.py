"""Backward passes that used to return silently wrong gradients (issue 18):

* a tensor the backward needs (the matrix values, the solution, a parameter) changed
  in place between forward and backward -- on every rank or on one rank only -- raises
  ``RuntimeError`` on every rank (PyTorch's rule for saved tensors, made collective),
  for ``solve``, ``spsolve``, ``eigsh``, ``nonlinear_solve`` and products;
* CG/MINRES that converge on a slightly nonsymmetric matrix get the adjoint of the
  matrix they solved (``A^{-T} g``, checked against SciPy), not ``A^{-1} g``.

MPI tests run at 1-4 ranks (``mpirun -n N``), each run under a timeout by test.sh.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch
from mpi4py import MPI

import slasolve
from slasolve.eigen import eigsh
from slasolve.testing import distribute

COMM = MPI.COMM_WORLD
BACKENDS = ("petsc", "torch")


def lap(n=40, shift=0.3):
    return sp.diags([-1.0, 2.0 + shift, -1.0], [-1, 0, 1], shape=(n, n), format="csr")


def gathered(t):
    return np.concatenate(COMM.allgather(t.detach().numpy()))


def weights(dA):
    r0, r1 = dA.row_range
    return torch.arange(r0, r1, dtype=torch.float64) / 10.0 + 1.0


def mutate(t, everywhere):
    with torch.no_grad():
        if everywhere or COMM.rank == COMM.size - 1:
            t.mul_(2.0)


# ------------------------------------------------------------------ in-place changes
@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
@pytest.mark.parametrize("method", ["cg", "gmres"])
def test_solve_values_changed_before_backward_raise(method, everywhere):
    dA = distribute(lap(), COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64)
    x = slasolve.solve(dA, b, method, rtol=1e-10)
    mutate(dA.values, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        slasolve.global_sum((x * x).sum()).backward()


@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
def test_solve_solution_changed_before_backward_raises(everywhere):
    dA = distribute(lap(), COMM)
    b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
    dA.values.requires_grad_(True)
    x = slasolve.solve(dA, b, "cg", rtol=1e-10)
    y = x * 1.0
    mutate(x, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        slasolve.global_sum(y.sum()).backward()


@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
def test_spsolve_values_changed_before_backward_raise(everywhere):
    dA = distribute(lap(), COMM)
    dA.values.requires_grad_(True)
    x = slasolve.spsolve(dA, torch.ones(dA.n_local, dtype=torch.float64))
    mutate(dA.values, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        slasolve.global_sum((x * x).sum()).backward()


@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
def test_eigsh_values_changed_before_backward_raise(everywhere):
    dA = distribute(lap(30), COMM)
    dA.values.requires_grad_(True)
    w, V = eigsh(dA, 2, which="SA", tol=1e-10)
    mutate(dA.values, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        w.sum().backward()


@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
def test_product_values_changed_before_backward_raise(everywhere):
    dA = distribute(lap(), COMM)
    dA.values.requires_grad_(True)
    y = dA @ torch.ones(dA.n_local, dtype=torch.float64)
    mutate(dA.values, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        slasolve.global_sum((y * y).sum()).backward()


@pytest.mark.mpi
@pytest.mark.parametrize("everywhere", [True, False])
def test_nonlinear_parameter_changed_before_backward_raises(everywhere):
    """u + u^3 / 3 = p per row (no coupling: each rank's rows alone), p changed in place."""
    n_local = 5
    p = torch.linspace(0.5, 1.5, n_local, dtype=torch.float64).requires_grad_(True)
    q = p * 1.0

    def residual(u, q):
        return u + u ** 3 / 3 - q

    u = slasolve.nonlinear_solve(residual, torch.zeros(n_local, dtype=torch.float64), q, backend="torch",
                                 rtol=1e-12, comm=COMM)
    mutate(q, everywhere)
    with pytest.raises(RuntimeError, match="inplace"):
        slasolve.global_sum(u.sum()).backward()


@pytest.mark.mpi
def test_unchanged_operands_still_differentiate_after_a_raise():
    """The raise leaves nothing behind: a fresh forward/backward on the same tensor works
    and matches SciPy."""
    A = lap()
    dA = distribute(A, COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
    x = slasolve.solve(dA, b, "cg", rtol=1e-12)
    mutate(dA.values, True)
    with pytest.raises(RuntimeError):
        slasolve.global_sum((x * weights(dA)).sum()).backward()
    x = slasolve.solve(dA, b, "cg", rtol=1e-12)
    slasolve.global_sum((x * weights(dA)).sum()).backward()
    ref = ssl.spsolve((2.0 * A).T.tocsc(), np.arange(A.shape[0]) / 10.0 + 1.0)
    assert np.allclose(gathered(b.grad), ref, rtol=1e-9, atol=0)


# ------------------------------------------------------------ nonsymmetric under CG
def nearly_symmetric(n=60, defect=1e-3, one_sided_rows=(3, 17, 40)):
    """An SPD-ish tridiagonal matrix with a few entries made nonsymmetric by ``defect``
    (relative), as eliminating Dirichlet rows on one side only does."""
    A = sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], shape=(n, n), format="lil")
    for r in one_sided_rows:
        A[r, r + 1] = -1.0 * (1 + 10 * defect)
    return A.tocsr()


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["cg", "minres"])
@pytest.mark.parametrize("defect", [1e-3, 1e-2])
def test_symmetric_method_on_nonsymmetric_matrix_gets_the_transposed_adjoint(backend, method, defect):
    A = nearly_symmetric(defect=defect)
    dA = distribute(A, COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
    x, info = slasolve.solve(dA, b, method, rtol=1e-12, backend=backend, return_info=True)
    w = weights(dA)
    slasolve.global_sum((x * w).sum()).backward()
    wg = np.arange(A.shape[0]) / 10.0 + 1.0
    lam = ssl.spsolve(A.T.tocsc(), wg)
    xs = ssl.spsolve(A.tocsc(), np.ones(A.shape[0]))
    assert np.allclose(gathered(x), xs, rtol=1e-9, atol=0)
    assert np.allclose(gathered(b.grad), lam, rtol=1e-9, atol=0)
    # dL/dA_ij = -lam_i x_j on the stored entries (this rank's rows, global columns)
    G = dA.local.with_values(dA.values.grad).to_scipy().tocoo()
    r0 = dA.row_range[0]
    assert np.allclose(G.data, -lam[G.row + r0] * xs[G.col], rtol=1e-8, atol=1e-12 * np.abs(lam).max())
    assert info.adjoint is not None and info.adjoint.converged


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_symmetric_matrix_keeps_the_one_solve_shortcut(backend):
    """On a symmetric matrix the check says so: the compliance-type adjoint is still the
    forward's answer (no second solve)."""
    A = lap()
    dA = distribute(A, COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64)
    x, info = slasolve.solve(dA, b, "cg", rtol=1e-12, backend=backend, return_info=True)
    slasolve.global_sum((x * b).sum()).backward()
    if backend == "petsc":
        assert info.adjoint.same_as_forward
    xs = ssl.spsolve(A.tocsc(), np.ones(A.shape[0]))
    assert np.allclose(gathered(x), xs, rtol=1e-9)
    G = dA.local.with_values(dA.values.grad).to_scipy().tocoo()
    r0 = dA.row_range[0]
    assert np.allclose(G.data, -xs[G.row + r0] * xs[G.col], rtol=1e-8, atol=1e-12 * np.abs(xs).max() ** 2)


# ------------------------------------------------- ranks with nodes but no cells
@pytest.mark.mpi
def test_fan_mesh_ranks_without_cells(tmp_path_factory):
    """Every triangle shares the centre node: with partition="contiguous" the cells all go
    to rank 0 and the other ranks own nodes but no cells. Loads, matrices, a solve and its
    gradient match the one-rank run (load sums were wrong and the job hung before)."""
    meshio = pytest.importorskip("meshio")
    from slasolve.fem import Assembler, DirichletBC, boundary_dofs, read_mesh
    m = 12
    path = None
    if COMM.rank == 0:
        th = np.linspace(0, 2 * np.pi, m, endpoint=False)
        pts = np.vstack([[0.0, 0.0], np.c_[np.cos(th), (1.0 + 0.3 * np.cos(3 * th)) * np.sin(th)]])
        cells = np.array([[0, 1 + i, 1 + (i + 1) % m] for i in range(m)])
        path = str(tmp_path_factory.mktemp("fan") / "fan.vtu")
        meshio.write(path, meshio.Mesh(pts, [("triangle", cells)]))
    path = COMM.bcast(path)

    def run(comm):
        mesh = read_mesh(path, comm, partition="contiguous")
        V = Assembler(mesh)
        K = V.stiffness(1.0)
        M = V.mass(1.0)
        f1 = V.load(1.0)
        fx = V.load(lambda x: 1.0 + x[:, 0] ** 2)
        bc = DirichletBC(V, boundary_dofs(V), 0.0)
        A, b = bc.apply(K.with_values(K.values + 0.5 * M.values), fx)
        x = slasolve.solve(A, b, "cg", rtol=1e-12)
        ids = mesh.original_ids[mesh.owned_mask()] if mesh.original_ids is not None else None
        cnt = mesh.n_local_cells
        return [np.concatenate(comm.allgather(v.detach().numpy())) for v in (f1, fx, x)], \
            np.concatenate(comm.allgather(ids.numpy())), comm.allreduce(cnt)

    (f1, fx, x), ids, ncells = run(COMM)
    (s1, sx, xs), sids, _ = run(MPI.COMM_SELF)
    assert ncells == m
    o, so = np.argsort(ids), np.argsort(sids)
    for got, ref in ((f1, s1), (fx, sx), (x, xs)):
        assert np.allclose(got[o], ref[so], rtol=1e-10, atol=1e-13)
