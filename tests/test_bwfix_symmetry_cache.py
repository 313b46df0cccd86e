"""The backward of ``solve`` with CG / MINRES tests the symmetry of the operator it solved with; the
petsc backend computes this rank's symmetry sums once per state of the operator Mat (in the forward,
right after the solve wrote the values into it) instead of in every backward (issue 19). The cache
must never give a stale answer: every gradient below is checked against SciPy (``spsolve`` with
``A`` and ``A^T``) over sequences of forward/backward pairs whose values change between pairs
(symmetric, nonsymmetric between two ranks' rows, nonsymmetric inside one rank's rows, the same
values again), on both backends, for CG, MINRES and GMRES, and with the values changed through a
NumPy view between forward and backward (no version bump: the adjoint is the forward operator's).
Runs at 1-4 ranks."""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import distribute

pytestmark = pytest.mark.mpi
COMM = MPI.COMM_WORLD
N = 48


def spd(n=N):
    rng = np.random.default_rng(1)
    A = sp.diags([-1.0, 2.2, -1.0], [-1, 0, 1], shape=(n, n), format="lil")
    A[0, n - 1] = A[n - 1, 0] = -0.4               # couples the first and the last rank's rows
    D = sp.diags(rng.uniform(0.5, 2.0, n))
    return (D @ A.tocsr() @ D).tocsr()


def variant(kind):
    """The same pattern with other values: ``sym`` (the SPD matrix), ``scaled`` (1.5 x it),
    ``interface`` (the corner entry of the last row off by 1e-3: between the first and the last
    rank's rows), ``inner`` (an entry inside the rows of one rank off by 1e-3)."""
    A = spd().tolil()
    if kind == "scaled":
        A = A * 1.5
    elif kind == "interface":
        A[N - 1, 0] = A[N - 1, 0] * (1 + 1e-3)
    elif kind == "inner":
        A[5, 6] = A[5, 6] * (1 + 1e-3)
    return sp.csr_matrix(A)


def local_values(dA, A):
    """``A``'s values in ``dA``'s local order (same pattern, same rows)."""
    other = distribute(A, COMM)
    assert torch.equal(other.local.indices, dA.local.indices) and torch.equal(other.local.indptr, dA.local.indptr)
    return other.values.detach().clone()


def gathered(t):
    return np.concatenate(COMM.allgather(t.detach().numpy()))


def weights(dA):
    r0, r1 = dA.row_range
    return torch.from_numpy(np.cos(np.arange(r0, r1) * 0.7) + 1.5)


def check(dA, A, b, x):
    """x = A^{-1} 1, b.grad = A^{-T} w, dL/dA_ij = -lam_i x_j for L = w . x."""
    w = np.cos(np.arange(N) * 0.7) + 1.5
    xs = ssl.spsolve(A.tocsc(), np.ones(N))
    lam = ssl.spsolve(A.T.tocsc(), w)
    assert np.allclose(gathered(x), xs, rtol=1e-9, atol=0)
    assert np.allclose(gathered(b.grad), lam, rtol=1e-9, atol=0)
    G = dA.local.with_values(dA.values.grad).to_scipy().tocoo()
    r0 = dA.row_range[0]
    assert np.allclose(G.data, -lam[G.row + r0] * xs[G.col], rtol=1e-8, atol=1e-12 * np.abs(lam).max())


def pair(dA, method, backend):
    """One forward/backward pair on ``dA``'s current values; returns ``(b, x, info)``."""
    dA.values.grad = None
    b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
    x, info = slasolve.solve(dA, b, method, pc="jacobi", rtol=1e-12, backend=backend, return_info=True)
    slasolve.global_sum((x * weights(dA)).sum()).backward()
    return b, x, info


@pytest.mark.parametrize("backend", ["petsc", "torch"])
@pytest.mark.parametrize("method", ["cg", "minres", "gmres"])
def test_values_changing_between_pairs(method, backend):
    """Symmetric, nonsymmetric (interface, inner), symmetric again, the same values twice: each
    pair's adjoint is that pair's operator's (transposed where it is not symmetric)."""
    A0 = variant("sym")
    dA = distribute(A0, COMM)
    dA.values.requires_grad_(True)
    for kind in ("sym", "sym", "interface", "interface", "sym", "inner", "scaled", "inner", "sym"):
        A = variant(kind)
        with torch.no_grad():
            dA.values.copy_(local_values(dA, A))
        b, x, info = pair(dA, method, backend)
        check(dA, A, b, x)
        assert info.adjoint is not None and info.adjoint.converged


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_view_write_before_backward_keeps_the_forward_operator(method):
    """Symmetric values solved, then made nonsymmetric through a NumPy view before the backward:
    the adjoint is the forward operator's (the Mat the forward solved with; its symmetry as the
    forward saw it), not the new values'. The next forward sees the new values (compared with the
    Mat, written into it: a new Mat state), and its backward tests them afresh."""
    A_sym, A_ns = variant("sym"), variant("interface")
    dA = distribute(A_sym, COMM)
    dA.values.requires_grad_(True)
    ns = local_values(dA, A_ns)
    for _ in range(2):
        with torch.no_grad():
            dA.values.copy_(local_values(dA, A_sym))
        dA.values.grad = None
        b = torch.ones(dA.n_local, dtype=torch.float64, requires_grad=True)
        x = slasolve.solve(dA, b, method, pc="jacobi", rtol=1e-12)
        dA.values.detach().numpy()[:] = ns.numpy()          # no version bump: no error
        slasolve.global_sum((x * weights(dA)).sum()).backward()
        check(dA, A_sym, b, x)
        b, x, info = pair(dA, method, "petsc")                # the nonsymmetric values, now solved
        check(dA, A_ns, b, x)
        b, x, info = pair(dA, method, "petsc")                # again (the same Mat state)
        check(dA, A_ns, b, x)


def test_nonsymmetric_on_one_rank_only_between_pairs():
    """The inner defect lies in one rank's rows: only that rank's sums change, the decision is
    still everyone's (the sums ride on the backward's single reduction)."""
    dA = distribute(variant("sym"), COMM)
    dA.values.requires_grad_(True)
    for kind in ("sym", "inner", "sym", "inner"):
        A = variant(kind)
        with torch.no_grad():
            dA.values.copy_(local_values(dA, A))
        b, x, info = pair(dA, "cg", "petsc")
        check(dA, A, b, x)


def test_fresh_tensor_same_layout_other_values():
    """A tensor of the same layout with other values (``with_values``): its own forward compares
    and refills the shared Mat, so the sums are recomputed for it."""
    dA = distribute(variant("sym"), COMM)
    for kind in ("sym", "interface", "sym"):
        A = variant(kind)
        dB = dA.with_values(local_values(dA, A).requires_grad_(True))
        b, x, info = pair(dB, "cg", "petsc")
        check(dB, A, b, x)
