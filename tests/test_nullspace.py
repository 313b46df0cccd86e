"""Near-nullspace for AMG (``solve(..., near_nullspace=Z)``) and ``slasolve.fem.rigid_body_modes``.

References: SciPy ``spsolve`` on the gathered matrix, the kernel of the unconstrained
elasticity stiffness (``A Z = 0``), raw PETSc's Mat state (no near-nullspace left behind),
iteration counts of a freshly created solver.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh, rigid_body_modes
from slasolve.petsc import _local_csr

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


def _gather_scipy(dA, comm):
    """The whole matrix as SciPy CSR on every rank (test sizes only): rows are gathered in
    rank order, which is the global dof order of an Assembler's layout."""
    ip, ix, v = _local_csr(dA, scalar=True)
    parts = comm.allgather((ip, ix, v))
    n = sum(p[0].shape[0] - 1 for p in parts)
    A = sp.vstack([sp.csr_matrix((p[2], p[1], p[0]), shape=(p[0].shape[0] - 1, n)) for p in parts])
    return A.tocsr()


def _gather(x, comm):
    return np.concatenate(comm.allgather(x.detach().numpy()))


def _layers(n, comm):
    """box_mesh splits the last axis over the ranks: at least one cell layer each."""
    return tuple(n[:-1]) + (max(n[-1], comm.Get_size()),)


def _elasticity(comm, cell, n=(12, 4, 4)):
    n = _layers(n, comm)
    mesh = box_mesh(n, upper=[3.0, 1.0, 1.0] if len(n) == 3 else [3.0, 1.0], cell=cell, comm=comm)
    V = Assembler(mesh, block_size=mesh.dim)
    K = V.elasticity(1.0, 0.3)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < 1e-9))
    d0, _ = V.dof_range
    g = torch.arange(d0, d0 + V.n_owned_dofs, dtype=torch.float64)
    b = torch.where(g % mesh.dim == mesh.dim - 1, -1.0, 0.1 * torch.sin(g))   # gravity + noise
    A, bb = bc.apply(K, b)
    return V, K, A, bb


def _fresh(A):
    A._layout.cache("solvers").clear()


@pytest.mark.parametrize("cell,n", [("quad", (8, 8)), ("triangle", (6, 7)), ("hexahedron", (6, 3, 3)),
                                    ("tetra", (4, 3, 3))])
def test_rigid_body_modes_span_the_kernel(comm, cell, n):
    mesh = box_mesh(_layers(n, comm), lower=[100.0] * len(n), upper=[103.0] * len(n), cell=cell, comm=comm)
    V = Assembler(mesh, block_size=mesh.dim)
    K = V.elasticity(2.0, 0.3)
    Z = rigid_body_modes(V)
    m = 3 if mesh.dim == 2 else 6
    assert Z.shape == (V.n_owned_dofs, m) and Z.dtype == V.dtype
    Kg = _gather_scipy(K, comm)
    Zg = _gather(Z, comm).reshape(-1, m)
    assert np.linalg.norm(Kg @ Zg) <= 1e-12 * sp.linalg.norm(Kg) * np.linalg.norm(Zg)
    assert np.linalg.matrix_rank(Zg) == m                      # independent, translations and rotations
    # a translation of x and a rotation about z as SciPy would write them
    x = _gather(V.owned_coords().reshape(-1), comm).reshape(-1, mesh.dim)
    t = np.zeros_like(x); t[:, 0] = 1.0
    r = np.zeros_like(x); r[:, 0], r[:, 1] = -x[:, 1], x[:, 0]
    for v in (t.reshape(-1), r.reshape(-1)):
        c = np.linalg.lstsq(Zg, v, rcond=None)[0]
        assert np.linalg.norm(Zg @ c - v) <= 1e-10 * np.linalg.norm(v)


def test_rigid_body_modes_needs_a_vector_space(comm):
    V = Assembler(box_mesh((4, 4), comm=comm, cell="quad"), block_size=1)
    with pytest.raises(ValueError, match="vector space"):
        rigid_body_modes(V)


