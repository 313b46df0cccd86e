"""Tests of the native torch Krylov kernels and local preconditioners."""

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

from slasolve.krylov.info import ConvergenceError, SolveInfo
from slasolve.krylov.torch_methods import bicgstab, cg, gmres, minres
from slasolve.krylov import torch_pc

pytestmark = pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")

METHODS = {"cg": cg, "minres": minres, "gmres": gmres, "bicgstab": bicgstab}


# ------------------------------------------------------------------ problems
def poisson2d(m):
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    I = sp.eye(m)
    return _clean(sp.kron(I, T) + sp.kron(T, I))


def poisson3d(m):
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
    I = sp.eye(m)
    return _clean(sp.kron(sp.kron(I, I), T) + sp.kron(sp.kron(I, T), I)
                  + sp.kron(sp.kron(T, I), I))


def convdiff2d(m, peclet=20.0):
    """-lap u + w . grad u on the unit square, first-order upwind, w = (1, 0.5)."""
    h = 1.0 / (m + 1)
    T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m)) / h**2
    D = sp.diags([-1.0, 1.0], [-1, 0], shape=(m, m)) / h   # backward difference (w > 0)
    I = sp.eye(m)
    A = sp.kron(I, T) + sp.kron(T, I) + peclet * (sp.kron(I, D) + 0.5 * sp.kron(D, I))
    return _clean(A)


PROBLEMS = {
    "poisson2d": lambda: poisson2d(24),
    "poisson3d": lambda: poisson3d(9),
    "convdiff": lambda: convdiff2d(24),
}
SPD = ("poisson2d", "poisson3d")


def _clean(A):
    A = A.tocsr()
    A.eliminate_zeros()   # kron of dia matrices stores explicit zeros
    A.sort_indices()
    return A


def rhs(n, seed=0):
    return np.random.default_rng(seed).standard_normal(n)


def torch_csr(A, dtype=torch.float64):
    A = A.tocsr()
    return (torch.from_numpy(A.indptr.astype(np.int64)), torch.from_numpy(A.indices.astype(np.int64)),
            torch.from_numpy(A.data).to(dtype), A.shape[0])


def make_matvec(A, dtype=torch.float64):
    indptr, indices, values, n = torch_csr(A, dtype)
    At = torch.sparse_csr_tensor(indptr, indices, values, size=(n, n), check_invariants=True)
    return lambda x: At @ x


def make_pc(A, kind, dtype=torch.float64):
    if kind is None:
        return None
    if kind == "jacobi":
        return torch_pc.jacobi(*torch_csr(A, dtype))
    return torch_pc.block_jacobi_ilu(*torch_csr(A, dtype), kind=kind)


def true_relres(A, x, b):
    return np.linalg.norm(b - A @ x) / np.linalg.norm(b)


# ------------------------------------------------------------ accuracy tests
CASES = ([(m, p) for m in ("cg", "minres") for p in SPD]
         + [(m, p) for m in ("gmres", "bicgstab") for p in ("convdiff",) + SPD])


@pytest.mark.parametrize("pc", [None, "jacobi", "ilu0"])
@pytest.mark.parametrize("method,prob", CASES)
def test_solution_matches_spsolve(method, prob, pc):
    A = PROBLEMS[prob]()
    b = rhs(A.shape[0])
    rtol = 1e-8
    x_ref = spla.spsolve(A.tocsc(), b)
    seen = []
    x, info = METHODS[method](make_matvec(A), torch.from_numpy(b), rtol=rtol, M=make_pc(A, pc),
                              callback=lambda k, r: seen.append((k, r)), record_history=True)
    assert isinstance(info, SolveInfo)
    assert info.converged and info.reason == "CONVERGED_RTOL", info
    assert info.method == method and info.backend == "torch"
    assert x.dtype == torch.float64 and x.shape == (A.shape[0],)
    xn = x.numpy()
    assert info.residual_norm <= rtol * np.linalg.norm(b)
    # the recurrence residual tracks the true one closely
    assert true_relres(A, xn, b) <= 1.05 * rtol
    cond_ish = 1e4
    assert np.linalg.norm(xn - x_ref) <= cond_ish * rtol * np.linalg.norm(x_ref)
    assert [k for k, _ in seen] == list(range(1, info.iterations + 1))
    assert len(info.residual_history) == info.iterations + 1
    assert info.residual_history[0] == pytest.approx(np.linalg.norm(b))


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_ic0(method):
    A = poisson2d(20)
    b = rhs(A.shape[0], 3)
    M = torch_pc.block_jacobi_ilu(*torch_csr(A), kind="ic0")
    x, info = METHODS[method](make_matvec(A), torch.from_numpy(b), rtol=1e-8, M=M)
    x0, info0 = METHODS[method](make_matvec(A), torch.from_numpy(b), rtol=1e-8)
    assert info.converged and true_relres(A, x.numpy(), b) <= 1.05e-8
    assert info.iterations < info0.iterations


