"""Tests of the native torch eigen kernels (slasolve.eigen.torch_methods)."""

import numpy as np
import pytest
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from slasolve.eigen.info import EigenConvergenceError, EigenInfo
from slasolve.eigen.torch_methods import fix_signs, lanczos, lobpcg, start_vectors

DT = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny problems: intra-op threading only adds contention (and MPI runs
    # oversubscribe the cores); restore the setting afterwards.
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


# ----------------------------------------------------------------- helpers
def lap1d(n):
    return sp.diags([-np.ones(n - 1), 2 * np.ones(n), -np.ones(n - 1)], [-1, 0, 1], format="csr")


def laplacian(dims):
    """Dirichlet FD Laplacian (unit spacing) on a tensor grid, Kronecker sum."""
    A = None
    for d, n in enumerate(dims):
        term = None
        for e, m in enumerate(dims):
            f = lap1d(m) if e == d else sp.identity(m, format="csr")
            term = f if term is None else sp.kron(term, f, format="csr")
        A = term if A is None else A + term
    return A.tocsr()


def analytic(dims):
    ev = [4 * np.sin(np.arange(1, n + 1) * np.pi / (2 * (n + 1))) ** 2 for n in dims]
    tot = np.zeros(1)
    for e in ev:
        tot = (tot[:, None] + e[None, :]).ravel()
    return np.sort(tot)


def torch_op(M):
    M = M.tocsr()
    T = torch.sparse_csr_tensor(torch.from_numpy(M.indptr).long(), torch.from_numpy(M.indices).long(),
                                torch.from_numpy(M.data).to(DT), size=M.shape)
    return lambda X: T @ X


def lu_op(M):
    lu = spla.splu(M.tocsc())
    return lambda X: torch.from_numpy(lu.solve(X.numpy())).to(X.dtype)


def check_pairs(Asp, w, V, Bsp=None, rtol=1e-7):
    Vn = V.numpy()
    AV = Asp @ Vn
    BV = Vn if Bsp is None else Bsp @ Vn
    R = AV - BV * w.numpy()[None, :]
    rel = np.linalg.norm(R, axis=0) / (np.abs(w.numpy()) * np.linalg.norm(BV, axis=0))
    assert rel.max() < rtol, rel
    G = Vn.T @ BV
    assert np.abs(G - np.eye(G.shape[0])).max() < 1e-10
    assert np.all(np.diff(w.numpy()) >= 0)


def check_signs(V, tie_rtol=None):
    tie = np.finfo(np.float64).eps ** (1 / 3) if tie_rtol is None else tie_rtol
    for v in V.numpy().T:
        a = np.abs(v)
        if a.max() == 0:
            continue
        i = np.flatnonzero(a >= (1 - tie) * a.max())[0]
        assert v[i] > 0


GRIDS = [(400,), (31, 23), (11, 9, 7)]


# ----------------------------------------------------------------- LOBPCG
@pytest.mark.parametrize("dims,k", list(zip(GRIDS, [4, 5, 6])))
def test_lobpcg_smallest_exact_preconditioner(dims, k):
    Asp = laplacian(dims)
    n = Asp.shape[0]
    X0 = start_vectors(n, k + 2, dtype=DT)
    w, V, info = lobpcg(torch_op(Asp), X0, T=lu_op(Asp), k=k, tol=1e-9, maxiter=200)
    assert isinstance(info, EigenInfo) and info.converged == k and info.method == "lobpcg"
    assert w.shape == (k,) and V.shape == (n, k)
    ref = analytic(dims)[:k]
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-8)
    check_pairs(Asp, w, V)
    check_signs(V)
    assert max(info.residual_norms) <= 1e-9


def test_lobpcg_smallest_jacobi():
    dims = (25, 19)
    Asp = laplacian(dims)
    n = Asp.shape[0]
    dinv = torch.from_numpy(1.0 / Asp.diagonal())
    w, V, info = lobpcg(torch_op(Asp), start_vectors(n, 6, dtype=DT), T=lambda R: dinv[:, None] * R,
                        k=4, tol=1e-9, maxiter=1000)
    assert info.converged == 4, info
    np.testing.assert_allclose(w.numpy(), analytic(dims)[:4], rtol=1e-8)
    check_pairs(Asp, w, V)