@pytest.mark.parametrize("cell", ["hexahedron", "tetra"])
def test_gamg_iterations_cut_answer_unchanged_no_leak(comm, cell):
    V, K, A, b = _elasticity(comm, cell)
    Z = rigid_body_modes(V)
    _fresh(A)
    kw = dict(pc="gamg", rtol=1e-8, return_info=True)
    x0, i0 = slasolve.solve(A, b, "cg", **kw)
    x1, i1 = slasolve.solve(A, b, "cg", near_nullspace=Z, **kw)
    x2, i2 = slasolve.solve(A, b, "cg", **kw)                   # same cached KSP, without Z again
    assert i0.converged and i1.converged and i2.converged
    assert i1.iterations <= 0.7 * i0.iterations, (i0.iterations, i1.iterations)
    assert i2.iterations == i0.iterations                       # nothing of Z left in the PC
    assert not A.to_petsc(mat_type="aij").getNearNullSpace()    # nor on the cached Mat
    ref = spla.spsolve(_gather_scipy(A, comm).tocsc(), _gather(b, comm))
    for x in (x0, x1, x2):
        assert np.linalg.norm(_gather(x, comm) - ref) <= 1e-6 * np.linalg.norm(ref)
    # another solver created on this layout after a call with Z does not inherit it
    _fresh(A)
    _, i3 = slasolve.solve(A, b, "cg", near_nullspace=Z, **kw)
    _, i4 = slasolve.solve(A, b, "minres", **kw)
    _fresh(A)
    _, i5 = slasolve.solve(A, b, "minres", **kw)
    assert i3.iterations == i1.iterations and i4.iterations == i5.iterations


def test_changed_near_nullspace_is_used(comm):
    V, K, A, b = _elasticity(comm, "hexahedron")
    Z = rigid_body_modes(V)
    kw = dict(pc="gamg", rtol=1e-8, return_info=True)
    _fresh(A)
    _, full = slasolve.solve(A, b, "cg", near_nullspace=Z, **kw)
    _, part = slasolve.solve(A, b, "cg", near_nullspace=Z[:, :4].clone(), **kw)   # cached KSP, other Z
    Zs = Z.clone()
    Zs[:, 3] *= 2.0                                             # same span, other values: PC rebuilt
    _, again = slasolve.solve(A, b, "cg", near_nullspace=Zs, **kw)
    _fresh(A)
    _, part_fresh = slasolve.solve(A, b, "cg", near_nullspace=Z[:, :4].clone(), **kw)
    assert part.iterations == part_fresh.iterations and part.iterations > full.iterations
    assert again.iterations == full.iterations
    # new values with the same Z: GAMG rebuilt for the values, with Z
    A2 = A.with_values(A.values * 3.0)
    x, i2 = slasolve.solve(A2, b, "cg", near_nullspace=Z, **kw)
    assert i2.iterations == full.iterations


def test_gradient_with_near_nullspace(comm):
    V, K, A, b = _elasticity(comm, "hexahedron", n=(6, 3, 3))
    Z = rigid_body_modes(V)
    bq = b.clone().requires_grad_(True)
    x = slasolve.solve(A, bq, "cg", pc="gamg", rtol=1e-11, near_nullspace=Z)
    w = torch.cos(torch.arange(x.shape[0], dtype=torch.float64))
    (x * w).sum().backward()
    ref = spla.spsolve(_gather_scipy(A, comm).tocsc(), _gather(w, comm))   # A symmetric: A^-T w
    assert np.linalg.norm(_gather(bq.grad, comm) - ref) <= 1e-8 * np.linalg.norm(ref)


