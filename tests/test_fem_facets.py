"""Boundary facets and Neumann loads (slasolve.fem.facets).

References: analytic facet counts, lengths/areas and outward normals of boxes; exact
boundary integrals of polynomials (P1/Q1 reproduce linear functions, so
``sum_i b_i p(x_i) = ∫_Γ g p`` for linear ``g`` and ``p``); the serial (COMM_SELF) facet
set; manufactured solutions with Neumann data on part of the boundary converging at
O(h^2) in L2. Run serially and under mpirun -n 2 / 3 / 4 with --with-mpi.
"""
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import (Assembler, DirichletBC, boundary_dofs, boundary_facets, box_mesh, l2_error,
                          neumann_load)
from slasolve.fem.problems import convergence_rates

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD

# cell, n (cells per axis), facets per box face square
CASES = [("triangle", (3, 4), 1), ("quad", (5, 4), 1), ("tetra", (2, 2, 4), 2), ("hexahedron", (2, 3, 4), 1)]


def allsum(x):
    return COMM.allreduce(float(x))


def expected_count(n, per):
    if len(n) == 2:
        return 2 * (n[0] + n[1])
    nx, ny, nz = n
    return 2 * per * (nx * ny + ny * nz + nx * nz)


@pytest.mark.parametrize("cell,n,per", CASES)
def test_boundary_facets_count_measure_normals(cell, n, per):
    upper = (2.0, 1.0) if len(n) == 2 else (2.0, 1.0, 1.5)
    mesh = box_mesh(n, upper=upper, cell=cell, comm=COMM)
    f = boundary_facets(mesh)
    assert COMM.allreduce(f.n) == expected_count(n, per)
    total = allsum(f.measures().sum())
    surface = 2 * (upper[0] + upper[1]) if len(n) == 2 else \
        2 * (upper[0] * upper[1] + upper[1] * upper[2] + upper[0] * upper[2])
    assert abs(total - surface) < 1e-12 * surface
    # outward unit normals of a box: +-e_k on the face x_k = 0 / upper_k
    nr, c = f.normals(), f.centroids()
    assert torch.allclose(nr.norm(dim=1), torch.ones(f.n, dtype=nr.dtype))
    up = torch.tensor(upper, dtype=c.dtype)
    expect = torch.where(c.abs() < 1e-12, -1.0, 0.0) + torch.where((c - up).abs() < 1e-12, 1.0, 0.0)
    assert torch.allclose(nr, expect, atol=1e-12)
    # the same facets as on one rank (global node ids do not depend on the rank count)
    ref = boundary_facets(box_mesh(n, upper=upper, cell=cell, comm=MPI.COMM_SELF))
    mine = np.sort(f.nodes.numpy(), axis=1)
    allf = np.concatenate(COMM.allgather(np.sort(f.nodes.numpy(), axis=1)))
    rk = np.sort(ref.nodes.numpy(), axis=1)
    key = lambda a: set(map(tuple, a.tolist()))  # noqa: E731
    assert key(allf) == key(rk) and len(allf) == len(rk)
    assert key(mine) <= key(rk)
    # where: all vertices must satisfy the predicate
    x0 = boundary_facets(mesh, lambda x: x[:, 0] < 1e-12)
    assert COMM.allreduce(x0.n) == (n[1] if len(n) == 2 else per * n[1] * n[2])
    assert bool((x0.coords[..., 0].abs() < 1e-12).all())


@pytest.mark.parametrize("cell,n,per", CASES)
@pytest.mark.parametrize("bs", ["scalar", "vector"])
def test_neumann_load_integrates_linear_data_exactly(cell, n, per, bs):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    dim = mesh.dim
    V = Assembler(mesh, 1 if bs == "scalar" else dim)
    k = V.bs
    coeffs = torch.tensor([0.7, -1.3, 0.4][:dim], dtype=torch.float64)

    def g(x):                         # linear data; components differ for vector spaces
        s = 1.0 + x @ coeffs
        return s if k == 1 else torch.stack([(c + 1) * s for c in range(k)], 1)

    def p(x):                         # linear test polynomial
        return 0.5 - x[:, -1] + 2 * x[:, 0]

    # face x_0 = 1: ∫ g p over the unit face, computed with exact 1-D/2-D Gauss-Legendre
    b = neumann_load(V, g, where=lambda x: x[:, 0] > 1 - 1e-12)
    xo = V.owned_coords()
    lhs = allsum((b.reshape(-1, k) * p(xo)[:, None]).sum(0).sum()) if k > 1 else allsum((b * p(xo)).sum())
    t, w = np.polynomial.legendre.leggauss(3)
    t, w = (t + 1) / 2, w / 2
    grids = np.meshgrid(*([t] * (dim - 1)), indexing="ij")
    W = np.prod(np.meshgrid(*([w] * (dim - 1)), indexing="ij"), axis=0).reshape(-1)
    pts = np.stack([np.ones(W.size)] + [gr.reshape(-1) for gr in grids], 1)
    X = torch.from_numpy(pts)
    gv = g(X).reshape(W.size, k).sum(1)
    rhs = float((torch.from_numpy(W) * gv * p(X)).sum())
    assert abs(lhs - rhs) < 1e-12 * max(1.0, abs(rhs)), (lhs, rhs)
    # the same load from per-facet vertex values (interpolation of linear data is exact)
    f = boundary_facets(mesh, lambda x: x[:, 0] > 1 - 1e-12)
    gv = g(f.coords.reshape(-1, dim)).reshape(f.n, f.coords.shape[1], *(() if k == 1 else (k,)))
    b2 = neumann_load(V, gv, facets=f)
    assert torch.allclose(b, b2, atol=1e-14)
    assert torch.allclose(V.neumann(g, lambda x: x[:, 0] > 1 - 1e-12), b, atol=0)


