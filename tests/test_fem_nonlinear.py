"""Nonlinear FEM problems (slasolve.fem.nonlinear / hyperelastic) with slasolve.nonlinear_solve.

References: torch autograd Jacobians of the residual (serial, dense) and central finite
differences of the distributed residual (the consistent tangents); Assembler.elasticity
(small-strain limit of neo-Hookean); the gradient of the potential energy (the
hyperelastic residual); manufactured solutions whose source / body force and Neumann
data come from autograd of the exact fields (O(h^2) in L2); the serial (COMM_SELF)
solution (rank independence); central finite differences of a loss through the solve
(implicit-function-theorem gradients). Run serially and under mpirun -n 2 / 3 / 4.
"""
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.fem import (Assembler, DirichletBC, NeoHookean, NonlinearDiffusion, boundary_dofs, box_mesh,
                          l2_error)
from slasolve.fem.hyperelastic import neo_hookean_stress
from slasolve.fem.problems import convergence_rates, lame
from slasolve import nonlinear_solve
from slasolve.testing import local_slice

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
BACKENDS = ["petsc", "torch"]
EPS = 1e-12


def gather(x):
    return np.concatenate(COMM.allgather(x.detach().numpy()))


def gather_dense(A):
    import scipy.sparse as sp
    return sp.vstack(COMM.allgather(A.local.to_scipy("csr"))).toarray()


def allsum(t):
    return slasolve.global_sum(t, COMM)


# ------------------------------------------------------------------ problem set-ups
def diffusion(n=(4, 4), cell="triangle", comm=COMM, kappa=None):
    mesh = box_mesh(n, cell=cell, comm=comm)
    V = Assembler(mesh)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS), lambda x: 0.5 + x[:, 1])
    k = 1.0 if kappa is None else kappa(V.cell_coords.mean(1))
    P = NonlinearDiffusion(V, bc, kappa=k, source=lambda x: 4.0 + 2 * x[:, 0],
                           neumann=(lambda x: 1.0 + x[:, 1], lambda x: x[:, 0] > 1 - EPS))
    return V, P


def solid(n=(4, 4), cell="triangle", comm=COMM, load=0.05):
    mesh = box_mesh(n, cell=cell, comm=comm)
    d = mesh.dim
    V = Assembler(mesh, d)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS), 0.0)
    t = [0.0] * (d - 1) + [-load]
    mu = 1.0 + 0.5 * V.cell_coords.mean(1)[:, 0]
    P = NeoHookean(V, bc, mu=mu, lmbda=4.0, body_force=[0.02] + [0.0] * (d - 1),
                   traction=(t, lambda x: x[:, 0] > 1 - EPS))
    return V, P


def kappa_field(c):
    return 1.0 + 0.5 * torch.sin(3 * c[:, 0]) * c[:, 1]


LINEAR = {"diffusion": dict(method="gmres", pc="jacobi"), "solid": dict(method="cg", pc="jacobi")}


# ------------------------------------------------------------------ tangents
CELLS = [("triangle", (3, 4)), ("quad", (3, 4)), ("tetra", (2, 1, 4)), ("hexahedron", (1, 2, 4))]


@pytest.mark.parametrize("cell,n", CELLS)
def test_tangents_equal_autograd_jacobian_serial(cell, n):
    """Dense autograd Jacobian of the residual on one rank (every rank runs it)."""
    g = torch.Generator().manual_seed(1)
    V, P = diffusion(n, cell, MPI.COMM_SELF, kappa_field)
    u = torch.randn(V.n_owned_dofs, generator=g, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: P.residual(v), u).numpy()
    K = P.jacobian(u).local.to_scipy("csr").toarray()
    assert np.abs(K - J).max() <= 1e-12 * np.abs(J).max()
    assert np.abs(K - K.T).max() > 1e-3 * np.abs(K).max()          # genuinely non-symmetric
    W, H = solid(n, cell, MPI.COMM_SELF)
    u = 0.05 * torch.randn(W.n_owned_dofs, generator=g, dtype=torch.float64)
    J = torch.autograd.functional.jacobian(lambda v: H.residual(v), u).numpy()
    K = H.jacobian(u).local.to_scipy("csr").toarray()
    assert np.abs(K - J).max() <= 1e-12 * np.abs(J).max()
    assert np.abs(K - K.T).max() <= 1e-13 * np.abs(K).max()
    # the residual is the gradient of the potential energy on the free dofs
    uu = u.clone().requires_grad_(True)
    (ge,) = torch.autograd.grad(H.energy(uu), uu)
    free = ~H.bc.constrained
    r = H.residual(u)
    assert torch.allclose(ge[free], r[free], atol=1e-13 * float(r.abs().max()))


