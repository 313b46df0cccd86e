"""The backward of ``solve`` reduces once before its adjoint solve (the saved-tensor check, the
same-system flag, the symmetry test and ``||g||`` on one Allreduce) and skips comparing the
values with the PETSc Mat when no solve changed that Mat since the forward. Every gradient is
checked against SciPy (``spsolve`` with ``A`` and ``A^T``), whatever happened between forward
and backward: another solve on the same layout with other values or the same ones, the Mat
changed behind slasolve's back on one rank only, the values changed through a NumPy view (the
adjoint uses the operator the forward solved with), an asymmetry between two ranks' rows under
CG. Runs at 1-4 ranks."""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch
from mpi4py import MPI

import slasolve
from slasolve.symmetry import exactly_symmetric, symmetric_from_sums, symmetry_sums
from slasolve.testing import distribute

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD


def spd(n=48, seed=0):
    rng = np.random.default_rng(seed)
    A = sp.diags([-1.0, 2.2, -1.0], [-1, 0, 1], shape=(n, n), format="lil")
    A[0, n - 1] = A[n - 1, 0] = -0.4               # couples the first and the last rank's rows
    D = sp.diags(rng.uniform(0.5, 2.0, n))
    return (D @ A.tocsr() @ D).tocsr()


def gathered(t):
    return np.concatenate(COMM.allgather(t.detach().numpy()))


def weights(n, r0, r1):
    return torch.from_numpy(np.cos(np.arange(r0, r1) * 0.7) + 1.5)


def reference(A, w):
    """x = A^{-1} 1, lam = A^{-T} w, dL/dA_ij = -lam_i x_j (L = w . x)."""
    x = ssl.spsolve(A.tocsc(), np.ones(A.shape[0]))
    lam = ssl.spsolve(A.T.tocsc(), w)
    return x, lam


def check_grads(dA, A, b, x, w):
    xs, lam = reference(A, w)
    assert np.allclose(gathered(x), xs, rtol=1e-9, atol=0)
    assert np.allclose(gathered(b.grad), lam, rtol=1e-9, atol=0)
    G = dA.local.with_values(dA.values.grad).to_scipy().tocoo()
    r0 = dA.row_range[0]
    assert np.allclose(G.data, -lam[G.row + r0] * xs[G.col], rtol=1e-8, atol=1e-12 * np.abs(lam).max())


def forward(A, method="cg", **kw):
    dA = distribute(A, COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
    x, info = slasolve.solve(dA, b, method, pc="jacobi", rtol=1e-12, return_info=True, **kw)
    r0, r1 = dA.row_range
    w = weights(A.shape[0], r0, r1)
    return dA, b, x, info, w


@pytest.mark.parametrize("method", ["cg", "gmres"])
def test_plain_backward(method):
    A = spd()
    dA, b, x, info, w = forward(A, method)
    slasolve.global_sum((x * w).sum()).backward()
    check_grads(dA, A, b, x, w.numpy() if COMM.size == 1 else np.concatenate(COMM.allgather(w.numpy())))
    assert info.adjoint.converged and not info.adjoint.same_as_forward


@pytest.mark.parametrize("same_values", [False, True])
def test_another_solve_between_forward_and_backward(same_values):
    """A solve on the same layout between forward and backward: with other values it refills
    the shared Mat (the adjoint must put the forward's values back), with the same values it
    does not (the adjoint may skip the comparison)."""
    A = spd()
    dA, b, x, info, w = forward(A)
    other = dA.values.detach() * (1.0 if same_values else 1.7)
    y = slasolve.solve(dA.with_values(other), torch.ones(dA.n_local, dtype=torch.float64), "gmres",
                       pc="jacobi", rtol=1e-12)
    scale = 1.0 if same_values else 1.7
    assert np.allclose(gathered(y), ssl.spsolve((scale * A).tocsc(), np.ones(A.shape[0])), rtol=1e-9)
    slasolve.global_sum((x * w).sum()).backward()
    check_grads(dA, A, b, x, np.concatenate(COMM.allgather(w.numpy())))


def test_mat_changed_behind_our_back_on_one_rank():
    """The PETSc Mat changed directly on the last rank only: that rank sees a new state, every
    rank then compares (one decision for all), and the adjoint refills the forward's values."""
    A = spd()
    dA, b, x, info, w = forward(A)
    from slasolve.petsc import cached_mat
    mat = cached_mat(dA, "aij")
    r0, r1 = mat.getOwnershipRange()
    if COMM.rank == COMM.size - 1 and r1 > r0:
        mat.setValue(r0, r0, 1e3)
    mat.assemble()
    slasolve.global_sum((x * w).sum()).backward()
    check_grads(dA, A, b, x, np.concatenate(COMM.allgather(w.numpy())))


def test_values_changed_through_a_view_keep_the_forward_operator():
    """Values changed through a NumPy view (no version bump, so no error) after the forward: the
    adjoint solves with the operator the forward solved with (the Mat was not touched), so the
    gradient is the forward computation's."""
    A = spd()
    dA, b, x, info, w = forward(A)
    dA.values.detach().numpy()[:] *= 3.0
    slasolve.global_sum((x * w).sum()).backward()
    dA.values.detach().numpy()[:] /= 3.0
    check_grads(dA, A, b, x, np.concatenate(COMM.allgather(w.numpy())))


def test_interface_asymmetry_under_cg():
    """One entry between the first and the last row made nonsymmetric: on several ranks only the
    interface hash sees it (on the backward's single reduction); CG converges on it and the
    adjoint must be A^{-T} g."""
    A = spd().tolil()
    n = A.shape[0]
    A[n - 1, 0] = A[n - 1, 0] * (1 + 1e-3)
    A = A.tocsr()
    dA = distribute(A, COMM)
    assert not exactly_symmetric(dA)
    s = symmetry_sums(dA)
    COMM.Allreduce(MPI.IN_PLACE, s, op=MPI.SUM)
    assert not symmetric_from_sums(s)
    dA, b, x, info, w = forward(A)
    slasolve.global_sum((x * w).sum()).backward()
    check_grads(dA, A, b, x, np.concatenate(COMM.allgather(w.numpy())))


def test_symmetry_sums_match_scipy():
    for A in (spd(), spd(seed=3)):
        dA = distribute(A, COMM)
        s = symmetry_sums(dA)
        COMM.Allreduce(MPI.IN_PLACE, s, op=MPI.SUM)
        assert symmetric_from_sums(s) == (abs(A - A.T).max() == 0) == exactly_symmetric(dA)


def test_compliance_shortcut_still_taken():
    A = spd()
    dA = distribute(A, COMM)
    dA.values.requires_grad_(True)
    b = torch.ones(dA.n_local, dtype=torch.float64)
    x, info = slasolve.solve(dA, b, "cg", pc="jacobi", rtol=1e-12, return_info=True)
    slasolve.global_sum((x * b).sum()).backward()
    assert info.adjoint.same_as_forward
    xs = ssl.spsolve(A.tocsc(), np.ones(A.shape[0]))
    G = dA.local.with_values(dA.values.grad).to_scipy().tocoo()
    r0 = dA.row_range[0]
    assert np.allclose(G.data, -xs[G.row + r0] * xs[G.col], rtol=1e-8, atol=1e-12 * np.abs(xs).max() ** 2)


def test_in_place_change_on_one_rank_still_raises_everywhere():
    A = spd()
    dA, b, x, info, w = forward(A)
    with torch.no_grad():
        if COMM.rank == COMM.size - 1:
            dA.values.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        slasolve.global_sum((x * w).sum()).backward()
