"""Distributed FEM assembly and Dirichlet elimination against SciPy references.

Run serially and under mpirun -n 2 / 4 with --with-mpi. The references are built on
every rank from a serial box mesh (``comm=MPI.COMM_SELF``: same global node and
cell numbering as the distributed one) with the element kernels and SciPy.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

from slasolve.fem import (Assembler, DirichletBC, apply_dirichlet, boundary_dofs, box_mesh,
                          elasticity_stiffness, load, mass, stiffness)
from slasolve.testing import local_slice, replicate

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD

CASES = [("triangle", (5, 6)), ("tetra", (2, 3, 4)), ("quad", (4, 5)), ("hexahedron", (2, 2, 4))]


def gather_matrix(A):
    """Global SciPy CSR of a row-sharded DSparseTensor, on every rank."""
    loc = A.local.to_scipy("csr")
    return sp.vstack(COMM.allgather(loc)).tocsr()


def gather_vec(x):
    return np.concatenate(COMM.allgather(x.detach().numpy()))


def reference_matrix(Ke, cells, n_nodes, bs):
    """Serial SciPy assembly of element matrices (E, nv*bs, nv*bs), dofs node*bs+comp."""
    Ke = Ke.detach().numpy()
    E, nv = cells.shape
    dofs = (cells[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(E, nv * bs)
    r = np.repeat(dofs, nv * bs, axis=1).reshape(-1)
    c = np.tile(dofs, (1, nv * bs)).reshape(-1)
    return sp.coo_matrix((Ke.reshape(-1), (r, c)), shape=(n_nodes * bs,) * 2).tocsr()


def reference_vector(be, cells, n_nodes, bs):
    be = be.detach().numpy().reshape(cells.shape[0], -1)
    dofs = (cells[:, :, None] * bs + np.arange(bs)[None, None, :]).reshape(cells.shape[0], -1)
    out = np.zeros(n_nodes * bs)
    np.add.at(out, dofs.reshape(-1), be.reshape(-1))
    return out


def serial_mesh(n, cell):
    return box_mesh(n, cell=cell, comm=MPI.COMM_SELF)


def coefficient(n_cells, seed=0):
    g = torch.Generator().manual_seed(seed)
    return 0.5 + torch.rand(n_cells, generator=g, dtype=torch.float64)


def assert_close_sparse(A, R, tol=1e-12):
    D = (A - R).tocsr()
    scale = max(abs(R).max(), 1.0)
    assert (abs(D).max() if D.nnz else 0.0) <= tol * scale


@pytest.mark.petsc  # checks the PETSc Mat the layout keeps (A.to_petsc())
@pytest.mark.parametrize("cell,n", CASES)
def test_scalar_stiffness_mass_load(cell, n):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    ref = serial_mesh(n, cell)
    V = Assembler(mesh)
    c0, c1 = V.cell_range
    assert torch.equal(mesh.cells, ref.cells[c0:c1])      # global cell order is rank-independent
    kappa = coefficient(ref.n_global_cells)
    X = ref.local_cell_coords()
    cells = ref.cells.numpy()
    # stiffness with per-element coefficients
    A = V.stiffness(kappa[c0:c1])
    R = reference_matrix(stiffness(X, kappa, cell), cells, ref.n_global_nodes, 1)
    G = gather_matrix(A)
    assert G.shape == R.shape
    assert_close_sparse(G, R)
    # same layout / PETSc Mat every time, refilled with the new values
    M = V.mass(2.0)
    assert M._layout is A._layout
    assert_close_sparse(gather_matrix(M), reference_matrix(mass(X, 2.0, cell), cells, ref.n_global_nodes, 1))
    mat1 = A.to_petsc()
    mat2 = M.to_petsc()
    assert mat1 is mat2
    d = mat2.getDiagonal().getArray()
    np.testing.assert_allclose(d, M.diagonal().numpy(), rtol=1e-14)
    # load from a callable, from owned nodal values and a constant
    f = lambda x: 1.0 + x[:, 0] * x[:, -1]  # noqa: E731
    fn_ref = f(ref.node_coords)[ref.local_cells()]
    bref = reference_vector(load(X, fn_ref, cell), cells, ref.n_global_nodes, 1)
    b1 = V.load(f)
    np.testing.assert_allclose(gather_vec(b1), bref, rtol=1e-12, atol=1e-15)
    b2 = V.load(V.interpolate(f))
    np.testing.assert_allclose(gather_vec(b2), bref, rtol=1e-12, atol=1e-15)
    b3 = V.load(1.0)
    assert abs(COMM.allreduce(float(b3.sum())) - 1.0) < 1e-12       # ∫ 1 over the unit box


@pytest.mark.petsc  # checks the PETSc Mat the layout keeps (A.to_petsc())
@pytest.mark.parametrize("cell,n", CASES)
def test_elasticity_block(cell, n):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    ref = serial_mesh(n, cell)
    dim = mesh.dim
    V = Assembler(mesh, dim)
    c0, c1 = V.cell_range
    young = coefficient(ref.n_global_cells, seed=1)
    nu = 0.2 + 0.1 * coefficient(ref.n_global_cells, seed=2)
    kind = "plane_strain" if dim == 2 else "3d"
    A = V.elasticity(young[c0:c1], nu[c0:c1], kind)
    assert A.block_shape == (dim, dim)
    X = ref.local_cell_coords()
    R = reference_matrix(elasticity_stiffness(X, young, nu, cell, kind), ref.cells.numpy(), ref.n_global_nodes, dim)
    assert_close_sparse(gather_matrix(A), R)
    # block mass = M (x) I
    Mref = reference_matrix(mass(X, 1.0, cell), ref.cells.numpy(), ref.n_global_nodes, 1)
    assert_close_sparse(gather_matrix(V.mass()), sp.kron(Mref, sp.eye(dim)).tocsr())
    # vector load
    f = lambda x: torch.stack([x[:, 0] + 1, *[x[:, -1] * k for k in range(1, dim)]], -1)  # noqa: E731
    fn = f(ref.node_coords)[ref.local_cells()]                     # (E, nv, dim)
    Me = mass(X, 1.0, cell)
    be = torch.einsum("eij,ejd->eid", Me, fn)
    np.testing.assert_allclose(gather_vec(V.load(f)), reference_vector(be, ref.cells.numpy(), ref.n_global_nodes,
                                                                        dim), rtol=1e-12, atol=1e-15)
    # PETSc BAIJ Mat refilled in place
    mat = A.to_petsc()
    assert mat.getBlockSize() == dim
    A2 = V.elasticity(2.0 * young[c0:c1], nu[c0:c1], kind)
    assert A2.to_petsc() is mat
    x = torch.ones(V.n_owned_dofs, dtype=torch.float64)
    np.testing.assert_allclose(COMM.allreduce(float((A2 @ x).abs().sum())),
                               2 * COMM.allreduce(float((A @ x).abs().sum())), rtol=1e-12)


def reference_dirichlet(R, b, D, g):
    """SciPy symmetric elimination: A_FF, b_F - A_FD g, I on D, b_D = g."""
    n = R.shape[0]
    free = np.ones(n, dtype=bool)
    free[D] = False
    gf = np.zeros(n)
    gf[D] = g
    bb = b - R @ gf
    bb[D] = g
    Pf = sp.diags(free.astype(float))
    A = (Pf @ R @ Pf + sp.diags((~free).astype(float))).tocsr()
    return A, bb


@pytest.mark.parametrize("cell,n,vector", [("triangle", (4, 5), False), ("tetra", (2, 2, 4), False),
                                            ("quad", (3, 4), True)])
def test_dirichlet_elimination(cell, n, vector):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh, mesh.dim if vector else 1)
    A = V.elasticity(1.0, 0.3) if vector else V.stiffness(1.0)
    b = V.load(1.0)
    # constrain the face x=0 (all components) and, for vectors, component 1 on x=1
    dofs = boundary_dofs(V, lambda x: x[:, 0] < 1e-12)
    if vector:
        dofs = torch.cat([dofs, boundary_dofs(V, lambda x: x[:, 0] > 1 - 1e-12, components=[1])])
    gfun = lambda x: (x[:, 1] + 2.0)[:, None] * torch.tensor([1.0, -0.5]) if vector else 1 + x[:, -1]  # noqa
    bc = DirichletBC(V, dofs, gfun)
    Abc, bbc = bc.apply(A, b)
    assert Abc._layout is A._layout
    R = gather_matrix(A)
    bg = gather_vec(b)
    D = np.concatenate(COMM.allgather(bc.dofs.numpy()))
    g = np.concatenate(COMM.allgather(bc.values.detach().numpy()))
    Aref, bref = reference_dirichlet(R, bg, D, g)
    G = gather_matrix(Abc)
    assert_close_sparse(G, Aref)
    # K_ij and K_ji are the same sum over <= 8 cells of <= 8-point quadrature sums, formed in
    # another product order (batched matmul): |K - K^T| <= ~2 * 8 * (8 + 3) eps max|K| < 4e-14 max|K|
    # on any BLAS (the elimination itself only copies and zeroes entries)
    assert abs(G - G.T).max() <= 1e-13 * abs(G).max()
    # b_F - A_FD g cancels (vector case): each entry's rounding is <= gamma_(nnz+1) * (|b| + |A| |g|)
    # (nnz <= 27 here) in both computations, so bound the difference by 1e-13 of that scale
    gfull = np.zeros(R.shape[0])
    gfull[D] = g
    scale = np.abs(bg) + abs(R) @ np.abs(gfull)
    got = gather_vec(bbc)
    assert np.all(np.abs(got - bref) <= 1e-12 * np.abs(bref) + 1e-13 * scale), np.abs(got - bref).max()
    # diagonal="keep": b_D = A_DD g, rows/cols still eliminated
    bck = DirichletBC(V, dofs, gfun, diagonal="keep")
    Ak, bk = bck.apply(A, b)
    Gk = gather_matrix(Ak)
    dD = R.diagonal()[D]
    np.testing.assert_allclose(Gk.diagonal()[D], dD, rtol=1e-14)
    np.testing.assert_allclose(gather_vec(bk)[D], dD * g, rtol=1e-12)
    # apply_dirichlet and the matrix-only form
    A3, none = apply_dirichlet(A, None, bc)
    assert none is None
    assert_close_sparse(gather_matrix(A3), Aref)


def _allsum(t):
    return replicate(t.reshape(1), COMM).sum()


def test_assembly_and_dirichlet_gradcheck():
    """x^T A_bc(kappa) x + c^T b_bc(g): gradients w.r.t. per-element kappa and the Dirichlet values."""
    mesh = box_mesh((2, 4), cell="triangle", comm=COMM)
    V = Assembler(mesh)
    c0, c1 = V.cell_range
    dofs = boundary_dofs(V, lambda x: x[:, 1] < 1e-12)
    bc = DirichletBC(V, dofs, 0.0)
    x = V.interpolate(lambda p: 1 + p[:, 0] + p[:, 1] ** 2)
    n_g = COMM.allgather(int(bc.dofs.numel()))
    g0 = int(np.sum(n_g[:COMM.rank]))

    def fn(kappa_g, g_g):
        A = V.stiffness(local_slice(kappa_g, c0, c1, COMM))
        b = V.load(1.0)
        Abc, bbc = bc.apply(A, b, values=local_slice(g_g, g0, g0 + n_g[COMM.rank], COMM))
        return _allsum((x * (Abc @ x)).sum() + (x * bbc).sum())

    kappa = coefficient(V.n_global_cells).requires_grad_()
    g = torch.linspace(0.5, 1.5, int(sum(n_g)), dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(fn, (kappa, g), eps=1e-6, atol=1e-7)


def test_vector_load_gradcheck():
    mesh = box_mesh((2, 4), cell="quad", comm=COMM)
    V = Assembler(mesh, 2)
    offs = COMM.allgather(V.n_owned_dofs)
    s = int(np.sum(offs[:COMM.rank]))
    w = V.interpolate(lambda p: torch.stack([p[:, 0], 1 - p[:, 1]], -1))

    def fn(f_g):
        b = V.load(local_slice(f_g, s, s + V.n_owned_dofs, COMM))
        return _allsum((w * b).sum())

    f = torch.linspace(-1, 1, V.n_global_dofs, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(fn, (f,), eps=1e-6, atol=1e-8)


@pytest.mark.mpi
@pytest.mark.parametrize("cell, bs", [("triangle", 1), ("quad", 2), ("tetra", 3), ("hexahedron", 1)])
def test_owned_nodal_load_equals_per_cell_load(cell, bs):
    """load(owned nodal values) takes a cached assembled-mass SpMV; load(per-cell vertex
    values) the per-cell kernel: the same vector, and on a second call (cache hit)."""
    dim = 3 if cell in ("tetra", "hexahedron") else 2
    mesh = box_mesh((2, 3, 4) if dim == 3 else (4, 5), cell=cell, comm=COMM)   # n[-1] >= ranks
    V = Assembler(mesh, bs)
    f = V.interpolate(lambda p: torch.stack([torch.sin(3 * p[:, 0]) + p[:, -1] * k for k in range(1, bs + 1)], -1)
                      .reshape(p.shape[0], bs).squeeze(-1))
    loc = V.fetch_ghosts(f).reshape(-1, bs)
    fe = loc[mesh.local_cells()]                     # (E, nv, bs) vertex values
    ref = V.load(fe if bs > 1 else fe[..., 0])
    for _ in range(2):
        got = V.load(f)
        assert torch.allclose(got, ref, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------- errors raise on every rank
def _last():
    return COMM.Get_rank() == COMM.Get_size() - 1


def test_bad_coefficients_raise_everywhere():
    mesh = box_mesh((3, 4), cell="triangle", comm=COMM)
    V = Assembler(mesh)
    E = mesh.n_local_cells
    kappa = torch.ones(E + (1 if _last() else 0))
    with pytest.raises(ValueError, match="kappa"):
        V.stiffness(kappa)
    kappa = torch.ones(E)
    if _last():
        kappa[0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        V.stiffness(kappa)
    with pytest.raises(ValueError):
        V.assemble_matrix(torch.zeros(E, 3, 3 + (1 if _last() else 0)))
    f = torch.ones(V.n_owned_dofs)
    if _last():
        f[-1] = float("inf")
    with pytest.raises(ValueError):
        V.load(f)
    with pytest.raises(ValueError, match="scalar space"):
        Assembler(mesh, 2).stiffness()
    with pytest.raises(ValueError, match="block_size"):
        Assembler(mesh, 3)


def test_inverted_element_raises_everywhere():
    mesh = box_mesh((3, 4), cell="triangle", comm=COMM)
    if _last():
        mesh.cells[0] = mesh.cells[0][[0, 2, 1]]           # clockwise
    V = Assembler(mesh)
    with pytest.raises(ValueError, match="non-positive Jacobian"):
        V.stiffness(1.0)


def test_bad_dirichlet_raise_everywhere():
    mesh = box_mesh((3, 4), cell="quad", comm=COMM)
    V = Assembler(mesh)
    d0, d1 = V.dof_range
    bad = torch.tensor([d1 if _last() else d0])            # the last rank passes a dof it does not own
    if _last():
        bad = torch.tensor([V.n_global_dofs + 5])
    with pytest.raises(ValueError, match="dofs must be owned"):
        DirichletBC(V, bad, 0.0)
    with pytest.raises(ValueError, match="NaN"):
        DirichletBC(V, torch.tensor([d0]), float("nan") if _last() else 0.0)
    with pytest.raises(ValueError, match="values must have shape"):
        DirichletBC(V, torch.tensor([d0, d0 + 1]), torch.zeros(2 + (1 if _last() else 0)))
    with pytest.raises(TypeError):
        DirichletBC(V, torch.tensor([0.5]) if _last() else torch.tensor([d0]), 0.0)
    other = Assembler(mesh)
    bc = DirichletBC(V, torch.tensor([d0]), 0.0)
    with pytest.raises(ValueError, match="same layout"):
        bc.apply(other.stiffness(), None)


@pytest.mark.parametrize("cell,n", CASES)
def test_elasticity_exactly_symmetric(cell, n):
    """K(E) is symmetric to the last bit for any per-cell Young's modulus (each owned row (i, j)
    equals the transposed entry, wherever it is owned): spsolve's exact test then picks Cholesky."""
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh, mesh.dim)
    young = 0.5 + torch.rand(mesh.n_local_cells, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(7 + COMM.rank))
    K = V.elasticity(young, 0.3).local.scalar()
    r0 = V.dof_range[0]
    rows = np.repeat(np.arange(K.indptr.numel() - 1) + r0, np.diff(K.indptr.numpy()))
    mine = sp.coo_matrix((K.values.numpy(), (rows, K.indices.numpy())), shape=(V.n_global_dofs,) * 2)
    A = sp.csr_matrix(sum(COMM.allgather(mine.tocsr())))
    assert abs(A - A.T).max() == 0.0


