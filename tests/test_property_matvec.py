"""Property-based differential tests of the distributed products against SciPy
(docs/testing.md): ``dA @ x`` and ``dA.T @ y`` for every matrix family (scalar and BSR,
with empty rows and diagonal-only rows), every partitioner and one or several columns,
after ``with_values`` too; ``scatter``/``gather`` round trips. Cheap, and the layer every
solver stands on (halo exchange, diagonal/off-diagonal split, renumbering)."""
import numpy as np
import pytest
import torch
from hypothesis import strategies as st

from slasolve.testing import MATRIX_KINDS, case_matrix, collective_property, distribute_or_none

pytestmark = [pytest.mark.mpi, pytest.mark.property]

PARTITIONS = ("contiguous", "metis", "rcb", "hilbert", "random")


@st.composite
def matvec_cases(draw):
    return {"kind": draw(st.sampled_from(sorted(MATRIX_KINDS))), "n": draw(st.integers(8, 60)),
            "seed": draw(st.integers(0, 2 ** 16)), "partition": draw(st.sampled_from(PARTITIONS)),
            "cols": draw(st.sampled_from((0, 1, 3))), "revalue": draw(st.booleans())}


def _check_matvec(comm, ex):
    A, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return  # the partitioner left a rank without rows (raised on every rank)
    rng = np.random.default_rng(ex["seed"])
    if ex["revalue"]:  # new values on the same pattern: 2 A + (pattern of A) scaled
        dA = dA.with_values(2.0 * dA.values + 0.5)
        A = A.copy()
        A.data = 2.0 * A.data + 0.5
    n = A.shape[0]
    shape = (n,) if ex["cols"] == 0 else (n, ex["cols"])
    xg = rng.standard_normal(shape)
    x = dA.scatter(torch.from_numpy(xg), root=None)
    assert np.array_equal(dA.gather(x, root=None).numpy(), xg), "gather(scatter(x)) != x"
    y = dA.gather(dA @ x, root=None).numpy()
    ref = A @ xg
    assert np.allclose(y, ref, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(ref).max())), \
        f"A @ x differs from SciPy by {np.abs(y - ref).max():.3e}"
    z = dA.gather(dA.T @ x, root=None).numpy()
    ref = A.T @ xg
    assert np.allclose(z, ref, rtol=1e-12, atol=1e-12 * max(1.0, np.abs(ref).max())), \
        f"A.T @ x differs from SciPy by {np.abs(z - ref).max():.3e}"


def test_matvec_matches_scipy(comm):
    collective_property(comm, matvec_cases(), lambda ex: _check_matvec(comm, ex),
                        name="matvec", examples=25, full_examples=500)
