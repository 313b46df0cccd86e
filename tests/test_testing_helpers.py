"""``slasolve.testing.on_root`` and ``spsolve_reference`` at any rank count: the result is
rank 0's on every rank, a failure on rank 0 is raised on every rank (no rank left waiting),
and the reference solve equals SciPy's on the whole system."""
import numpy as np
import pytest
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

from slasolve.testing import distribute, on_root, poisson_matrix, spsolve_reference

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD


def test_on_root_broadcasts_rank0_result():
    assert on_root(COMM, lambda: ("rank", COMM.rank)) == ("rank", 0)


def test_on_root_failure_raised_on_every_rank():
    def fail():
        raise ValueError("reference broke")

    with pytest.raises((ValueError, AssertionError), match="reference broke"):
        on_root(COMM, fail)
    COMM.Barrier()   # every rank got here: nobody waits in the broadcast
    assert on_root(COMM, lambda: 7) == 7   # the communicator is usable afterwards


def test_spsolve_reference_equals_scipy():
    A = poisson_matrix((9, 9)).tocsr()
    b = np.sin(np.arange(A.shape[0]) + 1.0)
    dA = distribute(A, COMM)
    r0, r1 = dA.row_range
    x = spsolve_reference(dA, torch.from_numpy(b[r0:r1]), COMM)
    ref = spla.spsolve(A.tocsc(), b)[r0:r1]
    assert np.abs(x.numpy() - ref).max() <= 1e-12 * np.abs(ref).max()
