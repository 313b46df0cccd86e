"""``slasolve.testing.on_root`` and ``spsolve_reference`` at any rank count: the result is
rank 0's on every rank, a failure on rank 0 is raised on every rank (no rank left waiting),
and the reference solve equals SciPy's on the whole system. ``normal_by_id``: each rank's
share of the ids gets what one rank computes for all of them, and the numbers pass SciPy's
Kolmogorov-Smirnov test against the standard normal."""
import numpy as np
import pytest
import scipy.sparse.linalg as spla
import scipy.stats
import torch
from mpi4py import MPI

from slasolve.testing import distribute, normal_by_id, on_root, poisson_matrix, spsolve_reference

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


def test_normal_by_id_same_at_every_rank_count():
    n = 1000
    lo, hi = n * COMM.rank // COMM.size, n * (COMM.rank + 1) // COMM.size
    whole = on_root(COMM, lambda: normal_by_id(np.arange(n), seed=5, stream=1))
    mine = normal_by_id(torch.arange(lo, hi), seed=5, stream=1)
    assert mine.dtype == torch.float64 and mine.shape == (hi - lo,)
    assert torch.equal(mine, whole[lo:hi])
    assert normal_by_id(np.arange(6).reshape(2, 3)).shape == (2, 3)


def test_normal_by_id_is_standard_normal_and_streams_differ():
    x = normal_by_id(np.arange(200_000), seed=1234, stream=0).numpy()
    assert scipy.stats.kstest(x, "norm").pvalue > 1e-3
    y = normal_by_id(np.arange(200_000), seed=1234, stream=1).numpy()
    z = normal_by_id(np.arange(200_000), seed=1235, stream=0).numpy()
    assert abs(np.corrcoef(x, y)[0, 1]) < 0.02 and abs(np.corrcoef(x, z)[0, 1]) < 0.02


@pytest.mark.parametrize("ids", [np.array([1, -2]), np.array([0.5, 1.0])])
def test_normal_by_id_rejects_bad_ids(ids):
    with pytest.raises(ValueError, match="non-negative integers"):
        normal_by_id(ids)
