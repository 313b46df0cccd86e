"""slasolve.linalg, the SciPy drop-in: signatures, return types, modes, refusals.

References: SciPy 1.10's own functions (signatures, results), NumPy/LAPACK. SciPy's own
test suite runs against slasolve.linalg in tests/scipy_suite/.
"""
import inspect
import warnings

import numpy as np
import pytest
import scipy.linalg as sla
import scipy.sparse as sp
import scipy.sparse.linalg as ssl
import torch

import slasolve.linalg as L
from slasolve.testing import distribute

FUNCS = ("cg", "gmres", "minres", "bicgstab", "spsolve", "eigsh")
KRYLOV = ("cg", "gmres", "minres", "bicgstab")


def poisson(n=30):
    return sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n), format="csr")


def nonsym(n=30):
    return sp.diags([-1.5, 3.0, -0.5], [-1, 0, 1], shape=(n, n), format="csr")


def call(name, A, b, **kw):
    f = getattr(L, name)
    if name != "minres":
        kw.setdefault("atol", 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return f(A, b, **kw)


# ------------------------------------------------------------------------------- signatures
@pytest.mark.parametrize("name", FUNCS)
def test_signature_prefix_is_scipys(name):
    ours = list(inspect.signature(getattr(L, name)).parameters.values())
    theirs = list(inspect.signature(getattr(ssl, name)).parameters.values())
    assert [(p.name, p.default, p.kind) for p in ours[:len(theirs)]] == \
        [(p.name, p.default, p.kind) for p in theirs]
    extra = ours[len(theirs):]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)
    assert "comm" in [p.name for p in extra]
    if name in KRYLOV:
        assert "rtol" in [p.name for p in extra]


def test_reexports_are_scipys():
    assert L.LinearOperator is ssl.LinearOperator and L.aslinearoperator is ssl.aslinearoperator


# ------------------------------------------------------------------------------- results
@pytest.mark.parametrize("name", KRYLOV)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_krylov_result_types_and_answer(name, dtype):
    A = (poisson() if name in ("cg", "minres") else nonsym()).astype(dtype)
    b = np.arange(30.0)
    x, info = call(name, A, b, tol=1e-6)
    xs, info_s = getattr(ssl, name)(A, b, tol=1e-6, **({} if name == "minres" else {"atol": 0.0}))
    assert type(info) is int and info == 0 == info_s
    assert isinstance(x, np.ndarray) and x.dtype == xs.dtype and x.shape == xs.shape == (30,)
    r = np.linalg.norm(A.astype(np.float64) @ x.astype(np.float64) - b) / np.linalg.norm(b)
    assert r <= 1e-6 * (1.01 if dtype == np.float64 else 50)


@pytest.mark.parametrize("name", KRYLOV)
def test_not_converged_returns_maxiter(name):
    A, b = nonsym(60) if name in ("gmres", "bicgstab") else poisson(60), np.ones(60)
    kw = {"restart": 5} if name == "gmres" else {}
    x, info = call(name, A, b, tol=1e-12, maxiter=2, **kw)
    assert info == 2 and np.linalg.norm(A @ x - b) > 1e-12 * np.linalg.norm(b)


def test_cg_indefinite_reports_breakdown():
    A = sp.diags([1.0, -1.0, 2.0, -3.0], 0, format="csr")
    x, info = call("cg", A, np.ones(4), tol=1e-10, backend="torch")
    assert info < 0


@pytest.mark.parametrize("name", KRYLOV)
def test_callback_receives_live_iterate(name):
    A, b = (poisson(20) if name in ("cg", "minres") else nonsym(20)), np.arange(20.0)
    seen = []
    kw = {"callback_type": "x"} if name == "gmres" else {}
    x, info = call(name, A, b, tol=1e-10, callback=lambda xk: seen.append(np.array(xk)), **kw)
    assert info == 0 and len(seen) >= 1
    np.testing.assert_allclose(seen[-1], x, rtol=0, atol=0)
    res = [np.linalg.norm(A @ s - b) for s in seen]
    assert res[-1] <= 1e-10 * np.linalg.norm(b) * 1.01
    if name == "gmres":  # per restart cycle, plus once at the exit (SciPy)
        assert len(seen) >= 2
    else:
        assert len(set(r.tobytes() for r in seen)) == len(seen)  # a new iterate each time