@pytest.mark.parametrize("problem", ["diffusion", "solid"])
def test_tangent_matches_finite_differences_distributed(problem):
    V, P = diffusion((4, 4), "quad", kappa=kappa_field) if problem == "diffusion" else solid((4, 4), "quad")
    s = V.dof_range[0]
    N = V.n_global_dofs
    g = torch.Generator().manual_seed(2)
    ug = 0.1 * torch.randn(N, generator=g, dtype=torch.float64)
    vg = torch.randn(N, generator=g, dtype=torch.float64)
    u, v = ug[s:s + V.n_owned_dofs], vg[s:s + V.n_owned_dofs]
    h = 1e-6
    fd = (P.residual(u + h * v) - P.residual(u - h * v)) / (2 * h)
    Kv = P.jacobian(u) @ v
    err = COMM.allreduce(float((fd - Kv).abs().max()), op=MPI.MAX)
    scale = COMM.allreduce(float(Kv.abs().max()), op=MPI.MAX)
    assert err <= 1e-7 * scale, (err, scale)


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
def test_no_graph_path_matches_autograd_path_and_differences_distributed(cell):
    """Simplices without an autograd graph (Newton's callbacks) evaluate on NumPy arrays: the
    residual equals the one recorded with autograd (to rounding), and the tangent matches
    central differences of it, with ghost nodes and remote entries at 2+ ranks."""
    layers = max(4, MPI.COMM_WORLD.Get_size())    # box_mesh needs a cell layer per rank
    V, P = diffusion((4, layers) if cell == "triangle" else (2, 2, layers), cell, kappa=kappa_field)
    s = V.dof_range[0]
    g = torch.Generator().manual_seed(5)
    ug = 0.3 * torch.randn(V.n_global_dofs, generator=g, dtype=torch.float64)
    vg = torch.randn(V.n_global_dofs, generator=g, dtype=torch.float64)
    u, v = ug[s:s + V.n_owned_dofs], vg[s:s + V.n_owned_dofs]
    kappa = kappa_field(V.cell_coords.mean(1)).requires_grad_(True)
    r_graph = P.residual(u, kappa)
    assert r_graph.requires_grad
    with torch.no_grad():
        r = P.residual(u, kappa)
        h = 1e-6
        fd = (P.residual(u + h * v, kappa) - P.residual(u - h * v, kappa)) / (2 * h)
    scale = COMM.allreduce(float(r.abs().max()), op=MPI.MAX)
    err = COMM.allreduce(float((r - r_graph.detach()).abs().max()), op=MPI.MAX)
    assert err <= 1e-13 * scale, (err, scale)
    Kv = P.jacobian(u, kappa) @ v
    err = COMM.allreduce(float((fd - Kv).abs().max()), op=MPI.MAX)
    scale = COMM.allreduce(float(Kv.abs().max()), op=MPI.MAX)
    assert err <= 1e-7 * scale, (err, scale)


@pytest.mark.parametrize("cell,n", [("triangle", (3, 4)), ("hexahedron", (2, 2, 4))])
def test_small_strain_limit_is_linear_elasticity(cell, n):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh, mesh.dim)
    young, nu = 2.0, 0.3
    lam, mu = lame(young, nu, "plane_strain" if mesh.dim == 2 else "3d")
    K0 = NeoHookean(V, None, mu, lam).jacobian(V.zeros())
    KL = V.elasticity(young, nu)
    assert np.abs(gather_dense(K0) - gather_dense(KL)).max() <= 1e-12 * young
    # and the block tangent is the same operator
    Kb = NeoHookean(V, None, mu, lam, block_jacobian=True).jacobian(V.zeros())
    x = torch.linspace(-1, 1, V.n_owned_dofs, dtype=torch.float64)
    # rows of K x cancel to ~0; two products (BSR / CSR kernels, other summation orders) of
    # rows with <= 81 entries differ by <= 2 gamma_81 (|K| |x|)_i < 2e-14 max(|K| |x|)
    ax = K0.with_values(K0.values.abs()) @ x.abs()
    scale = COMM.allreduce(float(ax.max()) if ax.numel() else 0.0, op=MPI.MAX)
    assert torch.allclose(Kb @ x, K0 @ x, atol=1e-13 * scale)