@pytest.mark.parametrize("dims,k", list(zip([(150,), (24, 17), (9, 8, 7)], [4, 5, 6])))
def test_lobpcg_largest(dims, k):
    Asp = laplacian(dims)
    n = Asp.shape[0]
    w, V, info = lobpcg(torch_op(Asp), start_vectors(n, k + 3, dtype=DT), k=k, largest=True,
                        tol=1e-9, maxiter=2000)
    assert info.converged == k, info
    np.testing.assert_allclose(w.numpy(), analytic(dims)[-k:], rtol=1e-8)
    check_pairs(Asp, w, V)
    check_signs(V)


def p1_pair(n):
    """1-D P1 stiffness/mass on (0,1), n interior nodes, Dirichlet."""
    h = 1.0 / (n + 1)
    K = lap1d(n) / h
    M = sp.diags([np.ones(n - 1), 4 * np.ones(n), np.ones(n - 1)], [-1, 0, 1], format="csr") * (h / 6)
    return K.tocsr(), M.tocsr()


@pytest.mark.parametrize("largest", [False, True])
def test_lobpcg_generalized(largest):
    n, k = 300, 5
    K, M = p1_pair(n)
    ref = scipy.linalg.eigh(K.toarray(), M.toarray(), eigvals_only=True)
    ref = ref[-k:] if largest else ref[:k]
    T = None if largest else lu_op(K)
    w, V, info = lobpcg(torch_op(K), start_vectors(n, k + 2, dtype=DT), B=torch_op(M), T=T, k=k,
                        largest=largest, tol=1e-10, maxiter=3000)
    assert info.converged == k, info
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-8)
    check_pairs(K, w, V, M)
    check_signs(V)


def test_lobpcg_nonconvergence_reported():
    Asp = laplacian((400,))
    w, V, info = lobpcg(torch_op(Asp), start_vectors(400, 4, dtype=DT), tol=1e-12, maxiter=3)
    assert info.converged < info.k and info.iterations == 3
    assert torch.isfinite(w).all() and torch.isfinite(V).all()
    err = EigenConvergenceError("no", info)
    assert err.info is info and isinstance(err, RuntimeError)


def test_lobpcg_float32():
    dims = (20, 15)
    Asp = laplacian(dims)
    Af = Asp.astype(np.float32)
    T = torch.sparse_csr_tensor(torch.from_numpy(Af.indptr).long(), torch.from_numpy(Af.indices).long(),
                                torch.from_numpy(Af.data), size=Af.shape)
    lu = spla.splu(Asp.tocsc())
    prec = lambda R: torch.from_numpy(lu.solve(R.double().numpy())).float()  # noqa: E731
    w, V, info = lobpcg(lambda X: T @ X, start_vectors(300, 6, dtype=torch.float32), T=prec, k=4,
                        tol=1e-4, maxiter=200)
    assert info.converged == 4 and w.dtype == torch.float32
    np.testing.assert_allclose(w.numpy(), analytic(dims)[:4], rtol=1e-4)


# ----------------------------------------------------------------- Lanczos
@pytest.mark.parametrize("dims,k", list(zip([(300,), (24, 17), (9, 8, 7)], [4, 5, 6])))
def test_lanczos_largest(dims, k):
    Asp = laplacian(dims)
    n = Asp.shape[0]
    w, V, info = lanczos(torch_op(Asp), start_vectors(n, 1, dtype=DT), k, which="LA", tol=1e-10,
                         ncv=40, maxiter=2000)
    assert info.converged == k, info
    np.testing.assert_allclose(w.numpy(), analytic(dims)[-k:], rtol=1e-8)
    check_pairs(Asp, w, V)
    check_signs(V)


@pytest.mark.parametrize("dims,k", list(zip([(120,), (17, 13), (7, 6, 5)], [4, 5, 6])))
def test_lanczos_smallest_direct(dims, k):
    Asp = laplacian(dims)
    n = Asp.shape[0]
    w, V, info = lanczos(torch_op(Asp), start_vectors(n, 1, dtype=DT), k, which="SA", tol=1e-10,
                         ncv=40, maxiter=3000)
    assert info.converged == k, info
    np.testing.assert_allclose(w.numpy(), analytic(dims)[:k], rtol=1e-8)
    check_pairs(Asp, w, V)
    check_signs(V)