def test_gmres_pr_norm_callback_is_relative_residual():
    A, b = nonsym(20), np.arange(20.0)
    vals = []
    x, info = call("gmres", A, b, tol=1e-8, callback=vals.append, callback_type="pr_norm")
    assert info == 0 and all(isinstance(v, float) for v in vals)
    assert vals[-1] <= 1e-8 * 1.01 and vals[0] < 1.0


def test_gmres_callback_scipy_case():
    """SciPy's TestGMRES.test_callback: the same first (unpreconditioned) half; with a
    preconditioner slasolve's right-preconditioned GMRES reports the true relative
    residual, where SciPy's left-preconditioned one reports ||M r|| / ||b||."""
    A = sp.diags([1.0, -2.0, 1.0], [-1, 0, 1], shape=(6, 6), format="csr")
    b = np.ones(6)
    ref = []
    ssl.gmres(A, b, x0=np.zeros(6), tol=1e-16, atol=0, maxiter=1, callback=ref.append, callback_type="legacy")
    assert ref[0] == pytest.approx(0.81649658092772603, rel=1e-10)   # SciPy 1.0.0's value
    for M in (None, 1e-3 * np.eye(6)):   # the same Krylov space: the same true residual
        vals = []
        call("gmres", A, b, x0=np.zeros(6), tol=1e-16, maxiter=1, M=M, callback=vals.append)
        assert vals[0] == pytest.approx(ref[0], rel=1e-10)


@pytest.mark.parametrize("comm", [None, pytest.param("world", marks=pytest.mark.mpi)])
def test_gmres_defective_precond_scipy_case(comm):
    """SciPy's TestGMRES.test_defective_precond_breakdown (a preconditioner with a null space):
    no NaN, no false success, and the solution right outside M's null space -- to rounding,
    where SciPy's test asks for an exact zero that the CPU's last bit decides."""
    from mpi4py import MPI

    M = np.eye(3)
    M[2, 2] = 0
    b, A = np.array([0.0, 1.0, 1.0]), np.diag([2.0, 3.0, 4.0])
    kw = {} if comm is None else {"comm": MPI.COMM_WORLD}
    x, info = L.gmres(A, b, x0=np.array([1.0, 0.0, 0.0]), M=M, tol=1e-15, atol=0, **kw)
    assert not np.isnan(x).any()
    if info == 0:
        assert np.linalg.norm(A @ x - b) <= 1e-15 * np.linalg.norm(b)
    eps = np.finfo(float).eps
    assert np.abs(M @ (A @ x) - M @ b).max() <= 16 * eps * np.abs(A).max() * max(1.0, np.abs(x).max())
    assert abs(x[1] - 1.0 / 3.0) <= 16 * eps


def test_rtol_keyword_is_scipy_112_semantics():
    A, b = poisson(), np.arange(30.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)   # rtol: no legacy atol warning
        x, info = L.cg(A, b, rtol=1e-9)
    assert info == 0 and np.linalg.norm(A @ x - b) <= 1e-9 * np.linalg.norm(b) * 1.01
    with pytest.raises(ValueError, match="not both"):
        L.cg(A, b, tol=1e-3, rtol=1e-9)
    with pytest.warns(DeprecationWarning, match="called without specifying `atol`"):
        L.cg(A, b)


@pytest.mark.parametrize("name", KRYLOV)
def test_matrix_free_operator_not_densified(name):
    n = 200_000   # a dense copy would need 320 GB
    d = np.linspace(1.0, 4.0, n)

    def mv(v):
        return d * np.ravel(v)
    op = ssl.LinearOperator((n, n), matvec=mv, dtype=np.float64)
    op.todense = op.toarray = None     # any densification attempt fails loudly
    b = np.ones(n)
    x, info = call(name, op, b, tol=1e-8)
    assert info == 0
    assert np.linalg.norm(d * x - b) <= 1e-8 * np.linalg.norm(b) * 1.01


def test_callable_A_and_M_and_Mb():
    A = poisson(25).toarray()
    b = np.arange(25.0)
    dinv = 1.0 / np.diag(A)
    x, info = call("cg", lambda v: A @ v, b, tol=1e-10, M=lambda r: dinv * r, x0="Mb")
    assert info == 0 and np.linalg.norm(A @ x - b) <= 1e-10 * np.linalg.norm(b) * 1.01