def test_inverted_elements_raise_on_every_rank():
    V, P = solid((2, 4))
    u = V.zeros()
    if COMM.rank == COMM.size - 1:
        x = V.owned_coords()
        u = torch.stack([-2.0 * x[:, 0], torch.zeros_like(x[:, 1])], 1).reshape(-1)   # F_00 = -1
    assert bool(torch.isnan(P.residual(u)).all())              # every rank: a line search backtracks
    assert math.isinf(float(P.energy(u)))
    with pytest.raises(ValueError, match="det F"):
        P.jacobian(u)
    P.on_inversion = "raise"
    with pytest.raises(ValueError, match="det F"):
        P.residual(u)


# ------------------------------------------------------------------ Newton
def quadratic_constants(hist):
    """``r_{k+1} / r_k^2`` (residuals relative to ``r_0``) over the terminal steps (``r_k < 0.05``)
    whose next residual is above the rounding floor (``1e-12``): bounded for quadratic
    convergence; for a linearly convergent iteration with rate ``q`` it is ``q / r_k``."""
    h = np.asarray(hist) / hist[0]
    return [h[k + 1] / h[k] ** 2 for k in range(len(h) - 1) if h[k] < 0.05 and h[k + 1] > 1e-12]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("problem", ["diffusion", "solid", "solid3d"])
def test_newton_converges_quadratically_and_rank_independent(problem, backend):
    make = {"diffusion": lambda comm: diffusion((6, 8), "triangle", comm, kappa_field),
            "solid": lambda comm: solid((6, 8), "triangle", comm, load=0.05),
            "solid3d": lambda comm: solid((2, 2, 4), "hexahedron", comm, load=0.05)}[problem]
    problem = problem.replace("3d", "")
    V, P = make(COMM)
    # Newton's rtol sits above the rounding floor of ||F(u)||: measured 3e-14 .. 7e-14 ||F(u0)|| for
    # these problems (steps at the floor then stall in the line search), so 1e-12 holds on any CPU
    rtol = 1e-12
    u, info = nonlinear_solve(P.residual, V.zeros(), jacobian=P.jacobian, backend=backend, rtol=rtol,
                              linear_solver=dict(LINEAR[problem], rtol=1e-13), return_info=True)
    assert info.converged and info.iterations <= 8, info.residual_history
    C = quadratic_constants(info.residual_history)
    assert len(C) >= 1 and max(C) <= 10.0, (C, info.residual_history)
    # the final residual of the returned u, evaluated here (the same vector; its norm summed in
    # another order), passes the test
    r = P.residual(u)
    assert math.sqrt(float(allsum((r * r).sum()))) <= rtol * (1 + 1e-10) * info.residual_history[0]
    # Dirichlet values hold exactly; the same discrete solution as on one rank: both residuals are
    # <= rtol ||F(u0)|| and ||J^-1||_inf ||F(u0)|| <= 14 max|u| here, so |u - us| <= 3e-11 max|u|
    assert torch.allclose(u[P.bc.constrained], P.bc.full()[P.bc.constrained], atol=1e-14)
    Vs, Ps = make(MPI.COMM_SELF)
    us = nonlinear_solve(Ps.residual, Vs.zeros(), jacobian=Ps.jacobian, backend=backend, rtol=rtol,
                         linear_solver=dict(LINEAR[problem], rtol=1e-13), comm=MPI.COMM_SELF)
    assert np.abs(gather(u) - us.numpy()).max() <= 1e-10 * np.abs(us.numpy()).max()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("problem", ["diffusion", "solid"])