def test_neumann_per_facet_tensor_gradient():
    """d(sum of the load)/d g_f = |f| for per-facet constant values (sum of shape functions = 1),
    through the reverse halo exchange."""
    mesh = box_mesh((3, 4), cell="triangle", comm=COMM)
    V = Assembler(mesh)
    f = boundary_facets(mesh)
    g = torch.linspace(0.5, 1.5, f.n, dtype=torch.float64).requires_grad_(True)
    b = neumann_load(V, g, facets=f)
    slasolve.global_sum(b.sum(), COMM).backward()
    assert torch.allclose(g.grad, f.measures(), rtol=1e-13, atol=0)
    # a constant given as a number, a (1,) tensor or per-facet values agree
    b1 = neumann_load(V, 2.0)
    b2 = neumann_load(V, torch.full((f.n,), 2.0, dtype=torch.float64), facets=f)
    assert torch.allclose(b1, b2, atol=1e-15)


def test_neumann_bad_input_raises_everywhere():
    mesh = box_mesh((2, 4), cell="quad", comm=COMM)
    V = Assembler(mesh)
    f = boundary_facets(mesh)
    bad = torch.ones(f.n + (1 if COMM.rank == COMM.size - 1 else 0), dtype=torch.float64)  # one rank wrong
    with pytest.raises(ValueError):
        neumann_load(V, bad, facets=f)
    with pytest.raises(ValueError):
        neumann_load(V, lambda x: torch.ones(3, dtype=torch.float64))
    with pytest.raises(ValueError):
        boundary_facets(mesh, lambda x: x[:, 0])           # not a bool tensor

    def g(x):                                             # a user error on one rank only
        if COMM.rank == COMM.size - 1:
            raise RuntimeError("boom")
        return torch.ones(x.shape[0], dtype=torch.float64)
    with pytest.raises(RuntimeError, match="boom"):
        neumann_load(V, g)


# ------------------------------------------------------------------ manufactured solutions
def _exact_poisson(x):
    return torch.sin(1.3 * x[:, 0] + 0.4) * torch.cos(0.9 * x[:, 1]) + (x[:, 2] if x.shape[1] == 3 else 0)


def _grad(fn, x):
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(fn(x).sum(), x)
    return g.detach()


def _laplacian(fn, x):
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        (g,) = torch.autograd.grad(fn(x).sum(), x, create_graph=True)
        lap = sum(torch.autograd.grad(g[:, k].sum(), x, retain_graph=True)[0][:, k] for k in range(x.shape[1]))
    return lap.detach()


def _poisson_neumann(n, cell):
    """-Δu = f; u = exact on the faces x_0 = 0 and x_1 = 0, ∂u/∂n = g on the others."""
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh)
    dim = mesh.dim
    dofs = boundary_dofs(V, lambda x: (x[:, 0] < 1e-12) | (x[:, 1] < 1e-12))
    bc = DirichletBC(V, dofs, _exact_poisson)
    A = V.stiffness(1.0)
    b = V.load(lambda x: -_laplacian(_exact_poisson, x))
    for k in range(dim):
        for side in (0, 1):
            if k < 2 and side == 0:
                continue
            nsign = 1.0 if side else -1.0
            b = b + V.neumann(lambda x, k=k, s=nsign: s * _grad(_exact_poisson, x)[:, k],
                              lambda x, k=k, side=side: (x[:, k] - side).abs() < 1e-12)
    A, b = bc.apply(A, b)
    u = slasolve.solve(A, b, "cg", pc="jacobi", rtol=1e-12, backend="torch")
    return l2_error(V, u, _exact_poisson)


@pytest.mark.parametrize("cell,levels", [("triangle", (4, 8, 16)), ("quad", (4, 8, 16)),
                                         ("tetra", (4, 8)), ("hexahedron", (4, 8))])
def test_poisson_neumann_converges_at_second_order(cell, levels):
    errs = [_poisson_neumann(n, cell) for n in levels]
    rates = convergence_rates(errs, [1.0 / n for n in levels])
    assert rates[-1] >= 1.85, (errs, rates)
    assert len({round(e, 13) for e in COMM.allgather(errs[-1])}) == 1
    assert math.isfinite(errs[-1])