@pytest.mark.parametrize("name", FUNCS)
def test_complex_refused(name):
    A = (poisson(8) + 1j * sp.identity(8)).tocsr()
    b = np.ones(8)
    with pytest.raises(TypeError, match="complex"):
        if name == "eigsh":
            L.eigsh(A, 2)
        elif name == "spsolve":
            L.spsolve(A, b)
        else:
            call(name, A, b)
    if name not in ("eigsh", "spsolve"):
        with pytest.raises(TypeError, match="complex"):
            call(name, poisson(8), b + 1j)
        with pytest.raises(TypeError, match="complex"):   # a complex-valued matrix-free operator
            call(name, ssl.LinearOperator((8, 8), matvec=lambda v: (1 + 1j) * v, dtype=complex), b)


def test_bad_shapes_raise_valueerror():
    with pytest.raises(ValueError):
        call("cg", poisson(5), np.ones(4))
    with pytest.raises(ValueError, match="square"):
        L.spsolve(sp.csr_matrix(np.ones((3, 4))), np.ones(3))


# ------------------------------------------------------------------------------- spsolve / eigsh
def test_spsolve_matches_scipy_and_keeps_types():
    A = nonsym(12).tocsc()
    b = np.arange(12.0)
    np.testing.assert_allclose(L.spsolve(A, b), ssl.spsolve(A, b), rtol=1e-12)
    B = sp.random(12, 3, density=0.3, random_state=1, format="csc")
    X = L.spsolve(A, B)
    assert sp.issparse(X) and X.shape == (12, 3)
    np.testing.assert_allclose(X.toarray(), ssl.spsolve(A, B).toarray(), rtol=1e-12, atol=1e-14)
    assert L.spsolve(A, np.ones((12, 1))).shape == (12,)
    assert L.spsolve(A.astype(np.float32), b).dtype == np.float64  # promote(float32, float64)
    with pytest.warns(ssl.MatrixRankWarning):
        assert np.isnan(L.spsolve(sp.csc_matrix((4, 4)), np.ones(4))).all()