def test_bad_near_nullspace_raises_everywhere(comm):
    V, K, A, b = _elasticity(comm, "hexahedron", n=(6, 3, 3))
    Z = rigid_body_modes(V)
    last = comm.Get_rank() == comm.Get_size() - 1
    cases = [
        (Z[:-1] if last else Z, ValueError, "shape"),                       # wrong rows on one rank
        (Z.to(torch.complex128), TypeError, "real floating"),
        (torch.cat([Z, Z[:, :1]], 1), ValueError, "linearly dependent"),
        (torch.where(torch.tensor(last), Z * float("nan"), Z), ValueError, "NaN"),
        (torch.zeros_like(Z), ValueError, "zero"),
    ]
    if comm.Get_size() > 1:
        cases.append((Z[:, :5] if last else Z, ValueError, "near_nullspace columns"))  # m differs
    for bad, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            slasolve.solve(A, b, "cg", pc="gamg", near_nullspace=bad)
    x = slasolve.solve(A, b, "cg", pc="gamg", rtol=1e-8, near_nullspace=Z)   # still fine afterwards
    assert torch.isfinite(x).all()


def test_ignored_without_amg(comm):
    """jacobi, hypre and the torch backend ignore the hint: same iterations, same answer."""
    V, K, A, b = _elasticity(comm, "tetra", n=(4, 2, 2))
    Z = rigid_body_modes(V)
    for backend, pc in (("petsc", "jacobi"), ("petsc", "hypre"), ("torch", "jacobi")):
        x0, i0 = slasolve.solve(A, b, "cg", backend=backend, pc=pc, rtol=1e-9, return_info=True)
        x1, i1 = slasolve.solve(A, b, "cg", backend=backend, pc=pc, rtol=1e-9, return_info=True,
                                near_nullspace=Z)
        assert i0.iterations == i1.iterations and torch.allclose(x0, x1, rtol=1e-9, atol=1e-14)


def test_ml_uses_it_too(comm):
    """PETSc's ML reads the near-nullspace as GAMG does (pc_type through petsc_options).

    The count of a solve without Z right after one with Z is not compared: at 2 ranks ML
    then takes 21 iterations instead of 22 also in raw petsc4py (new KSP and PC, the Mat's
    near-nullspace cleared), so that is ML's own state, not slasolve's caches."""
    V, K, A, b = _elasticity(comm, "hexahedron")
    Z = rigid_body_modes(V)
    kw = dict(rtol=1e-8, return_info=True, petsc_options={"pc_type": "ml"})
    x0, i0 = slasolve.solve(A, b, "cg", **kw)
    x1, i1 = slasolve.solve(A, b, "cg", near_nullspace=Z, **kw)
    x2, i2 = slasolve.solve(A, b, "cg", **kw)
    assert i0.pc == "ml" and i1.iterations <= 0.7 * i0.iterations and i2.iterations > 1.5 * i1.iterations
    for x in (x1, x2):
        assert torch.allclose(x, x0, rtol=1e-5, atol=1e-6 * float(x0.abs().max()))


def test_unchanged_near_nullspace_keeps_the_preconditioner(comm, monkeypatch):
    """The same near-nullspace on every call of a loop (new values each time) never rebuilds the
    preconditioner from scratch; the backward's adjoint solve sets nothing up either."""
    from slasolve.krylov.petsc_backend import PetscKrylov
    fresh = []
    real = PetscKrylov._fresh_pc
    monkeypatch.setattr(PetscKrylov, "_fresh_pc", lambda self, ksp: (fresh.append(1), real(self, ksp))[1])
    V, K, A, b = _elasticity(comm, "tetra")
    Z = rigid_body_modes(V)
    _fresh(A)
    ref = None
    for k in range(3):
        v = (A.values.detach() * (1.0 + 0.1 * k)).requires_grad_(True)
        x, info = slasolve.solve(A.with_values(v), b, "cg", pc="gamg", rtol=1e-10, near_nullspace=Z,
                                 return_info=True)
        if k == 0:
            ref = info.iterations
            fresh.clear()
        assert info.converged and info.iterations <= ref + 2
        slasolve.global_sum(x.sum(), comm).backward()
        assert torch.isfinite(v.grad).all()
    assert not fresh, len(fresh)
