"""Public Krylov API: solutions vs SciPy, iteration counts vs PETSc, failures, adjoint gradients."""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve import ConvergenceError, DSparseTensor
from slasolve.testing import local_slice, replicate

pytestmark = pytest.mark.mpi
BACKENDS = ["petsc", "torch"]


def poisson2d(n):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    return (sp.kron(I, D) + sp.kron(D, I)).tocsr()


def poisson3d(n):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    return (sp.kron(sp.kron(I, I), D) + sp.kron(sp.kron(I, D), I) + sp.kron(sp.kron(D, I), I)).tocsr()


def convdiff(n, c=0.4):
    """Upwinded 2-D convection-diffusion: nonsymmetric."""
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    Cv = sp.diags([-c, c], [-1, 0], (n, n))
    return (sp.kron(I, D + Cv) + sp.kron(D + Cv, I)).tocsr()


def elasticity_like(nb=30, bs=2, seed=0):
    """SPD block matrix (bs x bs blocks): Poisson (x) SPD block + shift."""
    K = sp.diags([-1, 2, -1], [-1, 0, 1], (nb, nb))
    B = np.array([[2.0, 0.5], [0.5, 1.0]]) if bs == 2 else np.eye(bs) * 2 + 0.3
    return (sp.kron(K, B) + 0.1 * sp.identity(nb * bs)).tobsr((bs, bs))


@pytest.fixture
def comm():
    return MPI.COMM_WORLD


def _rhs(n):
    return torch.from_numpy(np.sin(np.arange(n) * 0.37) + 0.5)