@pytest.mark.parametrize("dims,k", list(zip(GRIDS, [4, 5, 6])))
def test_lanczos_smallest_shift_invert(dims, k):
    Asp = laplacian(dims)
    n = Asp.shape[0]
    mu, V, info = lanczos(lu_op(Asp), start_vectors(n, 1, dtype=DT), k, which="LA", tol=1e-12)
    assert info.converged == k, info
    w = 1.0 / mu.flip(0)
    V = V.flip(1)
    np.testing.assert_allclose(w.numpy(), analytic(dims)[:k], rtol=1e-8)
    check_pairs(Asp, w, V)
    check_signs(V)


@pytest.mark.parametrize("which", ["SA", "LA"])
def test_lanczos_generalized(which):
    n, k = 200, 4
    K, M = p1_pair(n)
    ref = scipy.linalg.eigh(K.toarray(), M.toarray(), eigvals_only=True)
    ref = ref[:k] if which == "SA" else ref[-k:]
    w, V, info = lanczos(torch_op(K), start_vectors(n, 1, dtype=DT), k, which=which, B=torch_op(M),
                         B_solve=lu_op(M), tol=1e-10, ncv=60, maxiter=3000)
    assert info.converged == k, info
    np.testing.assert_allclose(w.numpy(), ref, rtol=1e-8)
    check_pairs(K, w, V, M)
    check_signs(V)


def test_lanczos_small_full_space():
    # ncv == n: exact after one sweep (breakdown handled)
    A = laplacian((12,))
    w, V, info = lanczos(torch_op(A), start_vectors(12, 1, dtype=DT), 3, which="SA", ncv=12)
    assert info.converged == 3
    np.testing.assert_allclose(w.numpy(), analytic((12,))[:3], rtol=1e-10)


# ----------------------------------------------------------------- errors / utilities
def test_errors():
    A = torch_op(laplacian((5,)))
    with pytest.raises(ValueError, match="k"):
        lobpcg(A, start_vectors(5, 5, dtype=DT), k=5)
    with pytest.raises(ValueError, match="k"):
        lanczos(A, start_vectors(5, 1, dtype=DT), 5)
    with pytest.raises(ValueError, match="rank deficient"):
        lobpcg(A, torch.ones(5, 2, dtype=DT))
    with pytest.raises(ValueError, match="B_solve"):
        lanczos(A, start_vectors(5, 1, dtype=DT), 2, B=A)
    with pytest.raises(ValueError, match="which"):
        lanczos(A, start_vectors(5, 1, dtype=DT), 2, which="XX")
    with pytest.raises(FloatingPointError):
        lobpcg(lambda X: X * float("nan"), start_vectors(5, 2, dtype=DT))
    with pytest.raises(FloatingPointError):
        lanczos(lambda X: X * float("nan"), start_vectors(5, 1, dtype=DT), 2)