def test_gradient_wrt_cell_coefficient_matches_finite_differences(problem, backend):
    V, P = diffusion((4, 4), "quad") if problem == "diffusion" else solid((4, 4), "quad", load=0.05)
    c0, c1 = V.cell_range
    nc = V.n_global_cells
    base = 1.0 + 0.3 * torch.cos(torch.arange(nc, dtype=torch.float64))
    w = V.interpolate(lambda x: torch.sin(2 * x[:, 0]) + x[:, 1] if V.bs == 1 else
                      torch.stack([x[:, 1]] + [torch.cos(x[:, 0])] * (V.bs - 1), 1))
    ls = dict(LINEAR[problem], rtol=1e-13)

    def loss(theta):
        # rtol=1e-13 is only ~4x above the rounding floor of ||F(u)|| (2e-14 ||F(u0)|| measured for the
        # solid): the step test stol accepts a Newton step stalled at that floor (||du|| <= 1e-12 ||u||,
        # u as accurate as the residual test would make it), on any CPU
        u = nonlinear_solve(P.residual, V.zeros(), local_slice(theta, c0, c1, COMM), jacobian=P.jacobian,
                            backend=backend, rtol=1e-13, stol=1e-12, linear_solver=ls)
        return allsum((w * u).sum() + 0.5 * (u * u).sum())

    theta = base.clone().requires_grad_(True)
    loss(theta).backward()
    direction = torch.sin(1.7 * torch.arange(nc, dtype=torch.float64))
    h = 1e-5
    with torch.no_grad():
        fd = (loss(base + h * direction) - loss(base - h * direction)) / (2 * h)
    ad = float(theta.grad @ direction)
    assert abs(ad - float(fd)) <= 1e-6 * max(abs(float(fd)), 1e-3), (ad, float(fd))
    assert abs(ad) > 1e-4


# ------------------------------------------------------------------ manufactured solutions
def u_diff(x):
    return torch.sin(1.3 * x[:, 0] + 0.4) * torch.cos(0.9 * x[:, 1])


def _flux_and_source(x):
    """(1+u²)∇u and -div((1+u²)∇u) of u_diff at points x, by autograd."""
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        u = u_diff(x)
        (gu,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        q = NonlinearDiffusion.flux(u, gu)
        div = sum(torch.autograd.grad(q[:, k].sum(), x, retain_graph=True)[0][:, k] for k in range(x.shape[1]))
    return q.detach(), -div.detach()


def diffusion_error(n, cell):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: (x[:, 0] < EPS) | (x[:, 1] < EPS)), u_diff)
    neumann = [(lambda x: _flux_and_source(x)[0][:, 0], lambda x: x[:, 0] > 1 - EPS),
               (lambda x: _flux_and_source(x)[0][:, 1], lambda x: x[:, 1] > 1 - EPS)]
    P = NonlinearDiffusion(V, bc, source=lambda x: _flux_and_source(x)[1], neumann=neumann)
    u = nonlinear_solve(P.residual, V.zeros(), jacobian=P.jacobian, rtol=1e-12, linear_solver=LINEAR["diffusion"])
    return l2_error(V, u, u_diff)


MU, LAM = 1.0, 3.0


def u_solid(x):
    return 0.1 * torch.stack([torch.sin(x[:, 0] + 0.5 * x[:, 1]), x[:, 0] * x[:, 1] + 0.5 * x[:, 0] ** 2], 1)


def _piola_and_body(x):
    x = x.detach().requires_grad_(True)
    with torch.enable_grad():
        u = u_solid(x)
        F = torch.stack([torch.autograd.grad(u[:, i].sum(), x, create_graph=True)[0] for i in range(2)], 1)
        F = F + torch.eye(2, dtype=x.dtype)
        mu = torch.full((x.shape[0],), MU, dtype=x.dtype)
        P = neo_hookean_stress(F, mu, LAM * torch.ones_like(mu))
        div = torch.stack([sum(torch.autograd.grad(P[:, i, J].sum(), x, retain_graph=True)[0][:, J]
                               for J in range(2)) for i in range(2)], 1)
    return P.detach(), -div.detach()


def solid_error(n, cell):
    mesh = box_mesh(n, cell=cell, comm=COMM)
    V = Assembler(mesh, 2)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: (x[:, 0] < EPS) | (x[:, 1] < EPS)), u_solid)
    traction = [(lambda x: _piola_and_body(x)[0][:, :, 0], lambda x: x[:, 0] > 1 - EPS),
                (lambda x: _piola_and_body(x)[0][:, :, 1], lambda x: x[:, 1] > 1 - EPS)]
    P = NeoHookean(V, bc, MU, LAM, body_force=lambda x: _piola_and_body(x)[1], traction=traction)
    # the tangent may be indefinite at early iterates: GMRES rather than CG
    u = nonlinear_solve(P.residual, V.zeros(), jacobian=P.jacobian, rtol=1e-12,
                        linear_solver=dict(method="gmres", pc="jacobi"))
    return l2_error(V, u, u_solid)