@pytest.mark.parametrize("cell,vector", [("triangle", False), ("quad", True)])
def test_homogeneous_dirichlet_skips_lifting_but_not_changes(cell, vector):
    """g = 0 on every rank: ``apply`` skips the lifting (no products) and gives the SciPy
    reference, with the gradient of b on the free dofs; a g made nonzero later (in place,
    through ``.data``, on one rank only) or requiring grad takes the lifting again."""
    mesh = box_mesh((4, 5), cell=cell, comm=COMM)
    V = Assembler(mesh, mesh.dim if vector else 1)
    A = V.elasticity(1.0, 0.3) if vector else V.stiffness(1.0)
    b = V.load(1.0).clone().requires_grad_(True)
    dofs = boundary_dofs(V, lambda x: x[:, 0] < 1e-12)
    bc = DirichletBC(V, dofs, torch.zeros(len(dofs), dtype=torch.float64))
    R, bg = gather_matrix(A), gather_vec(b)
    D = np.concatenate(COMM.allgather(bc.dofs.numpy()))

    def check(g):
        Abc, bbc = bc.apply(A, b)
        Aref, bref = reference_dirichlet(R, bg, D, g)
        assert_close_sparse(gather_matrix(Abc), Aref)
        gfull = np.zeros(R.shape[0])
        gfull[D] = g
        scale = np.abs(bg) + abs(R) @ np.abs(gfull)
        got = gather_vec(bbc)
        assert np.all(np.abs(got - bref) <= 1e-12 * np.abs(bref) + 1e-13 * scale)
        return bbc

    bbc = check(np.zeros(len(D)))
    (gb,) = torch.autograd.grad(bbc.sum(), b)
    assert torch.equal(gb, (~bc.constrained).to(gb.dtype))
    # a nonzero g on the last rank only (written through .data: no version bump)
    if COMM.rank == COMM.size - 1 and bc.values.numel():
        bc.values.data[:] = 2.5
    check(np.concatenate(COMM.allgather(bc.values.detach().numpy())))
    bc.values.data.zero_()
    bc.values.requires_grad_(True)
    _, bbc = bc.apply(A, b)
    (gg,) = torch.autograd.grad(bbc.sum(), bc.values, allow_unused=True)
    assert gg is not None