def test_preconditioning_reduces_iterations():
    A = poisson2d(24)
    b = torch.from_numpy(rhs(A.shape[0]))
    its = {pc: cg(make_matvec(A), b, rtol=1e-8, M=make_pc(A, pc))[1].iterations
           for pc in (None, "ilu0")}
    assert its["ilu0"] < 0.7 * its[None]
    A = convdiff2d(24)
    its = {pc: gmres(make_matvec(A), b, rtol=1e-8, M=make_pc(A, pc))[1].iterations
           for pc in (None, "jacobi", "ilu0")}
    assert its["ilu0"] < its["jacobi"] <= its[None]   # constant diagonal: Jacobi ~ none


@pytest.mark.parametrize("prob", SPD)
@pytest.mark.parametrize("rtol", [1e-5, 1e-8])
def test_cg_iterations_match_scipy(prob, rtol):
    A = PROBLEMS[prob]()
    b = rhs(A.shape[0], 1)
    count = [0]

    def cb(xk):
        count[0] += 1

    try:
        spla.cg(A, b, rtol=rtol, atol=0.0, callback=cb)
    except TypeError:  # SciPy < 1.12 spells it tol
        spla.cg(A, b, tol=rtol, atol=0.0, callback=cb)
    _, info = cg(make_matvec(A), torch.from_numpy(b), rtol=rtol)
    assert info.converged
    assert abs(info.iterations - count[0]) <= 1, (info.iterations, count[0])


def test_gmres_restart_and_unrestarted():
    A = convdiff2d(16)
    b = torch.from_numpy(rhs(A.shape[0]))
    _, full = gmres(make_matvec(A), b, rtol=1e-10, restart=A.shape[0])
    _, short = gmres(make_matvec(A), b, rtol=1e-10, restart=5)
    assert full.converged and short.converged
    assert full.iterations <= short.iterations


# --------------------------------------------------------------- edge cases
@pytest.mark.parametrize("method", list(METHODS))
def test_zero_rhs_and_exact_guess(method):
    A = poisson2d(8)
    mv = make_matvec(A)
    x, info = METHODS[method](mv, torch.zeros(64, dtype=torch.float64), x0=torch.ones(64, dtype=torch.float64))
    assert info.converged and info.iterations == 0 and torch.count_nonzero(x) == 0
    xs = torch.from_numpy(rhs(64))
    b = mv(xs)
    x, info = METHODS[method](mv, b, x0=xs)
    assert info.converged and info.iterations == 0 and torch.equal(x, xs)
    # x0 is not modified in place
    xs_copy = xs.clone()
    METHODS[method](mv, b, x0=torch.zeros_like(xs) + xs * 0.5)
    assert torch.equal(xs, xs_copy)


@pytest.mark.parametrize("method", list(METHODS))
def test_atol_reason(method):
    A = poisson2d(10)
    b = torch.from_numpy(rhs(100))
    x, info = METHODS[method](make_matvec(A), b, rtol=0.0, atol=1e-3 * float(b.norm()))
    assert info.reason == "CONVERGED_ATOL" and info.residual_norm <= info.atol


@pytest.mark.parametrize("method", list(METHODS))
def test_maxiter_gives_diverged_its(method):
    A = poisson2d(16)
    b = torch.from_numpy(rhs(256))
    x, info = METHODS[method](make_matvec(A), b, rtol=1e-12, maxiter=3)
    assert not info.converged and info.reason == "DIVERGED_ITS" and info.iterations == 3
    with pytest.raises(ConvergenceError, match="DIVERGED_ITS") as ei:
        raise ConvergenceError(info)
    assert ei.value.info is info and method in str(ei.value)


@pytest.mark.parametrize("method", list(METHODS))
def test_nan_gives_nanorinf(method):
    A = poisson2d(8)
    b = torch.from_numpy(rhs(64))
    b[5] = float("nan")
    x, info = METHODS[method](make_matvec(A), b)
    assert info.reason == "DIVERGED_NANORINF" and not info.converged
    # NaN produced by the operator in the middle of the iteration
    calls = [0]
    mv0 = make_matvec(A)

    def mv(v):
        calls[0] += 1
        y = mv0(v)
        return y * float("nan") if calls[0] == 3 else y

    x, info = METHODS[method](mv, torch.from_numpy(rhs(64)), rtol=1e-12)
    assert info.reason == "DIVERGED_NANORINF"


