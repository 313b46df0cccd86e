"""CG's variant per call on several ranks (``petsc_backend._SINGLE_REDUCTION_RTOL``): the
single-reduction variant for loose tolerances, the classic one for tight ones, switched on one
cached KSP between calls. Whatever the sequence (loose, tight, loose; one and several right-hand
sides; a forward and its adjoint), each answer passes its own stopping test against the true
residual and matches SciPy's direct solve; the iteration counts equal those of a solver whose
variant is fixed by ``petsc_options`` (the same arithmetic); and an explicit
``ksp_cg_single_reduction`` in the options is kept whatever the tolerance."""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch

import slasolve
from slasolve.testing import distribute

pytestmark = pytest.mark.mpi


def _poisson(n: int) -> sp.csr_matrix:
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n))
    c = np.linspace(1.0, 3.0, n * n)
    return (sp.kron(sp.identity(n), T) + sp.kron(T, sp.identity(n)) + sp.diags(1e-3 * c)).tocsr()


def _setup(comm, n=24):
    S = _poisson(n)
    A = distribute(S, comm)
    r0, r1 = A.row_range
    rng = np.random.default_rng(5)
    b_all = rng.uniform(-1.0, 1.0, (S.shape[0], 2))
    return S, A, b_all, r0, r1


def _check(S, A, x, b_all, r0, r1, rtol, col=0):
    xg = A.gather(x.contiguous(), root=None).numpy()
    b = b_all[:, col]
    assert np.linalg.norm(b - S @ xg) <= rtol * np.linalg.norm(b) * (1 + 1e-12)
    ref = ssl.spsolve(S.tocsc(), b)
    assert np.linalg.norm(xg - ref) <= 1e4 * rtol * np.linalg.norm(ref)


@pytest.mark.parametrize("pc", ["gamg", "jacobi"])
def test_loose_tight_loose_on_one_solver(comm, pc):
    S, A, b_all, r0, r1 = _setup(comm)
    b = torch.from_numpy(b_all[r0:r1, 0].copy())
    its = {}
    for rtol in (1e-8, 1e-12, 1e-6, 1e-12, 1e-8):
        x, info = slasolve.solve(A, b, "cg", pc=pc, rtol=rtol, return_info=True)
        assert info.converged
        _check(S, A, x, b_all, r0, r1, max(rtol, 1e-11), 0)
        its.setdefault(rtol, set()).add(info.iterations)
    assert all(len(v) == 1 for v in its.values()), its   # a switch leaves nothing behind
    # a solver whose variant the options fix: the same iterations where it is the variant chosen
    for rtol, flag in ((1e-8, "true" if comm.size > 1 else "false"), (1e-12, "false")):
        x, info = slasolve.solve(A, b, "cg", pc=pc, rtol=rtol, return_info=True,
                                 petsc_options={"ksp_cg_single_reduction": flag})
        assert {info.iterations} == its[rtol]


def test_explicit_option_is_kept(comm):
    """``ksp_cg_single_reduction true`` at a tight tolerance stays single reduction: a solver of
    its own (options are keyed), and its answer still passes the true-residual test."""
    S, A, b_all, r0, r1 = _setup(comm)
    b = torch.from_numpy(b_all[r0:r1, 0].copy())
    x, info = slasolve.solve(A, b, "cg", pc="gamg", rtol=1e-11, return_info=True,
                             petsc_options={"ksp_cg_single_reduction": "true"})
    assert info.converged
    _check(S, A, x, b_all, r0, r1, 1e-11, 0)


def test_several_rhs_and_adjoint(comm):
    """Two columns at a loose then a tight tolerance, and the backward of each (the adjoint on
    the same KSP): every column matches SciPy; the gradient of b is A^-1 1 (A symmetric)."""
    S, A, b_all, r0, r1 = _setup(comm)
    ones = np.ones(S.shape[0])
    lam_ref = ssl.spsolve(S.tocsc(), ones)
    for rtol in (1e-8, 1e-12):
        B = torch.from_numpy(b_all[r0:r1].copy()).requires_grad_(True)
        X, info = slasolve.solve(A, B, "cg", pc="gamg", rtol=rtol, return_info=True)
        assert info.converged
        for j in range(2):
            _check(S, A, X[:, j], b_all, r0, r1, max(rtol, 1e-11), j)
        slasolve.global_sum(X[:, 0].sum()).backward()
        lam = A.gather(B.grad[:, 0].contiguous(), root=None).numpy()
        assert np.linalg.norm(lam - lam_ref) <= 1e4 * max(rtol, 1e-11) * np.linalg.norm(lam_ref)
