"""The interface hash of the exact symmetry test, computed in place on its own array: the
SplitMix64 finaliser against a Python-integer reference, and :func:`exactly_symmetric` against
SciPy's ``A - A.T`` for interface asymmetries of one ulp, with overflow warnings as errors (the
uint64 arithmetic wraps by design and must stay array arithmetic, which never warns)."""
import warnings

import numpy as np
import pytest
import scipy.sparse as sp

import slasolve
from slasolve.symmetry import _mix64, _mix64_inplace, exactly_symmetric

pytestmark = pytest.mark.mpi

_MASK = (1 << 64) - 1


def _splitmix_finaliser(v: int) -> int:
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _MASK
    return v ^ (v >> 31)


def test_mix64_inplace_matches_python_integers():
    rng = np.random.default_rng(5)
    x = rng.integers(0, 2 ** 63, size=(4, 257), dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    x[0, :3] = [0, _MASK, 1 << 63]
    ref = np.array([[_splitmix_finaliser(int(v)) for v in row] for row in x], dtype=np.uint64)
    y = x.copy()
    out = _mix64_inplace(y)
    assert out is y
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(_mix64(x), ref)


def _matrix(case: str, n: int = 40) -> sp.csr_matrix:
    P = sp.random(n, n, density=0.15, random_state=7, format="lil")
    P[0, n - 1] = 1.0                     # an entry pair between the first and the last rows
    A = (P + P.T + 4 * sp.identity(n)).tolil()
    if case == "one_ulp_far":
        A[n - 1, 0] = np.nextafter(A[n - 1, 0], np.inf)
    elif case == "swapped_far":            # the same multiset of values, on mirrored positions
        A[0, n - 1], A[n - 1, 0] = 2.0, 2.0
        A[1, n - 2], A[n - 2, 1] = 3.0, 3.0
        A[0, n - 2], A[n - 2, 0] = 2.0, 3.0
        A[1, n - 1], A[n - 1, 1] = 3.0, 2.0
    elif case == "huge_values":           # bit patterns with the high bits set
        A[0, n - 1] = A[n - 1, 0] = -1e300
    return A.tocsr()


@pytest.mark.parametrize("case", ["symmetric", "one_ulp_far", "swapped_far", "huge_values"])
def test_exactly_symmetric_matches_scipy_without_warnings(comm, case):
    A = _matrix(case)
    reference = abs(A - A.T).max() == 0.0
    dA = slasolve.DSparseTensor.from_global(A, comm)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert exactly_symmetric(dA) == reference
    assert reference == (case in ("symmetric", "huge_values"))