def test_cg_indefinite_matrix():
    d = np.linspace(-1.0, 2.0, 50)
    d[np.abs(d) < 1e-3] = 0.5
    A = sp.diags(d).tocsr()
    x, info = cg(make_matvec(A), torch.ones(50, dtype=torch.float64), rtol=1e-10)
    assert info.reason == "DIVERGED_INDEFINITE_MAT" and not info.converged
    assert torch.isfinite(x).all()
    # MINRES handles symmetric indefinite matrices
    x, info = minres(make_matvec(A), torch.ones(50, dtype=torch.float64), rtol=1e-10)
    assert info.converged and true_relres(A, x.numpy(), np.ones(50)) <= 1.05e-10


@pytest.mark.parametrize("method", ["cg", "minres"])
def test_indefinite_pc(method):
    A = poisson2d(8)
    x, info = METHODS[method](make_matvec(A), torch.from_numpy(rhs(64)), M=lambda r: -r)
    assert info.reason == "DIVERGED_INDEFINITE_PC"


def test_bicgstab_breakdown():
    A = sp.csr_matrix(np.array([[0.0, 1.0], [-1.0, 0.0]]))   # skew: r0 . A r0 = 0
    x, info = bicgstab(make_matvec(A), torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert info.reason == "DIVERGED_BREAKDOWN" and not info.converged


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("pc", [None, "jacobi", "ilu0"])
def test_float32(method, pc):
    A = convdiff2d(12) if method in ("gmres", "bicgstab") else poisson2d(12)
    b = rhs(A.shape[0]).astype(np.float32)
    x, info = METHODS[method](make_matvec(A, torch.float32), torch.from_numpy(b), rtol=1e-4,
                              M=make_pc(A, pc, torch.float32))
    assert x.dtype == torch.float32
    assert info.converged, info
    assert true_relres(A, x.double().numpy(), b.astype(np.float64)) <= 2e-4


def test_bad_arguments():
    mv = make_matvec(poisson2d(4))
    with pytest.raises(ValueError, match="1-D"):
        cg(mv, torch.ones(16, 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="x0"):
        cg(mv, torch.ones(16, dtype=torch.float64), x0=torch.ones(3))
    with pytest.raises(ValueError, match="restart"):
        gmres(mv, torch.ones(16, dtype=torch.float64), restart=0)
    with pytest.raises(TypeError, match="floating"):
        cg(mv, torch.ones(16, dtype=torch.int64))


# ---------------------------------------------------------- preconditioners
def test_jacobi_and_errors():
    A = convdiff2d(6)
    r = torch.from_numpy(rhs(36))
    z = torch_pc.jacobi(*torch_csr(A))(r)
    assert torch.allclose(z, r / torch.from_numpy(A.diagonal()))
    Z = torch_pc.jacobi(*torch_csr(A))(torch.stack([r, 2 * r], 1))
    assert torch.allclose(Z[:, 1], 2 * z)
    B = A.tolil()
    B[4, 4] = 0.0
    B = B.tocsr()
    B.eliminate_zeros()
    with pytest.raises(ValueError, match="row 4 is missing"):
        torch_pc.jacobi(*torch_csr(B))
    C = A.copy()
    C.data[C.indptr[7]:C.indptr[8]][C.indices[C.indptr[7]:C.indptr[8]] == 7] = 0.0
    with pytest.raises(ValueError, match="row 7 is zero"):
        torch_pc.jacobi(*torch_csr(C))
    with pytest.raises(ValueError, match="row 4"):
        torch_pc.block_jacobi_ilu(*torch_csr(B))
    with pytest.raises(ValueError, match="kind"):
        torch_pc.block_jacobi_ilu(*torch_csr(A), kind="ilu3")


def _ilu0_reference(A):
    """Textbook ILU(0) (IKJ variant), dense loops; small matrices only."""
    A = A.toarray()
    n = A.shape[0]
    pat = A != 0
    LU = A.copy()
    for i in range(1, n):
        for k in range(i):
            if not pat[i, k]:
                continue
            LU[i, k] /= LU[k, k]
            for j in range(k + 1, n):
                if pat[i, j]:
                    LU[i, j] -= LU[i, k] * LU[k, j]
    L = np.tril(LU, -1) + np.eye(n)
    U = np.triu(LU)
    return L, U


@pytest.mark.parametrize("factor", ["petsc", "scipy"])
def test_ilu0_is_ilu0(factor):
    pytest.importorskip("petsc4py") if factor == "petsc" else None
    A = convdiff2d(5)
    L, U = _ilu0_reference(A)
    r = rhs(25, 7)
    z_ref = np.linalg.solve(U, np.linalg.solve(L, r))
    z = torch_pc.block_jacobi_ilu(*torch_csr(A), kind="ilu0", factor=factor)(torch.from_numpy(r)).numpy()
    if factor == "petsc":
        assert np.allclose(z, z_ref, rtol=1e-12, atol=1e-12)
    else:  # SuperLU's threshold ILU only approximates ILU(0): check it preconditions well
        A = convdiff2d(24)
        b = torch.from_numpy(rhs(A.shape[0]))
        M = torch_pc.block_jacobi_ilu(*torch_csr(A), kind="ilu0", factor="scipy")
        _, i_ilu = gmres(make_matvec(A), b, rtol=1e-8, M=M)
        _, i_jac = gmres(make_matvec(A), b, rtol=1e-8, M=make_pc(A, "jacobi"))
        assert i_ilu.converged and i_ilu.iterations < i_jac.iterations


def test_pc_device_dtype_roundtrip_and_callable():
    A = poisson2d(6)
    apply = torch_pc.block_jacobi_ilu(*torch_csr(A, torch.float32), kind="ilu0")
    z = apply(torch.ones(36, dtype=torch.float32))
    assert z.dtype == torch.float32 and z.shape == (36,)
    wrapped = torch_pc.from_callable(lambda r: (r * 0.25).numpy())
    z = wrapped(torch.ones(36, dtype=torch.float64))
    assert z.dtype == torch.float64 and torch.allclose(z, torch.full((36,), 0.25, dtype=torch.float64))
    bad = torch_pc.from_callable(lambda r: r[:3])
    with pytest.raises(ValueError, match="shape"):
        bad(torch.ones(36))
    x, info = cg(make_matvec(A), torch.ones(36, dtype=torch.float64), rtol=1e-10,
                 M=torch_pc.from_callable(lambda r: r / 4.0))
    assert info.converged


# ---------------------------------------------------------------------- MPI
@pytest.mark.mpi
@pytest.mark.parametrize("method,prob,pc", [("cg", "poisson2d", None), ("cg", "poisson3d", "jacobi"),
                                            ("minres", "poisson2d", "jacobi"),
                                            ("gmres", "convdiff", None), ("gmres", "convdiff", "jacobi"),
                                            ("bicgstab", "convdiff", "jacobi")])
def test_mpi_row_split_matches_serial(method, prob, pc):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    size, rank = comm.Get_size(), comm.Get_rank()
    A = PROBLEMS[prob]()
    n = A.shape[0]
    b = rhs(n, 11)
    bounds = [n * p // size for p in range(size + 1)]
    lo, hi = bounds[rank], bounds[rank + 1]
    A_rows = A[lo:hi]                                   # owned rows, global columns
    mv_rows = make_matvec(sp.vstack([A_rows, sp.csr_matrix((n - (hi - lo), n))]).tocsr())

    def matvec(x_local):                                # gather x, multiply owned rows
        parts = comm.allgather(x_local.numpy())
        x_glob = torch.from_numpy(np.concatenate(parts))
        return mv_rows(x_glob)[: hi - lo]

    def reduce_sum(t):
        buf = np.ascontiguousarray(t.detach().cpu().numpy())
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        return torch.from_numpy(buf).to(t.device)

    M_local = make_pc(A[lo:hi, lo:hi], pc)               # block Jacobi = Jacobi for "jacobi"
    x_loc, info = METHODS[method](matvec, torch.from_numpy(b[lo:hi].copy()), rtol=1e-8,
                                  M=M_local, reduce_sum=reduce_sum, record_history=True)
    x_ser, info_ser = METHODS[method](make_matvec(A), torch.from_numpy(b), rtol=1e-8,
                                      M=make_pc(A, pc), record_history=True)
    x_all = np.concatenate(comm.allgather(x_loc.numpy()))
    assert info.converged and info_ser.converged
    # exact: the runs differ only in summation order (reductions over ranks), and every residual
    # of these histories is >= 8% away from rtol ||b|| while they agree to 1e-6 (checked below)
    assert info.iterations == info_ser.iterations
    # every rank took the same decisions from the same reduced scalars
    its = comm.allgather((info.iterations, info.reason, info.residual_norm))
    assert all(t == its[0] for t in its)
    assert np.allclose(info.residual_history, info_ser.residual_history, rtol=1e-6, atol=0)
    assert np.linalg.norm(x_all - x_ser.numpy()) <= 1e-9 * np.linalg.norm(x_ser.numpy())
    assert true_relres(A, x_all, b) <= 1.05e-8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", list(METHODS))
def test_cuda_device(method):
    A = convdiff2d(12) if method in ("gmres", "bicgstab") else poisson2d(12)
    dev = torch.device("cuda")
    indptr, indices, values, n = torch_csr(A)
    At = torch.sparse_csr_tensor(indptr, indices, values, size=(n, n)).to(dev)
    b = torch.from_numpy(rhs(n)).to(dev)
    M = torch_pc.block_jacobi_ilu(indptr.to(dev), indices.to(dev), values.to(dev), n)
    x, info = METHODS[method](lambda v: At @ v, b, rtol=1e-8, M=M)
    assert x.device.type == "cuda" and info.converged
    assert true_relres(A, x.cpu().numpy(), b.cpu().numpy()) <= 1.05e-8
