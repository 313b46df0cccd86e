"""The exact symmetry test on block (BSR) operators, checked on the block form (each block against
its mirror block transposed, the interface blocks' scalar entries hashed): the same answer as
SciPy's ``A - A.T`` on the assembled matrix, for symmetric matrices and for asymmetries inside a
diagonal block, in an off-diagonal block that is mirrored untransposed, and between blocks on
different ranks; block and scalar forms of one matrix agree."""
import numpy as np
import pytest
import scipy.sparse as sp

import slasolve
from slasolve.symmetry import exactly_symmetric, looks_symmetric

pytestmark = pytest.mark.mpi

CASES = ["symmetric", "diag_block", "untransposed", "far_block", "one_ulp_far", "structural_far", "bs3_symmetric",
         "bs3_untransposed"]


def _matrix(case: str) -> sp.bsr_matrix:
    n, bs = 12, 3 if case.startswith("bs3") else 2
    P = sp.random(n, n, density=0.25, random_state=3, format="lil")
    P[0, n - 1] = 1.0                                   # a block pair between the first and last block rows
    rng = np.random.default_rng(1)
    # blocks that are not symmetric themselves: A_IJ = C_IJ + C_JI^T, A_JI = A_IJ^T
    C = sp.kron(P.tocsr() != 0, np.ones((bs, bs))).multiply(rng.uniform(0.5, 1.5, (n * bs, n * bs)))
    A = (C + C.T + 5 * sp.identity(n * bs)).tolil()
    if case == "diag_block":
        A[1, 0] = A[1, 0] + 1.0                          # inside the first diagonal block
    elif case.endswith("untransposed"):
        B = rng.uniform(0.5, 1.5, (bs, bs))              # A_IJ = B, A_JI = B (not B^T)
        i, j = 0, (n - 1) * bs
        A[i:i + bs, j:j + bs] = B
        A[j:j + bs, i:i + bs] = B
    elif case == "far_block":
        A[(n - 1) * bs, 1] = A[(n - 1) * bs, 1] + 1.0
    elif case == "one_ulp_far":
        A[(n - 1) * bs + 1, 0] = np.nextafter(A[(n - 1) * bs + 1, 0], np.inf)
    elif case == "structural_far":
        A[0, (n - 1) * bs], A[(n - 1) * bs, 0] = 0.0, 0.0    # the block pair stays stored
        A[1, (n - 1) * bs] = 2.0
    return A.tocsr().tobsr((bs, bs))


@pytest.mark.parametrize("case", CASES)
def test_block_symmetry_matches_scipy(comm, case):
    A = _matrix(case)
    reference = abs(A.tocsr() - A.tocsr().T).max() == 0.0
    assert reference == case.endswith("symmetric")
    dA = slasolve.DSparseTensor.from_global(A, comm)
    assert dA.local.is_block
    assert exactly_symmetric(dA) == reference
    scalar = slasolve.DSparseTensor.from_global(A.tocsr(), comm)
    assert exactly_symmetric(scalar) == reference
    assert looks_symmetric(dA) == reference or not reference and case == "one_ulp_far"


@pytest.mark.parametrize("n", [3, 4])
def test_elasticity_operator_is_exactly_symmetric(comm, n):
    """3-D P1 elasticity (3x3 blocks that are not symmetric themselves, some mirrored on other
    ranks' rows) is exactly symmetric, by the block test as by the scalar form's; changing one
    off-diagonal scalar entry of one rank's rows makes it nonsymmetric on every rank."""
    import torch
    from slasolve.fem import Assembler, box_mesh
    mesh = box_mesh(n, cell="tetra", comm=comm)
    V = Assembler(mesh, 3)
    young = 0.5 + torch.rand(mesh.n_local_cells, dtype=torch.float64,
                             generator=torch.Generator().manual_seed(11 + comm.rank))
    K = V.elasticity(young, 0.3)
    assert K.local.is_block
    assert exactly_symmetric(K) and looks_symmetric(K)
    v = K.local.values.detach().clone()
    if comm.rank == comm.size - 1:
        v[0, 0, 1] += 1.0      # entry (0, 1) of this rank's first stored block
    assert not exactly_symmetric(K.with_values(v))
