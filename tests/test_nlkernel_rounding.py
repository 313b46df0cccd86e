"""NeoHookean's deformation gradient ``F - I`` from the vertices' displacements relative to the
first (both the NumPy and the torch path): its rounding against a long double reference is that of
the differences, ``eps |u_a - u_0| |G_a|`` (summed as ``Σ u_a G_a`` it was ``eps |u_a| |G_a|``, which
set the floor of Newton's residual on large meshes). Run serially and under mpirun -n 2 / 3
(marked ``mpi``).
"""
import numpy as np
import pytest
import torch

from slasolve.fem import Assembler, NeoHookean, box_mesh

pytestmark = pytest.mark.mpi
F64 = torch.float64


@pytest.mark.skipif(np.finfo(np.longdouble).eps > 1e-18, reason="needs an extended long double")
@pytest.mark.parametrize("dim", [2, 3])
def test_deformation_gradient_rounding_is_that_of_the_differences(comm, dim):
    # displacements with a large common part (as far from a clamped end): F - I from the vertices'
    # differences has rounding errors of eps |u_a - u_0| |G_a|, against a long double reference;
    # summed as sum_a u_a G_a it had eps |u_a| |G_a| (here ~1e4 times more)
    n = max(4, comm.Get_size())
    sp = Assembler(box_mesh((30, n) if dim == 2 else (6, 5, n), cell="triangle" if dim == 2 else "tetra",
                            comm=comm), dim)
    P = NeoHookean(sp, mu=1.3, lmbda=2.1)
    x = sp.owned_coords()
    u = (3.1 + torch.stack([0.01 * torch.sin(3 * x[:, 1])] + [0.02 * x[:, 0] ** 2] * (dim - 1), 1)).reshape(-1)
    U = P._np_cell_values(u.numpy(), lifted=True).astype(np.longdouble)      # (nv, dim, E)
    G = P._np_data()[0].astype(np.longdouble)                                # (nv, dim, E)
    D = U[1:] - U[0]
    ref = np.einsum("aie,aJe->iJe", D, G[1:])
    bound = 4 * np.finfo(np.float64).eps * np.einsum("aie,aJe->iJe", np.abs(D), np.abs(G[1:])).astype(np.float64)
    with torch.no_grad():
        H = P._np_H(u.numpy())                                               # the NumPy path
    H_t = (P._F(u.clone().requires_grad_(True))[:, 0].detach() - torch.eye(dim, dtype=F64)).numpy()
    assert np.all(np.abs(H - ref).astype(np.float64) <= bound)
    assert np.all(np.abs(H_t.transpose(1, 2, 0) - ref).astype(np.float64) <= bound)