@pytest.mark.parametrize("which", ["LM", "SM", "LA", "SA", "BE"])
def test_eigsh_matches_lapack(which):
    A = poisson(40)
    w, V = L.eigsh(A, 4, which=which)
    ref = np.linalg.eigvalsh(A.toarray())
    want = {"LM": ref[-4:], "LA": ref[-4:], "SM": ref[:4], "SA": ref[:4],
            "BE": np.r_[ref[:2], ref[-2:]]}[which]
    np.testing.assert_allclose(w, np.sort(want), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(A @ V, V * w, atol=1e-10)


def test_eigsh_generalized_and_shift_invert():
    A = poisson(30)
    Mm = sp.diags(np.linspace(1.0, 2.0, 30), format="csr")
    w, V = L.eigsh(A, 3, M=Mm, sigma=0.5)
    ref = sla.eigh(A.toarray(), Mm.toarray(), eigvals_only=True)
    near = np.sort(ref[np.argsort(np.abs(ref - 0.5))[:3]])
    np.testing.assert_allclose(w, near, rtol=1e-10)
    np.testing.assert_allclose(V.T @ (Mm @ V), np.eye(3), atol=1e-10)


def test_eigsh_refusals():
    A = poisson(10)
    with pytest.raises(ValueError, match="mode"):
        L.eigsh(A, 2, sigma=0.5, mode="cayley")
    with pytest.raises(TypeError, match="LinearOperator"):
        L.eigsh(ssl.aslinearoperator(A), 2)
    with pytest.raises(ValueError, match="which"):
        L.eigsh(A, 2, sigma=0.5, which="SA")


# ------------------------------------------------------------------------------- MPI modes
@pytest.mark.mpi
@pytest.mark.parametrize("name", KRYLOV)
def test_replicated_equals_serial(comm, name):
    A = poisson(37) if name in ("cg", "minres") else nonsym(37)
    b = np.arange(37.0)
    x1, i1 = call(name, A, b, tol=1e-10, comm=comm)
    x0, i0 = call(name, A, b, tol=1e-10)   # comm=None: this process alone
    assert i1 == i0 == 0
    np.testing.assert_allclose(x1, x0, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(x1, comm.bcast(x1, root=0), rtol=0, atol=0)  # same on every rank


@pytest.mark.mpi
@pytest.mark.parametrize("name", KRYLOV)
def test_rows_mode_dsparse(comm, name):
    A = poisson(41) if name in ("cg", "minres") else nonsym(41)
    xref = sla.solve(A.toarray(), np.arange(41.0))
    dA = distribute(A, comm)
    a, e = dA.row_range
    b = np.arange(41.0)[a:e]
    seen = []
    kw = {"callback_type": "x"} if name == "gmres" else {}
    x, info = call(name, dA, b, tol=1e-11, callback=lambda xk: seen.append(xk.shape), **kw)
    assert info == 0 and x.shape == (e - a,)
    assert set(seen) == {(e - a,)}      # the callback gets this rank's rows
    np.testing.assert_allclose(x, xref[a:e], rtol=1e-8, atol=1e-9)


@pytest.mark.mpi
def test_rows_mode_local_linear_operator(comm):
    A = poisson(33)
    dA = distribute(A, comm)
    a, e = dA.row_range
    op = ssl.LinearOperator((e - a, e - a), dtype=np.float64,
                            matvec=lambda v: dA.matvec(torch.as_tensor(np.ravel(v))).numpy())
    x, info = call("cg", op, np.ones(e - a), tol=1e-11, local=True, comm=comm)
    np.testing.assert_allclose(x, sla.solve(A.toarray(), np.ones(33))[a:e], rtol=1e-8)
    assert info == 0


@pytest.mark.mpi
def test_replicated_input_must_agree(comm):
    A = poisson(12)
    b = np.ones(12) * (1 + comm.Get_rank())
    if comm.Get_size() == 1:
        return
    with pytest.raises(ValueError, match="differ"):
        call("cg", A, b, comm=comm)


@pytest.mark.mpi
def test_spsolve_and_eigsh_distributed(comm):
    A = nonsym(26).tocsr()
    b = np.arange(26.0)
    np.testing.assert_allclose(L.spsolve(A, b, comm=comm), ssl.spsolve(A.tocsc(), b), rtol=1e-10)
    S = poisson(26)
    w, V = L.eigsh(S, 3, which="SA", comm=comm)
    np.testing.assert_allclose(w, np.linalg.eigvalsh(S.toarray())[:3], rtol=1e-10)
    assert V.shape == (26, 3)
    np.testing.assert_allclose(S @ V, V * w, atol=1e-10)
    dS = distribute(S, comm)
    a, e = dS.row_range
    w2, V2 = L.eigsh(dS, 3, which="SA")
    np.testing.assert_allclose(w2, w, rtol=1e-10)
    assert V2.shape == (e - a, 3)


NO_PETSC = """
import sys, warnings
sys.modules["petsc4py"] = None      # as if not installed
sys.modules["slepc4py"] = None
import numpy as np, scipy.sparse as sp, scipy.sparse.linalg as ssl
import slasolve.linalg as L
assert "petsc4py.PETSc" not in sys.modules
A = sp.diags([-1.5, 3.0, -0.5], [-1, 0, 1], shape=(20, 20), format="csr")
S = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(20, 20), format="csr")
b = np.arange(20.0)
ref = ssl.spsolve(A.tocsc(), b)
for f, M in ((L.gmres, A), (L.bicgstab, A), (L.cg, S), (L.minres, S)):
    x, info = f(M, b, tol=1e-10) if f is L.minres else f(M, b, tol=1e-10, atol=0)
    assert info == 0 and np.linalg.norm(M @ x - b) <= 1e-10 * np.linalg.norm(b) * 1.01, f
assert np.allclose(L.spsolve(A, b), ref, rtol=1e-12)
w, V = L.eigsh(S, 3, which="SA")
assert np.allclose(w, np.linalg.eigvalsh(S.toarray())[:3], rtol=1e-9)
print("ok")
"""


@pytest.mark.once   # a subprocess that hides petsc4py: not again under the other BLAS kernels
def test_without_petsc4py():
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", NO_PETSC], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