@pytest.mark.parametrize("problem", ["diffusion", "solid"])
@pytest.mark.parametrize("cell", ["triangle", "quad"])
def test_manufactured_with_neumann_converges_at_second_order(problem, cell):
    levels = (4, 8, 16)
    errs = [(diffusion_error if problem == "diffusion" else solid_error)(n, cell) for n in levels]
    rates = convergence_rates(errs, [1.0 / n for n in levels])
    assert rates[-1] >= 1.85 and rates[0] >= 1.6, (errs, rates)
    assert len({round(e, 13) for e in COMM.allgather(errs[-1])}) == 1


def test_kept_load_follows_the_data():
    """The source load kept between residual calls (plain numbers) is rebuilt when ``P.source``
    changes and never kept for a callable or a tensor: each residual equals a fresh problem's."""
    mesh = box_mesh((4, 4), cell="triangle", comm=COMM)
    V = Assembler(mesh)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS), 0.0)
    u = V.interpolate(lambda x: x[:, 0] * x[:, 1])
    flux = (1.0, lambda x: x[:, 0] > 1 - EPS)
    P = NonlinearDiffusion(V, bc, source=2.0, neumann=flux)
    for source in (2.0, 3.0, lambda x: 1 + x[:, 0], torch.tensor(1.5, dtype=torch.float64), 3.0, -1.0):
        P.source = source
        fresh = NonlinearDiffusion(V, bc, source=source, neumann=flux)
        for _ in range(2):
            torch.testing.assert_close(P.residual(u), fresh.residual(u), rtol=0, atol=0)


# ------------------------------------------------------------------ the fused assembly paths
@pytest.mark.parametrize("cell,bs", [("triangle", 1), ("quad", 1), ("triangle", 2), ("hexahedron", 3)])
@pytest.mark.parametrize("diagonal", [1.0, 2.5, "keep"])
def test_fused_assembly_equals_assembler_and_dirichlet_apply(cell, bs, diagonal):
    """The problems' own gather / scatter / elimination (one index_add over [owned | ghost] nodes,
    the elimination folded into the tangent's sums) give the Assembler's fetch_ghosts,
    assemble_vector, assemble_matrix + DirichletBC.apply values, with random element data,
    at any rank count (entries summed on other ranks included)."""
    n = {"triangle": (3, 5), "quad": (3, 5), "hexahedron": (2, 2, 4)}[cell]
    V = Assembler(box_mesh(n, cell=cell), bs)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS), 0.25, diagonal=diagonal)
    if bs == 1:
        P = NonlinearDiffusion(V, bc, source=3.0)
    else:
        P = NeoHookean(V, bc, body_force=[0.5] + [0.0] * (V.mesh.dim - 1))
    g = torch.Generator().manual_seed(5 + COMM.Get_rank())
    E, nv = V.mesh.n_local_cells, V.nv
    u = torch.randn(V.n_owned_dofs, generator=g, dtype=torch.float64)
    cells = P.cell_values(u)
    ref = V.fetch_ghosts(u).reshape(-1, bs)[V.local_cells]
    assert torch.equal(cells, ref)
    re = torch.randn(E, nv * bs, generator=g, dtype=torch.float64)
    want = torch.where(bc.constrained, u - bc.full(), V.assemble_vector(re) - P.external())
    torch.testing.assert_close(P._finish_residual(u, re), want, rtol=1e-15, atol=1e-15)
    Ke = torch.randn(E, nv * bs, nv * bs, generator=g, dtype=torch.float64)
    K, _ = bc.apply(V.assemble_matrix(Ke))
    if bs == 1:
        J = P._finish_jacobian(Ke)
        torch.testing.assert_close(J.values, K.values, rtol=1e-15, atol=1e-15)
        assert J._layout is K._layout
    else:
        Kb = Ke.reshape(E, nv, bs, nv, bs).permute(2, 4, 0, 1, 3).contiguous()
        J = P._finish_jacobian(Kb, blocked=True)
        T, perm = P._scalar_layout(K)
        torch.testing.assert_close(J.values, K.values.reshape(-1)[perm], rtol=1e-15, atol=1e-15)
        assert J._layout is T._layout