def run_threads(fn, nranks):
    """Run fn(rank, reduce_max) on nranks threads; reduce_max is a collective
    elementwise max over the threads (a stand-in for MPI.Allreduce(MAX))."""
    import threading
    barrier = threading.Barrier(nranks)
    slots, out = [None] * nranks, [None] * nranks

    def worker(r):
        def reduce_max(t):
            slots[r] = t
            barrier.wait()
            res = torch.stack(slots).amax(0)
            barrier.wait()
            return res
        out[r] = fn(r, reduce_max)

    ths = [threading.Thread(target=worker, args=(r,)) for r in range(nranks)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return out


def test_fix_signs_split_equals_serial():
    g = torch.Generator().manual_seed(0)
    V = torch.randn(50, 7, generator=g, dtype=DT)
    V[10, 0], V[40, 0] = 5.0, -5.0                # exact tie: index 10 wins, positive
    V[3, 1], V[30, 1] = -5.0, 5.0 * (1 + 1e-9)    # near-tie: index 3 wins -> flip
    V[:, 2] = 0.0                                 # zero column untouched
    ref = fix_signs(V)
    assert ref[10, 0] > 0 and ref[3, 1] > 0 and (ref[:, 2] == 0).all()
    assert torch.equal(ref.abs(), V.abs())
    check_signs(ref)
    cuts = [0, 17, 17, 31, 50]                    # includes an empty rank
    parts = run_threads(lambda r, rmax: fix_signs(V[cuts[r]:cuts[r + 1]], reduce_max=rmax,
                                                  row_offset=cuts[r]), 4)
    assert torch.equal(torch.cat(parts), ref)
    perm = torch.randperm(50, generator=g)        # row_ids: local row i is global row perm[i]
    assert torch.equal(fix_signs(V[perm], row_ids=perm), ref[perm])


def test_start_vectors_rank_independent():
    full = start_vectors(100, 3, dtype=DT)
    part = torch.cat([start_vectors(40, 3, row_offset=0, dtype=DT),
                      start_vectors(60, 3, row_offset=40, dtype=DT)])
    torch.testing.assert_close(full, part, rtol=0, atol=0)
    ids = torch.tensor([5, 99, 0])
    torch.testing.assert_close(start_vectors(3, 3, row_ids=ids, dtype=DT), full[ids], rtol=0, atol=0)
    assert full.abs().max() <= 0.5 and full.std() > 0.2


# ----------------------------------------------------------------- MPI
@pytest.mark.mpi
def test_mpi_matches_serial():
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()

    def reduce_sum(t):
        a = np.ascontiguousarray(t.detach().cpu().numpy())
        out = np.empty_like(a)
        comm.Allreduce(a, out, op=MPI.SUM)
        return torch.from_numpy(out).to(t.device)

    def reduce_max(t):
        a = np.ascontiguousarray(t.detach().cpu().numpy())
        out = np.empty_like(a)
        comm.Allreduce(a, out, op=MPI.MAX)
        return torch.from_numpy(out).to(t.device)

    def split(n):
        cuts = [n * r // size for r in range(size + 1)]
        return cuts[rank], cuts[rank + 1]

    def dist_op(Msp, a, b):
        rows = Msp[a:b].tocsr()

        def op(X):
            full = np.concatenate(comm.allgather(X.numpy()), 0)
            return torch.from_numpy(rows @ full)
        return op

    def gather(V):
        return np.concatenate(comm.allgather(V.numpy()), 0)

    dims = (31, 22)
    Asp = laplacian(dims)
    n = Asp.shape[0]
    a, b = split(n)
    kw = dict(reduce_sum=reduce_sum, reduce_max=reduce_max, row_offset=a)

    # LOBPCG, smallest, block-Jacobi (rank-local exact LU) preconditioner
    blk_lu = spla.splu(Asp[a:b, a:b].tocsc())
    prec = lambda R: torch.from_numpy(blk_lu.solve(R.numpy()))  # noqa: E731
    w, V, info = lobpcg(dist_op(Asp, a, b), start_vectors(b - a, 6, row_offset=a, dtype=DT), T=prec,
                        k=4, tol=1e-10, maxiter=500, **kw)
    ws, Vs, infos = lobpcg(torch_op(Asp), start_vectors(n, 6, dtype=DT), T=lu_op(Asp), k=4,
                           tol=1e-10, maxiter=500)
    assert info.converged == 4 and infos.converged == 4
    assert V.shape == (b - a, 4)
    np.testing.assert_allclose(w.numpy(), ws.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gather(V), Vs.numpy(), atol=1e-7)
    np.testing.assert_allclose(w.numpy(), analytic(dims)[:4], rtol=1e-8)
    # identical on every rank
    allw = comm.allgather(w.numpy())
    assert all(np.array_equal(x, allw[0]) for x in allw)

    # Lanczos, largest
    w, V, info = lanczos(dist_op(Asp, a, b), start_vectors(b - a, 1, row_offset=a, dtype=DT), 4,
                         which="LA", tol=1e-11, ncv=40, maxiter=2000, **kw)
    ws, Vs, infos = lanczos(torch_op(Asp), start_vectors(n, 1, dtype=DT), 4, which="LA", tol=1e-11,
                            ncv=40, maxiter=2000)
    assert info.converged == 4 and infos.converged == 4
    np.testing.assert_allclose(w.numpy(), ws.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gather(V), Vs.numpy(), atol=1e-7)

    # generalized 1-D P1 (exact tie structure of symmetric/antisymmetric modes)
    K, M = p1_pair(240)
    a, b = split(240)
    kw["row_offset"] = a
    Kb = spla.splu(K[a:b, a:b].tocsc())
    w, V, info = lobpcg(dist_op(K, a, b), start_vectors(b - a, 6, row_offset=a, dtype=DT),
                        B=dist_op(M, a, b), T=lambda R: torch.from_numpy(Kb.solve(R.numpy())),
                        k=4, tol=1e-10, maxiter=500, **kw)
    ws, Vs, _ = lobpcg(torch_op(K), start_vectors(240, 6, dtype=DT), B=torch_op(M), T=lu_op(K), k=4,
                       tol=1e-10, maxiter=500)
    assert info.converged == 4
    np.testing.assert_allclose(w.numpy(), ws.numpy(), rtol=1e-10)
    np.testing.assert_allclose(gather(V), Vs.numpy(), atol=1e-7)


# ----------------------------------------------------------------- deflation
def _dense_pairs(Asp, Bsp=None):
    w, U = scipy.linalg.eigh(Asp.toarray(), None if Bsp is None else Bsp.toarray())
    return w, torch.from_numpy(U)


@pytest.mark.parametrize("kernel", ["lanczos", "lobpcg"])
@pytest.mark.parametrize("generalized", [False, True])
def test_deflate_returns_next_eigenpairs(kernel, generalized):
    """With ``deflate=(Y, BY)`` (known eigenvectors) the kernels return the wanted end of
    the remaining spectrum (LAPACK reference)."""
    if generalized:
        Asp, Bsp = p1_pair(120)
    else:
        Asp, Bsp = laplacian((13, 11)), None
    n = Asp.shape[0]
    ref, U = _dense_pairs(Asp, Bsp)
    Y = U[:, :3]
    BY = Y if Bsp is None else torch.from_numpy(Bsp @ Y.numpy())
    B = None if Bsp is None else torch_op(Bsp)
    if kernel == "lanczos":
        w, V, info = lanczos(torch_op(Asp), start_vectors(n, 1, dtype=DT), 3, which="SA", B=B,
                             B_solve=None if Bsp is None else lu_op(Bsp), tol=1e-10, ncv=30, maxiter=3000,
                             deflate=(Y, BY))
    else:
        w, V, info = lobpcg(torch_op(Asp), start_vectors(n, 6, dtype=DT), B=B, T=lu_op(Asp), k=3, tol=1e-10,
                            maxiter=500, deflate=(Y, BY))
    assert info.converged == 3 and info.success and info.verified is None, info
    np.testing.assert_allclose(w.numpy(), ref[3:6], rtol=1e-8)
    assert float((BY.mT @ V).abs().max()) < 1e-8          # in the complement


def test_lanczos_repeated_eigenvalue_found_by_deflated_restart():
    """Single-vector Lanczos finds one copy of a double eigenvalue (square grid); a
    restart deflated by the found vectors, from a new start vector, finds the other."""
    Asp = laplacian((12, 12))
    n = Asp.shape[0]
    ref = analytic((12, 12))
    assert abs(ref[1] - ref[2]) < 1e-12 and ref[3] - ref[2] > 1e-3
    w, V, info = lanczos(torch_op(Asp), start_vectors(n, 1, dtype=DT), 2, which="SA", tol=1e-11, ncv=30,
                         maxiter=3000)
    np.testing.assert_allclose(w.numpy(), ref[:2], rtol=1e-9)
    w2, V2, _ = lanczos(torch_op(Asp), start_vectors(n, 1, seed=5, dtype=DT), 1, which="SA", tol=1e-11,
                        ncv=30, maxiter=3000, deflate=(V, V))
    np.testing.assert_allclose(w2.numpy(), ref[2:3], rtol=1e-9)


def test_deflate_errors():
    A = torch_op(laplacian((6,)))
    Y = torch.linalg.qr(start_vectors(6, 3, dtype=DT))[0]
    with pytest.raises(ValueError, match="deflated"):
        lobpcg(A, start_vectors(6, 4, dtype=DT), k=2, deflate=(Y, Y))
    with pytest.raises(ValueError, match="deflated"):
        lanczos(A, start_vectors(6, 1, dtype=DT), 3, ncv=4, deflate=(Y, Y))