CASES = [
    ("cg", poisson2d(14), "metis"),
    ("minres", poisson3d(7), "contiguous"),
    ("cg", elasticity_like(), "contiguous"),
    ("gmres", convdiff(13), "metis"),
    ("bicgstab", convdiff(13), "contiguous"),
    ("cgs", convdiff(13), "metis"),
    ("tfqmr", convdiff(13), "contiguous"),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method,A,partition", CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
@pytest.mark.parametrize("pc", [None, "jacobi", "ilu"])
def test_solution_matches_spsolve(comm, backend, method, A, partition, pc):
    dA = DSparseTensor.from_global(A, comm, partition=partition)
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    x, info = slasolve.solve(dA, b, method, backend=backend, pc=pc, rtol=1e-10, return_info=True)
    assert info.converged and info.reason in ("CONVERGED_RTOL", "CONVERGED_ATOL")
    xg = dA.gather(x, root=None).numpy()
    ref = spla.spsolve(sp.csc_matrix(A), bg.numpy())
    assert np.linalg.norm(xg - ref) <= 1e-8 * np.linalg.norm(ref)
    r = bg.numpy() - A @ xg
    assert np.linalg.norm(r) <= 1.05e-10 * np.linalg.norm(bg.numpy()) or info.reason == "CONVERGED_ATOL"


@pytest.mark.parametrize("method,A", [("cg", poisson2d(12)), ("gmres", convdiff(12)),
                                      ("bicgstab", convdiff(12)), ("minres", poisson2d(12)),
                                      ("cgs", convdiff(12)), ("tfqmr", convdiff(12))])
def test_iterations_equal_petsc_own_count(comm, method, A):
    from petsc4py import PETSc
    dA = DSparseTensor.from_global(A, comm)
    b = dA.scatter(_rhs(A.shape[0]), root=None)
    x, info = slasolve.solve(dA, b, method, backend="petsc", rtol=1e-8, pc="jacobi", return_info=True)
    # raw petsc4py with the same options on the same Mat
    mat = dA.to_petsc()
    ksp = PETSc.KSP().create(comm=comm)
    ksp.setOperators(mat)
    ksp.setType({"cg": "cg", "gmres": "gmres", "bicgstab": "bcgs", "minres": "minres", "cgs": "cgs",
                 "tfqmr": "tfqmr"}[method])
    ksp.getPC().setType("jacobi")
    if method in ("gmres", "bicgstab", "cgs", "tfqmr"):
        ksp.setPCSide(PETSc.PC.Side.RIGHT)
    if method != "minres":
        ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.setTolerances(rtol=1e-8, atol=0.0, divtol=1e300)   # slasolve has no divergence test (CGS
    B = mat.createVecLeft()                                 # passes 1e5 ||b|| on the way here)
    B.getArray()[:] = b.numpy()
    X = mat.createVecRight()
    ksp.solve(B, X)
    assert info.iterations == ksp.getIterationNumber()
    assert np.allclose(X.getArray(), x.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("method,A", [("cg", poisson2d(10)), ("gmres", convdiff(10))])
def test_backends_agree_across_rank_counts(comm, method, A):
    """The distributed solution equals a one-rank (COMM_SELF) solve of the global matrix."""
    bg = _rhs(A.shape[0])
    ref = slasolve.solve(slasolve.SparseTensor.from_scipy(A), bg, method, rtol=1e-12)
    dA = DSparseTensor.from_global(A, comm, partition="metis")
    for backend in BACKENDS:
        x = slasolve.solve(dA, dA.scatter(bg, root=None), method, backend=backend, rtol=1e-12)
        assert torch.allclose(dA.gather(x, root=None), ref, rtol=1e-9, atol=1e-10)


def test_scipy_and_torch_inputs_single_rank():
    A = poisson2d(8)
    b = _rhs(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b.numpy())
    for op in (A, torch.sparse_csr_tensor(torch.from_numpy(A.indptr), torch.from_numpy(A.indices),
                                          torch.from_numpy(A.data), A.shape)):
        for backend in BACKENDS:
            x = slasolve.solve(op, b, "cg", backend=backend, rtol=1e-12)
            assert np.allclose(x.numpy(), ref, atol=1e-9)
    x, info = slasolve.cg(A, b, rtol=1e-12, backend="torch")
    assert info.converged and np.allclose(x.numpy(), ref, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_multiple_rhs(comm, backend):
    A = poisson2d(10)
    dA = DSparseTensor.from_global(A, comm)
    Bg = torch.stack([_rhs(100), torch.ones(100, dtype=torch.float64)], 1)
    B = dA.scatter(Bg, root=None)
    X = slasolve.solve(dA, B, "cg", backend=backend, rtol=1e-12)
    ref = spla.spsolve(A.tocsc(), Bg.numpy())
    assert np.allclose(dA.gather(X, root=None).numpy(), ref, atol=1e-9)


@pytest.mark.parametrize("backend", BACKENDS)
def test_failure_paths_raise_on_every_rank(comm, backend):
    A = poisson2d(10)
    dA = DSparseTensor.from_global(A, comm)
    b = dA.scatter(_rhs(100), root=None)
    # maxiter too small
    with pytest.raises(ConvergenceError) as e:
        slasolve.solve(dA, b, "cg", backend=backend, maxiter=3)
    assert e.value.info.reason == "DIVERGED_ITS" and e.value.info.iterations == 3
    x, info = slasolve.solve(dA, b, "cg", backend=backend, maxiter=3, raise_on_fail=False, return_info=True)
    assert not info.converged and info.reason == "DIVERGED_ITS"
    # indefinite matrix to CG
    Aind = (A - 4.0 * sp.identity(100)).tocsr()
    dI = DSparseTensor.from_global(Aind, comm)
    with pytest.raises(ConvergenceError) as e:
        slasolve.solve(dI, b, "cg", backend=backend, maxiter=500)
    assert e.value.info.reason in ("DIVERGED_INDEFINITE_MAT", "DIVERGED_INDEFINITE_PC", "DIVERGED_BREAKDOWN")
    # NaN in b on rank 0 only: every rank raises
    bn = b.clone()
    if comm.rank == 0:
        bn[0] = float("nan")
    with pytest.raises(ConvergenceError) as e:
        slasolve.solve(dA, bn, "cg", backend=backend)
    assert e.value.info.reason == "DIVERGED_NANORINF"
    # singular matrix (a zero row/column): no convergence to the requested tolerance
    S = A.tolil()
    S[5, :] = 0
    S[:, 5] = 0
    dS = DSparseTensor.from_global(S.tocsr(), comm)
    bs = dS.scatter(torch.ones(100, dtype=torch.float64), root=None)
    with pytest.raises(ConvergenceError) as e:
        slasolve.solve(dS, bs, "gmres", backend=backend, maxiter=200, rtol=1e-10)
    assert e.value.info.reason.startswith("DIVERGED")


def test_bad_rhs_on_one_rank_raises_everywhere(comm):
    A = poisson2d(6)
    dA = DSparseTensor.from_global(A, comm)
    b = torch.ones(dA.n_local + (1 if comm.rank == comm.size - 1 else 0), dtype=torch.float64)
    with pytest.raises(ValueError, match="owned rows"):
        slasolve.solve(dA, b)
    b32 = torch.ones(dA.n_local, dtype=torch.float32 if comm.rank == 0 else torch.float64)
    with pytest.raises(TypeError, match="dtype"):
        slasolve.solve(dA, b32)
    with pytest.raises(ValueError, match="method"):
        slasolve.solve(dA, torch.ones(dA.n_local, dtype=torch.float64), "qmr")
    with pytest.raises(ValueError, match="pc"):
        slasolve.solve(dA, torch.ones(dA.n_local, dtype=torch.float64), pc="nonsense")


def test_callback_history_options_and_cache(comm):
    A = poisson2d(12)
    dA = DSparseTensor.from_global(A, comm)
    b = dA.scatter(_rhs(144), root=None)
    seen = []
    x, info = slasolve.solve(dA, b, "cg", rtol=1e-8, callback=lambda it, r: seen.append((it, r)),
                             record_history=True, return_info=True)
    assert [s[0] for s in seen] == list(range(1, info.iterations + 1))
    assert len(info.residual_history) == info.iterations + 1
    assert info.residual_history[-1] == pytest.approx(info.residual_norm)
    # options database: -ksp_type through petsc_options overrides method
    x2, info2 = slasolve.solve(dA, b, "cg", rtol=1e-8, options_prefix="t1_",
                               petsc_options={"ksp_type": "gmres", "ksp_max_it": 5},
                               raise_on_fail=False, return_info=True)
    assert info2.iterations <= 5
    # the KSP is cached on the layout and reused; new values refill the same Mat
    solver_count = len(dA._layout.cache("solvers"))
    dB = dA.with_values(dA.values * 2.0)
    x3 = slasolve.solve(dB, b, "cg", rtol=1e-10)
    assert len(dA._layout.cache("solvers")) == solver_count
    assert dB.to_petsc() is dA.to_petsc()
    x4 = slasolve.solve(dA, b, "cg", rtol=1e-10)
    assert torch.allclose(x3 * 2.0, x4, atol=1e-8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method,A", [("cg", poisson2d(5)), ("gmres", convdiff(5)),
                                      ("bicgstab", convdiff(5)), ("cgs", convdiff(5)), ("tfqmr", convdiff(5))])
def test_gradcheck_values_and_rhs(comm, backend, method, A):
    if comm.size > A.shape[0] // 2:
        pytest.skip("too many ranks for this tiny matrix")
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    nnzs = comm.allgather(dA.values.numel())
    off = np.concatenate([[0], np.cumsum(nnzs)])
    vg = torch.cat(comm.allgather(dA.values.detach())).requires_grad_()
    bg = _rhs(A.shape[0]).requires_grad_()
    r0, r1 = dA.row_range

    def f(v, b):
        vl = local_slice(v, off[comm.rank], off[comm.rank + 1], comm)
        bl = local_slice(b, r0, r1, comm)
        x = slasolve.solve(dA.with_values(vl), bl, method, backend=backend, rtol=1e-13, atol=1e-15)
        return replicate(x, comm)

    # full Jacobians on one rank; random projections (far fewer solves) on several
    assert torch.autograd.gradcheck(f, (vg, bg), atol=1e-6, rtol=1e-5, fast_mode=comm.size > 1)


def test_gradient_of_values_matches_dense_formula(comm):
    """dL/dA = -lam x^T restricted to the pattern, on a block matrix with a metis partition."""
    A = elasticity_like(nb=12)
    dA = DSparseTensor.from_global(A, comm, partition="metis")
    v = dA.values.detach().clone().requires_grad_()
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    x = slasolve.solve(dA.with_values(v), b, "cg", rtol=1e-13)
    w = dA.scatter(torch.linspace(0, 1, A.shape[0], dtype=torch.float64), root=None)
    (x * w).sum().backward()
    # dense reference on every rank
    Ad = A.toarray()
    xs = np.linalg.solve(Ad, bg.numpy())
    perm = torch.as_tensor(dA.spec.partition.perm)
    wg = torch.linspace(0, 1, A.shape[0], dtype=torch.float64).numpy()
    lam = np.linalg.solve(Ad.T, wg)
    G = -np.outer(lam, xs)
    # compare the local values' gradients entry by entry
    loc = dA.local
    br, bc = loc.block_shape
    rows_blk = loc.row_indices().numpy() + dA._layout.rstart
    cols_blk = loc.indices.numpy()
    old_rows = perm.numpy()[rows_blk]
    old_cols = perm.numpy()[cols_blk]
    ii = old_rows[:, None, None] * br + np.arange(br)[None, :, None]
    jj = old_cols[:, None, None] * bc + np.arange(bc)[None, None, :]
    ref = G[ii, jj]
    assert np.allclose(v.grad.numpy(), ref, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("pc", ["gamg", "hypre", "asm", "bjacobi", "icc", "lu", "cholesky"])
def test_petsc_preconditioners(comm, pc):
    A = poisson2d(16)
    dA = DSparseTensor.from_global(A, comm, partition="metis")
    bg = _rhs(256)
    x, info = slasolve.solve(dA, dA.scatter(bg, root=None), "cg", pc=pc, rtol=1e-10, return_info=True)
    ref = spla.spsolve(A.tocsc(), bg.numpy())
    assert info.converged
    assert np.allclose(dA.gather(x, root=None).numpy(), ref, atol=1e-8)
    if pc in ("lu", "cholesky"):
        assert info.iterations <= 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_user_callable_preconditioner(comm, backend):
    A = poisson2d(12)
    dA = DSparseTensor.from_global(A, comm)
    d = dA.diagonal()
    calls = []

    def jac(r):
        calls.append(1)
        return r / d

    b = dA.scatter(_rhs(144), root=None)
    x, info = slasolve.cg(dA, b, M=jac, rtol=1e-10, backend=backend)
    x2, info2 = slasolve.cg(dA, b, pc="jacobi", rtol=1e-10, backend=backend)
    assert calls and info.converged and torch.allclose(x, x2, atol=1e-8)
    assert abs(info.iterations - info2.iterations) <= 1


def test_ksp_monitor_and_progress(comm, capfd):
    A = poisson2d(8)
    dA = DSparseTensor.from_global(A, comm)
    b = dA.scatter(_rhs(64), root=None)
    slasolve.solve(dA, b, "cg", options_prefix="mon_", petsc_options={"ksp_monitor": None}, rtol=1e-8)
    slasolve.solve(dA, b, "cg", backend="torch", progress=2, rtol=1e-8)
    out = capfd.readouterr().out
    if comm.rank == 0:
        assert "KSP Residual norm" in out
        assert "iteration      2  residual" in out


@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_values_single_rank(backend):
    A = slasolve.SparseTensor.from_scipy(poisson2d(6))
    scales = torch.tensor([1.0, 2.0, 0.5], dtype=torch.float64)
    v = (A.values[None, :] * scales[:, None]).clone().requires_grad_()
    Ab = A.with_values(v)
    b = torch.stack([_rhs(36)] * 3)
    x = slasolve.solve(Ab, b, "cg", backend=backend, rtol=1e-12)
    x1 = slasolve.solve(A, _rhs(36), "cg", backend=backend, rtol=1e-12)
    assert torch.allclose(x.detach(), x1[None] / scales[:, None], atol=1e-9)
    x.sum().backward()
    assert v.grad is not None and v.grad.shape == v.shape


def _distributed_case(kind):
    """A 20-row matrix of the named family (SciPy) and its row shard on COMM_WORLD."""
    from slasolve.testing import case_matrix, distribute
    A, coords, _ = case_matrix(kind, 20, 0)
    return A, distribute(A, MPI.COMM_WORLD, "contiguous", coords, 0)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["cg", "gmres"])
def test_singular_inconsistent_system_is_never_converged(method):
    # GMRES + GAMG on a singular Laplacian with an inconsistent b reported CONVERGED_RTOL
    # from its least-squares residual (1e-9) while ||b - A x|| was ~1
    A, dA = _distributed_case("laplacian")
    bg = np.random.default_rng(1).standard_normal(A.shape[0])
    b = dA.scatter(torch.from_numpy(bg), root=None)
    x, info = slasolve.solve(dA, b, method, pc="gamg", rtol=1e-8, return_info=True, raise_on_fail=False)
    true = np.linalg.norm(bg - A @ dA.gather(x, root=None).numpy())
    assert not info.converged or true <= 1e-8 * np.linalg.norm(bg) * (1 + 1e-6)


@pytest.mark.mpi
@pytest.mark.parametrize("pc", ["ilu", "gamg"])
def test_zero_diagonal_rows_raise_on_every_rank(pc):
    # empty rows on some ranks only: PETSc's set-up failed there, inside collective set-up
    # (ILU: lazily in KSPSolve), and the other ranks hung
    A, dA = _distributed_case("emptyrows")
    b = dA.scatter(torch.ones(A.shape[0], dtype=torch.float64), root=None)
    with pytest.raises(ValueError, match="diagonal"):
        slasolve.solve(dA, b, "gmres", pc=pc, rtol=1e-8)


@pytest.mark.mpi
@pytest.mark.parametrize("method", ["cg", "minres"])
def test_symmetric_methods_with_asm(comm, method):
    """PETSc's default restricted additive Schwarz is not symmetric: CG stalled with it
    (2000 iterations on 72 unknowns at 3 ranks). Symmetric methods get the basic variant."""
    T = lambda m: sp.diags([-np.ones(m - 1), 2 * np.ones(m), -np.ones(m - 1)], [-1, 0, 1])  # noqa: E731
    A = (sp.kron(T(9), sp.eye(8)) + sp.kron(sp.eye(9), T(8))).tocsr()
    dA = DSparseTensor.from_global(A, comm)
    bg = _rhs(72)
    x, info = slasolve.solve(dA, dA.scatter(bg, root=None), method, pc="asm", rtol=1e-10, maxiter=200,
                             return_info=True)
    assert info.converged and info.iterations < 60
    ref = spla.spsolve(A.tocsc(), bg.numpy())
    assert np.allclose(dA.gather(x, root=None).numpy(), ref, atol=1e-8)


@pytest.mark.parametrize("method,A", [("cg", poisson2d(12)), ("gmres", convdiff(12)), ("tfqmr", convdiff(12))])
def test_sor_preconditioner_vs_spsolve_and_petsc(comm, method, A):
    """pc="sor" (one registration): PETSc's local symmetric SOR, the same iterations as raw
    petsc4py with PCSOR, the answer SciPy's; the torch backend names its own preconditioners."""
    pytest.importorskip("petsc4py")
    from petsc4py import PETSc
    dA = DSparseTensor.from_global(A, comm)
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    x, info = slasolve.solve(dA, b, method, pc="sor", rtol=1e-10, return_info=True)
    assert info.converged and info.pc == "sor"
    ref = spla.spsolve(sp.csc_matrix(A), bg.numpy())
    assert np.linalg.norm(dA.gather(x, root=None).numpy() - ref) <= 1e-8 * np.linalg.norm(ref)
    mat = dA.to_petsc()
    ksp = PETSc.KSP().create(comm=comm)
    ksp.setOperators(mat)
    ksp.setType({"cg": "cg", "gmres": "gmres", "tfqmr": "tfqmr"}[method])
    ksp.getPC().setType("sor")
    if method != "cg":
        ksp.setPCSide(PETSc.PC.Side.RIGHT)
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.setTolerances(rtol=1e-10, atol=0.0)
    B, X = mat.createVecLeft(), mat.createVecRight()
    B.getArray()[:] = b.numpy()
    ksp.solve(B, X)
    assert info.iterations == ksp.getIterationNumber()
    ksp.destroy()
    with pytest.raises(ValueError, match="not available in the torch backend.*jacobi"):
        slasolve.solve(dA, b, method, pc="sor", backend="torch")


def test_registry_names_reach_every_family():
    """A registered Krylov method is accepted by solve, nonlinear_solve's linear_solver and the
    SciPy-signature functions; an unknown one is refused with the registered names."""
    from slasolve import linalg
    from slasolve.registry import KRYLOV_METHODS
    A = convdiff(6)
    b = _rhs(A.shape[0])
    ref = spla.spsolve(A.tocsc(), b.numpy())
    for name, m in KRYLOV_METHODS.items():
        if m.symmetric:
            continue
        for backend in BACKENDS:
            x = slasolve.solve(A, b, name, backend=backend, rtol=1e-12)
            assert np.allclose(x.numpy(), ref, rtol=1e-9, atol=1e-11), (name, backend)
        xs, info = getattr(linalg, name)(A, b.numpy(), rtol=1e-12)
        assert info == 0 and np.allclose(xs, ref, rtol=1e-9, atol=1e-11), name
    with pytest.raises(ValueError, match="tfqmr"):
        slasolve.solve(A, b, "qmr")
