"""NeoHookean's no-autograd kernels on simplices (NumPy) against its torch (autograd) path.

Inside Newton's callbacks (no autograd graph) ``NeoHookean.residual`` / ``jacobian`` /
``energy`` on triangles and tetrahedra run on NumPy arrays. References: the torch path of the
same problem (the one recorded with autograd, and the same object with the NumPy path turned
off), which must agree to rounding; central differences of the residual (the tangent); the
gradient of the energy by autograd (the residual). Random deformations, per-cell Lamé
parameters with and without ``requires_grad``, a Dirichlet lifting with nonzero values, a body
force and a traction; ghost nodes and remote tangent entries at 2+ ranks. Run serially and
under mpirun -n 2 / 3 (marked ``mpi``).
"""
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI

from slasolve.fem import Assembler, DirichletBC, NeoHookean, boundary_dofs, box_mesh

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
EPS = 1e-12


def gmax(x) -> float:
    return COMM.allreduce(float(x.abs().max()) if x.numel() else 0.0, op=MPI.MAX)


def solid(cell: str, block_jacobian: bool = False):
    layers = max(4, COMM.Get_size())     # box_mesh needs a cell layer per rank
    mesh = box_mesh((4, layers) if cell == "triangle" else (2, 3, layers), cell=cell, comm=COMM)
    d = mesh.dim
    V = Assembler(mesh, d)
    bc = DirichletBC(V, boundary_dofs(V, lambda x: x[:, 0] < EPS),
                     lambda x: 0.05 * torch.stack([x[:, 1]] + [x[:, 0] + x[:, -1]] * (d - 1), 1))
    t = [0.1] + [0.0] * (d - 2) + [-0.2]
    P = NeoHookean(V, bc, mu=1.3, lmbda=2.5, body_force=[0.02] + [0.0] * (d - 2) + [-0.1],
                   traction=(t, lambda x: x[:, 0] > 1 - EPS), block_jacobian=block_jacobian)
    return V, P


def deformation(V, seed: int) -> torch.Tensor:
    """A smooth finite deformation plus random noise (owned dofs), no element inverted."""
    x = V.owned_coords()
    d = x.shape[1]
    smooth = torch.stack([0.2 * torch.sin(2 * x[:, 1]) * x[:, 0]] + [-0.15 * x[:, 0] ** 2] * (d - 1), 1)
    s = V.dof_range[0]
    g = torch.Generator().manual_seed(seed)
    noise = 0.01 * torch.randn(V.n_global_dofs, generator=g, dtype=torch.float64)[s:s + V.n_owned_dofs]
    return smooth.reshape(-1) + noise


def params(V, grad: bool):
    c = V.cell_coords.mean(1)
    mu = (1.0 + 0.5 * torch.sin(3 * c[:, 0]) * c[:, 1]).requires_grad_(grad)
    lmbda = (2.0 + c[:, -1]).requires_grad_(grad)
    return mu, lmbda


def torch_only(P):
    """The same problem object with the NumPy path turned off (every call takes the torch path)."""
    P._fast = lambda u, graph=True: False
    return P


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
@pytest.mark.parametrize("grad,block", [(False, False), (True, False), (False, True)])
def test_numpy_kernels_equal_torch_path(cell, grad, block):
    V, P = solid(cell, block)
    _, R = solid(cell, block)
    torch_only(R)
    u = deformation(V, 3)
    mu, lmbda = params(V, grad)
    for args in [(), (mu, lmbda)]:
        with torch.no_grad():
            r, K, e = P.residual(u, *args), P.jacobian(u, *args), P.energy(u, *args)
        r_ref, K_ref, e_ref = R.residual(u, *args), R.jacobian(u, *args), R.energy(u, *args)
        assert r_ref.requires_grad == e_ref.requires_grad == (grad and bool(args))
        assert not r.requires_grad and not e.requires_grad
        # the same operations, other summation orders (einsum vs bmm, bincount vs index_add):
        # a few eps of the entries' scale
        scale = gmax(r_ref.detach())
        assert scale > 0.1
        assert gmax(r - r_ref.detach()) <= 1e-13 * scale
        assert K.local.block_shape == K_ref.local.block_shape and K.values.shape == K_ref.values.shape
        assert torch.equal(K.local.indices, K_ref.local.indices)
        assert gmax(K.values - K_ref.values) <= 1e-13 * gmax(K_ref.values)
        assert abs(float(e) - float(e_ref.detach())) <= 1e-13 * abs(float(e_ref.detach()))
        # with a graph (grad mode on, parameters requiring grad) the torch path is taken
        r_graph = P.residual(u, *args)
        assert r_graph.requires_grad == (grad and bool(args))
        assert gmax(r_graph.detach() - r_ref.detach()) == 0.0


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
def test_numpy_tangent_matches_differences_and_residual_is_energy_gradient(cell):
    V, P = solid(cell)
    u = deformation(V, 7)
    mu, lmbda = params(V, False)
    s = V.dof_range[0]
    g = torch.Generator().manual_seed(11)
    v = torch.randn(V.n_global_dofs, generator=g, dtype=torch.float64)[s:s + V.n_owned_dofs]
    v[P.bc._local] = 0.0
    h = 1e-6
    with torch.no_grad():
        fd = (P.residual(u + h * v, mu, lmbda) - P.residual(u - h * v, mu, lmbda)) / (2 * h)
        Kv = P.jacobian(u, mu, lmbda) @ v
        # the energy's directional derivative along free directions is r . v
        de = (float(P.energy(u + h * v, mu, lmbda)) - float(P.energy(u - h * v, mu, lmbda))) / (2 * h)
        rv = COMM.allreduce(float(P.residual(u, mu, lmbda) @ v), op=MPI.SUM)
    assert gmax(fd - Kv) <= 1e-7 * gmax(Kv)
    assert abs(de - rv) <= 1e-7 * max(abs(rv), 1.0)


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
def test_numpy_path_inverted_elements_on_one_rank(cell):
    V, P = solid(cell)
    u = V.zeros()
    if COMM.rank == COMM.size - 1:
        x = V.owned_coords()
        u = torch.cat([-2.0 * x[:, :1], torch.zeros_like(x[:, 1:])], 1).reshape(-1)   # F_00 = -1
    with torch.no_grad():
        assert bool(torch.isnan(P.residual(u)).all())          # every rank: a line search backtracks
        assert math.isinf(float(P.energy(u)))
        with pytest.raises(ValueError, match="det F"):
            P.jacobian(u)
        P.on_inversion = "raise"
        with pytest.raises(ValueError, match="det F"):
            P.residual(u)
        with pytest.raises(ValueError, match="det F"):
            P.energy(u)


def test_numpy_path_vector_assembly_is_the_assemblers():
    """The NumPy assembly of vector cell values equals the Assembler's ``assemble_vector``."""
    V, P = solid("triangle")
    E, nv, d = V.mesh.n_local_cells, V.nv, V.bs
    g = np.random.default_rng(COMM.rank).standard_normal((E, nv, d))
    ref = V.assemble_vector(torch.from_numpy(g.reshape(E, nv * d)))
    out = P._np_assemble_cells(np.ascontiguousarray(g.transpose(1, 2, 0)))   # cell index last
    # sums of <= 8 cell values of size <= max|g| in another order
    assert np.abs(out - ref.numpy()).max(initial=0.0) <= 1e-14 * np.abs(g).max(initial=1.0)
