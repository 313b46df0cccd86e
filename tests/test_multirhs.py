"""Several right-hand sides in one ``solve(A, B)`` call (``B`` of shape ``(n_local, k)``).

The petsc backend solves all columns in one call (shared set-up, vectorised true-residual
check); everything must hold per column as for k single solves: answers (SciPy
``spsolve``), iteration counts (the same KSP solving one column at a time), tolerances
per column, ``x0`` per column, zero columns, failures, history / callback, and the
adjoint (SciPy's transposed solve).
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve import ConvergenceError, DSparseTensor

pytestmark = pytest.mark.mpi


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


def poisson2d(n):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    return (sp.kron(I, D) + sp.kron(D, I)).tocsr()


def convdiff(n, c=0.4):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    Cv = sp.diags([-c, c], [-1, 0], (n, n))
    return (sp.kron(I, D + Cv) + sp.kron(D + Cv, I)).tocsr()


def _scatter(dA, Bg):
    return torch.stack([dA.scatter(Bg[:, j].contiguous(), root=None) for j in range(Bg.shape[1])], 1)


def _gather(dA, X):
    return np.stack([dA.gather(X[:, j].contiguous(), root=None).numpy() for j in range(X.shape[1])], 1)


def _rhs(n, k, seed=0):
    B = torch.from_numpy(np.random.default_rng(seed).standard_normal((n, k)))
    B[:, 1] *= 1e-8           # per-column tolerances: tiny and huge columns
    B[:, 2] = 0.0             # a zero column
    B[:, 3] *= 1e8
    return B


CASES = [("cg", "gamg", poisson2d(16), "metis"), ("cg", "hypre", poisson2d(16), "contiguous"),
         ("minres", "jacobi", poisson2d(14), "contiguous"), ("gmres", "ilu", convdiff(15), "metis"),
         ("bicgstab", "jacobi", convdiff(15), "contiguous"), ("gmres", "hypre", convdiff(15), "contiguous")]


@pytest.mark.parametrize("method,pc,A,partition", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_columns_match_scipy_and_single_solves(comm, method, pc, A, partition):
    dA = DSparseTensor.from_global(A, comm, partition=partition)
    Bg = _rhs(A.shape[0], 6)
    B = _scatter(dA, Bg)
    rtol = 1e-9
    X, info = slasolve.solve(dA, B, method, pc=pc, rtol=rtol, return_info=True)
    assert info.converged and len(info.per_rhs) == 6
    Xg = _gather(dA, X)
    ref = spla.spsolve(sp.csc_matrix(A), Bg.numpy())
    for j in range(6):
        bj = np.linalg.norm(Bg[:, j].numpy())
        r = np.linalg.norm(Bg[:, j].numpy() - A @ Xg[:, j])
        assert r <= 1.05 * rtol * bj, (j, r, bj)                         # each column's own tolerance
        assert np.linalg.norm(Xg[:, j] - ref[:, j]) <= 1e-6 * max(np.linalg.norm(ref[:, j]), 1e-300)
        # the true residual, up to the rounding of b - A x in another summation order
        assert info.per_rhs[j].residual_norm == pytest.approx(r, rel=1e-6, abs=1e-12 * bj + 1e-300)
    assert np.all(Xg[:, 2] == 0) and info.per_rhs[2].iterations == 0
    assert info.per_rhs[2].reason == "CONVERGED_ATOL"
    for j in (0, 4):  # one column at a time through the same cached KSP: same iterations
        _, i1 = slasolve.solve(dA, B[:, j].contiguous(), method, pc=pc, rtol=rtol, return_info=True)
        assert i1.iterations == info.per_rhs[j].iterations and i1.reason == info.per_rhs[j].reason
    assert info.iterations == max(i.iterations for i in info.per_rhs)


@pytest.mark.parametrize("method,pc", [("cg", "jacobi"), ("bicgstab", "ilu"), ("gmres", "jacobi")])
def test_x0_per_column_and_zero_columns(comm, method, pc):
    A = poisson2d(12) if method == "cg" else convdiff(12)
    dA = DSparseTensor.from_global(A, comm)
    n = A.shape[0]
    Bg = torch.from_numpy(np.random.default_rng(1).standard_normal((n, 4)))
    Bg[:, 3] = 0.0
    exact = spla.spsolve(sp.csc_matrix(A), Bg.numpy())
    X0g = torch.from_numpy(np.random.default_rng(2).standard_normal((n, 4)))
    X0g[:, 1] = torch.from_numpy(exact[:, 1])                    # column 1 starts at the answer
    B, X0 = _scatter(dA, Bg), _scatter(dA, X0g)
    X, info = slasolve.solve(dA, B, method, pc=pc, rtol=1e-8, x0=X0, return_info=True)
    Xg = _gather(dA, X)
    assert info.per_rhs[1].iterations == 0 and info.per_rhs[1].converged
    assert np.all(Xg[:, 3] == 0) and info.per_rhs[3].iterations == 0       # b = 0: zeros whatever x0
    for j in (0, 2):
        x1, i1 = slasolve.solve(dA, B[:, j].contiguous(), method, pc=pc, rtol=1e-8,
                                x0=X0[:, j].contiguous(), return_info=True)
        assert i1.iterations == info.per_rhs[j].iterations
        assert np.allclose(dA.gather(x1, root=None).numpy(), Xg[:, j], rtol=0, atol=1e-12)
        assert np.linalg.norm(Xg[:, j] - exact[:, j]) <= 1e-6 * np.linalg.norm(exact[:, j])


def test_failures_per_column(comm):
    A = poisson2d(16)
    dA = DSparseTensor.from_global(A, comm)
    Bg = torch.from_numpy(np.random.default_rng(3).standard_normal((A.shape[0], 3)))
    exact = spla.spsolve(sp.csc_matrix(A), Bg.numpy())
    X0g = torch.zeros_like(Bg)
    X0g[:, 0] = torch.from_numpy(exact[:, 0])                    # only column 0 can converge in 3 its
    B, X0 = _scatter(dA, Bg), _scatter(dA, X0g)
    X, info = slasolve.solve(dA, B, "cg", pc="jacobi", rtol=1e-8, maxiter=3, x0=X0, return_info=True,
                             raise_on_fail=False)
    assert [i.converged for i in info.per_rhs] == [True, False, False] and not info.converged
    assert [i.reason for i in info.per_rhs[1:]] == ["DIVERGED_ITS"] * 2
    assert [i.iterations for i in info.per_rhs] == [0, 3, 3]
    with pytest.raises(ConvergenceError):
        slasolve.solve(dA, B, "cg", pc="jacobi", rtol=1e-8, maxiter=3, x0=X0)
    # maxiter=0 (the column-loop fallback): only the initial guesses are tested
    X, info = slasolve.solve(dA, B, "cg", pc="jacobi", rtol=1e-8, maxiter=0, x0=X0, return_info=True,
                             raise_on_fail=False)
    assert [i.converged for i in info.per_rhs] == [True, False, False]
    assert torch.equal(X, X0)


def test_true_residual_checked_per_column(comm):
    """MINRES with a preconditioner: PETSc tests the preconditioned norm; every column must
    still meet its true-residual tolerance (the per-column continuation), as single solves do."""
    rng = np.random.default_rng(4)
    A = poisson2d(14)
    d = sp.diags(10.0 ** rng.uniform(-3, 3, A.shape[0]))
    A = (d @ A @ d).tocsr()                                        # badly scaled: norms differ a lot
    dA = DSparseTensor.from_global(A, comm)
    Bg = torch.from_numpy(rng.standard_normal((A.shape[0], 3)))
    B = _scatter(dA, Bg)
    X, info = slasolve.solve(dA, B, "minres", pc="jacobi", rtol=1e-7, return_info=True, raise_on_fail=False)
    Xg = _gather(dA, X)
    for j in range(3):
        _, i1 = slasolve.solve(dA, B[:, j].contiguous(), "minres", pc="jacobi", rtol=1e-7, return_info=True,
                               raise_on_fail=False)
        assert (i1.converged, i1.iterations, i1.reason) == \
            (info.per_rhs[j].converged, info.per_rhs[j].iterations, info.per_rhs[j].reason)
        if info.per_rhs[j].converged:
            r = np.linalg.norm(Bg[:, j].numpy() - A @ Xg[:, j])
            assert r <= 1.05e-7 * np.linalg.norm(Bg[:, j].numpy())


def test_history_callback_callable_pc_and_absolute_rtol(comm):
    A = poisson2d(12)
    dA = DSparseTensor.from_global(A, comm)
    Bg = torch.from_numpy(np.random.default_rng(5).standard_normal((A.shape[0], 3)))
    Bg[:, 1] *= 100.0
    B = _scatter(dA, Bg)
    calls = []
    diag = dA.diagonal()
    X, info = slasolve.solve(dA, B, "cg", M=lambda r: r / diag, rtol=1e-8, return_info=True,
                             record_history=True, callback=lambda it, r: calls.append(it))
    assert info.converged and info.pc == "callable"
    assert len(calls) == sum(i.iterations for i in info.per_rhs)
    for j, i in enumerate(info.per_rhs):
        assert len(i.residual_history) == i.iterations + 1
        assert i.residual_history[0] == pytest.approx(np.linalg.norm(Bg[:, j].numpy()), rel=1e-10)
    # rtol >= 1 is the absolute tolerance max(rtol ||b_j||, atol), per column
    X, info = slasolve.solve(dA, B, "cg", pc="jacobi", rtol=1.5, return_info=True)
    assert all(i.iterations == 0 and i.converged for i in info.per_rhs)
    X, info = slasolve.solve(dA, B, "cg", pc="jacobi", rtol=0.9, atol=0.0, return_info=True)
    for j in range(3):
        _, i1 = slasolve.solve(dA, B[:, j].contiguous(), "cg", pc="jacobi", rtol=0.9, return_info=True)
        assert i1.iterations == info.per_rhs[j].iterations


@pytest.mark.parametrize("method,pc,A", [("cg", "gamg", poisson2d(10)), ("gmres", "ilu", convdiff(10)),
                                         ("bicgstab", "hypre", convdiff(10))])
def test_adjoint_multi_rhs(comm, method, pc, A):
    dA = DSparseTensor.from_global(A, comm)
    n = A.shape[0]
    Bg = torch.from_numpy(np.random.default_rng(6).standard_normal((n, 3)))
    Wg = torch.from_numpy(np.random.default_rng(7).standard_normal((n, 3)))
    B = _scatter(dA, Bg).requires_grad_(True)
    vals = dA.values.detach().clone().requires_grad_(True)
    X = slasolve.solve(dA.with_values(vals), B, method, pc=pc, rtol=1e-11)
    (X * _scatter(dA, Wg)).sum().backward()
    lam = spla.spsolve(sp.csc_matrix(A.T), Wg.numpy())
    assert np.linalg.norm(_gather(dA, B.grad) - lam) <= 1e-7 * np.linalg.norm(lam)
    # values gradient: the sum of the k single-column gradients
    gsum = torch.zeros_like(vals)
    for j in range(3):
        v1 = dA.values.detach().clone().requires_grad_(True)
        x1 = slasolve.solve(dA.with_values(v1), B[:, j].detach().contiguous(), method, pc=pc, rtol=1e-11)
        (x1 * dA.scatter(Wg[:, j].contiguous(), root=None)).sum().backward()
        gsum += v1.grad
    assert torch.allclose(vals.grad, gsum, rtol=1e-6, atol=1e-9 * float(gsum.abs().max()))


def test_torch_backend_agrees(comm):
    A = poisson2d(10)
    dA = DSparseTensor.from_global(A, comm)
    B = _scatter(dA, torch.from_numpy(np.random.default_rng(8).standard_normal((A.shape[0], 3))))
    Xp, ip = slasolve.solve(dA, B, "cg", backend="petsc", pc="jacobi", rtol=1e-10, return_info=True)
    Xt, it = slasolve.solve(dA, B, "cg", backend="torch", pc="jacobi", rtol=1e-10, return_info=True)
    assert torch.allclose(Xp, Xt, rtol=1e-7, atol=1e-9)
    # exact: the same CG in another summation order; the residual nearest the threshold is 2e-4
    # relative away from rtol ||b_j|| (column 1), far beyond the rounding drift of 40 iterations
    assert [i.iterations for i in ip.per_rhs] == [i.iterations for i in it.per_rhs]


def test_rank_without_rows_and_block_matrix(comm):
    """A rank owning no rows (the last, with 2+ ranks) and a BSR matrix: columns vs SciPy."""
    A = poisson2d(12)
    N, size = A.shape[0], comm.Get_size()
    p = max(1, size - 1)
    offs = [min(N, r * (N // p + 1)) for r in range(size)] + [N]
    if size > 1:
        offs[-2] = N
    r0, r1 = offs[comm.Get_rank()], offs[comm.Get_rank() + 1]
    S = A[r0:r1]
    dA = DSparseTensor.from_local_rows(torch.from_numpy(S.indptr.astype(np.int64)),
                                       torch.from_numpy(S.indices.astype(np.int64)), torch.from_numpy(S.data),
                                       (N, N), comm)
    Bg = torch.from_numpy(np.random.default_rng(9).standard_normal((N, 3)))
    ref = spla.spsolve(A.tocsc(), Bg.numpy())
    for pc in ("gamg", "jacobi"):
        X = slasolve.solve(dA, Bg[r0:r1].contiguous(), "cg", pc=pc, rtol=1e-10)
        Xg = np.concatenate(comm.allgather(X.numpy()))
        assert np.linalg.norm(Xg - ref) <= 1e-8 * np.linalg.norm(ref)
    K = sp.diags([-1, 2, -1], [-1, 0, 1], (30, 30))
    Ab = (sp.kron(K, np.array([[2.0, 0.5], [0.5, 1.0]])) + 0.1 * sp.identity(60)).tobsr((2, 2))
    db = DSparseTensor.from_global(Ab, comm)
    Bg = torch.from_numpy(np.random.default_rng(10).standard_normal((60, 2)))
    X = slasolve.solve(db, _scatter(db, Bg), "cg", pc="gamg", rtol=1e-10)
    ref = spla.spsolve(Ab.tocsc(), Bg.numpy())
    assert np.linalg.norm(_gather(db, X) - ref) <= 1e-8 * np.linalg.norm(ref)
