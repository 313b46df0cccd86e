"""Direct solves (slasolve.spsolve / factorized): answers vs SciPy, multi-RHS and
transposed solves, live values with symbolic reuse (PETSc log events), adjoint
gradients (gradcheck, no refactorisation in backward), failures on every rank."""
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

import slasolve
from slasolve import FactorizationError, factorized, spsolve
from slasolve.testing import case_matrix, distribute, local_slice, replicate

pytestmark = pytest.mark.mpi

KINDS = ["spd", "nonsym", "symindef", "block2", "block2ns", "elastic2"]
SYMMETRIC = {"spd", "symindef", "block2", "elastic2"}


def _backends(comm):
    return ["petsc", "torch"] if comm.size == 1 else ["petsc"]


def _rhs(n, k=None, seed=0):
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.uniform(-1, 1, n if k is None else (n, k)))


def _gather(dA, x):
    if x.dim() == 1:
        return dA.gather(x, root=None).numpy()
    return np.stack([dA.gather(x[:, j].contiguous(), root=None).numpy() for j in range(x.shape[1])], 1)


def _events():
    from petsc4py import PETSc
    PETSc.Log.begin()  # idempotent; the log events below count only while logging is on
    names = ("MatLUFactorSym", "MatLUFactorNum", "MatCholFctrSym", "MatCholFctrNum", "MatSolve",
             "MatMatSolve", "MatSolveTranspos")  # PETSc truncates event names
    evs = {n: PETSc.Log.Event(n) for n in names}
    from slasolve import _log
    # direct solves run inside slasolve's stages (slaSolve, slaAdjoint): count in every stage
    stages = [0] + [_log.stage(s).petsc.id for s in _log.STAGE_NAMES]
    return lambda: {n: sum(e.getPerfInfo(st)["count"] for st in stages) for n, e in evs.items()}


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("partition", ["contiguous", "metis"])
def test_matches_scipy_spsolve(comm, kind, partition):
    A, _, _ = case_matrix(kind, 60, seed=1)
    dA = distribute(A, comm, partition)
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    ref = spla.spsolve(sp.csc_matrix(A), bg.numpy())
    for backend in _backends(comm):
        x, info = spsolve(dA, b, backend=backend, return_info=True)
        assert x.dtype == b.dtype and x.shape == b.shape
        assert _rel(_gather(dA, x), ref) < 1e-12
        if backend == "petsc":
            assert info.solver == "mumps"
            assert info.factorization == ("cholesky" if kind in SYMMETRIC else "lu")
            assert info.symmetric == (kind in SYMMETRIC)
            assert info.memory_mb is not None and info.memory_mb >= 0
        else:
            assert (info.solver, info.factorization) == ("superlu", "lu")
        assert info.n == A.shape[0] and info.nnz == sp.csr_matrix(A).nnz
        assert info.factor_nnz > 0 and info.fill > 0 and info.backward_error < 1e-13


@pytest.mark.parametrize("kind", ["nonsym", "block2ns", "spd"])
def test_multi_rhs_and_transpose_one_backend_call(comm, kind):
    A, _, _ = case_matrix(kind, 50, seed=2)
    dA = distribute(A, comm, "metis")
    Bg = _rhs(A.shape[0], 3, seed=3)
    B = dA.scatter(Bg, root=None)
    ref = spla.spsolve(sp.csc_matrix(A), Bg.numpy())
    refT = spla.spsolve(sp.csc_matrix(A.T), Bg.numpy())
    for backend in _backends(comm):
        F = factorized(dA, backend=backend)
        counts = _events() if backend == "petsc" else None
        c0 = counts() if counts else None
        X = F(B)
        XT = F.solve(B, transpose=True)
        assert _rel(_gather(dA, X), ref) < 1e-12
        assert _rel(_gather(dA, XT), refT) < 1e-12
        # one backend call per (n, k) right-hand side, whatever k
        assert (F.info.solves, F.info.transpose_solves, F.info.numeric_factorizations) == (1, 1, 1)
        if counts:
            c1 = counts()
            assert c1["MatMatSolve"] - c0["MatMatSolve"] == 2
            assert c1["MatSolve"] == c0["MatSolve"] and c1["MatSolveTranspos"] == c0["MatSolveTranspos"]
        # single columns agree with the block solve
        x1 = F(B[:, 1].contiguous())
        xt1 = F.solve(B[:, 1].contiguous(), transpose=True)
        assert torch.allclose(x1, X[:, 1], rtol=1e-12, atol=1e-14)
        assert torch.allclose(xt1, XT[:, 1], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("kind", ["nonsym", "spd", "block2"])
def test_live_values_refactor_numerically(comm, kind):
    A, _, _ = case_matrix(kind, 50, seed=4)
    dA = distribute(A, comm, "contiguous")
    bg = _rhs(A.shape[0], seed=5)
    b = dA.scatter(bg, root=None)
    sym, num = ("MatCholFctrSym", "MatCholFctrNum") if kind in SYMMETRIC else ("MatLUFactorSym", "MatLUFactorNum")
    for backend in _backends(comm):
        v = dA.values.detach().clone()
        A1 = dA.with_values(v)
        counts = _events() if backend == "petsc" else None
        c0 = counts() if counts else None
        F = factorized(A1, backend=backend)
        x0 = F(b)
        assert _rel(_gather(dA, x0), spla.spsolve(sp.csc_matrix(A), bg.numpy())) < 1e-12
        with torch.no_grad():  # in place, no version-counter tricks needed
            v.mul_(3.0)
        x1 = F(b)  # never the stale answer
        assert _rel(_gather(dA, x1), spla.spsolve(sp.csc_matrix(A * 3.0), bg.numpy())) < 1e-12
        F(b)  # unchanged values: no refactorisation
        assert F.info.numeric_factorizations == 2
        if backend == "petsc":
            assert F.info.symbolic_factorizations == 1
            c1 = counts()
            assert c1[sym] - c0[sym] == 1, (c0, c1)  # analysis once ...
            assert c1[num] - c0[num] == 2, (c0, c1)  # ... numeric factorisation twice
        # spsolve: new values of the same pattern reuse the cached analysis
        x2 = spsolve(dA.with_values(dA.values * 0.5), b, backend=backend)
        x3, info = spsolve(dA.with_values(dA.values * 0.25), b, backend=backend, return_info=True)
        assert _rel(_gather(dA, x2), spla.spsolve(sp.csc_matrix(A * 0.5), bg.numpy())) < 1e-12
        assert _rel(_gather(dA, x3), spla.spsolve(sp.csc_matrix(A * 0.25), bg.numpy())) < 1e-12
        if backend == "petsc":
            assert info.symbolic_factorizations == 1 and info.numeric_factorizations == 2


def test_symmetry_lost_switches_to_lu(comm):
    A, _, _ = case_matrix("spd", 40, seed=6)
    dA = distribute(A, comm, "contiguous")
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    v = dA.values.detach().clone()
    F = factorized(dA.with_values(v))
    assert F.info.factorization == "cholesky"
    C = sp.csr_matrix(A).tocoo()
    w = np.where(C.row < C.col, 0.5, 1.0) * C.data  # same pattern, upper triangle halved
    An = sp.csr_matrix((w, (C.row, C.col)), shape=A.shape)
    vn = distribute(An, comm, "contiguous").values
    with torch.no_grad():
        v.copy_(vn)
    x = F(b)
    assert F.info.factorization == "lu" and F.info.symmetric is False
    assert _rel(_gather(dA, x), spla.spsolve(sp.csc_matrix(An), bg.numpy())) < 1e-12
    for backend in _backends(comm):
        with pytest.raises(ValueError, match="symmetric"):
            spsolve(dA.with_values(vn), b, factorization="cholesky", backend=backend)
    x = spsolve(dA, b, factorization="lu", return_info=True)
    assert x[1].factorization == "lu"


@pytest.mark.parametrize("kind", ["nonsym", "spd", "block2ns"])
def test_gradcheck_values_and_rhs(comm, kind):
    """Adjoint gradients of a direct solve (values and right-hand side, transposed or not, every
    backend) against finite differences. About 8 scalar rows per rank: at one rank the full
    Jacobian is checked, two solves per matrix entry and rhs entry (8 rows: 18-32 entries; the
    same random sparse structure, diagonal and off-diagonal entries, as 16 rows with ~3x the
    solves); at 2 ranks 16 rows as before, each rank's rows coupled to the other's."""
    A, _, _ = case_matrix(kind, 8 * comm.size, seed=7)
    dA = distribute(A, comm, "contiguous")
    nnzs = comm.allgather(dA.values.shape[0])
    off = np.concatenate([[0], np.cumsum(nnzs)])
    vg = torch.cat(comm.allgather(dA.values.detach())).requires_grad_()
    bg = _rhs(A.shape[0], seed=8).requires_grad_()
    r0, r1 = dA.row_range
    for backend in _backends(comm):
        for transpose in (False, True):
            def f(v, b):
                vl = local_slice(v, off[comm.rank], off[comm.rank + 1], comm)
                bl = local_slice(b, r0, r1, comm)
                A1 = dA.with_values(vl)
                x = factorized(A1, backend=backend).solve(bl, transpose=transpose) if transpose \
                    else spsolve(A1, bl, backend=backend)
                return replicate(x, comm)
            # MUMPS's distributed solve sums contributions in message-arrival order, so two backward
            # passes through the same factors can differ in the last bits on a loaded machine (seen in CI
            # at 4 ranks); a one-rank solve is bitwise repeatable.
            nondet = 1e-12 if comm.size > 1 else 0.0
            assert torch.autograd.gradcheck(f, (vg, bg), atol=1e-7, rtol=1e-6, fast_mode=comm.size > 1,
                                            nondet_tol=nondet)


def test_multi_rhs_gradient_matches_columns(comm):
    A, _, _ = case_matrix("nonsym", 30, seed=9)
    dA = distribute(A, comm, "metis")
    B = dA.scatter(_rhs(A.shape[0], 2, seed=1), root=None)
    for backend in _backends(comm):
        v = dA.values.detach().clone().requires_grad_()
        Bq = B.clone().requires_grad_()
        X = spsolve(dA.with_values(v), Bq, backend=backend)
        slasolve.global_sum((X * X).sum()).backward()
        gv, gb = v.grad.clone(), Bq.grad.clone()
        v.grad = None
        tot = 0
        gbs = []
        for j in range(2):
            bj = B[:, j].clone().requires_grad_()
            xj = spsolve(dA.with_values(v), bj, backend=backend)
            slasolve.global_sum((xj * xj).sum()).backward()
            gbs.append(bj.grad)
        assert torch.allclose(v.grad, gv, rtol=1e-10, atol=1e-12)
        assert torch.allclose(torch.stack(gbs, 1), gb, rtol=1e-10, atol=1e-12)


def test_backward_reuses_factors(comm):
    A, _, _ = case_matrix("nonsym", 40, seed=10)
    dA = distribute(A, comm, "contiguous")
    b = dA.scatter(_rhs(A.shape[0]), root=None)
    for backend in _backends(comm):
        v = dA.values.detach().clone().requires_grad_()
        F = factorized(dA.with_values(v), backend=backend)
        counts = _events() if backend == "petsc" else None
        c0 = counts() if counts else None
        x = F(b)
        n0, t0 = F.info.numeric_factorizations, F.info.transpose_solves
        slasolve.global_sum((x * x).sum()).backward()
        assert F.info.numeric_factorizations == n0 == 1  # no refactorisation in backward
        assert F.info.transpose_solves == t0 + 1  # exactly one transposed solve
        assert v.grad is not None and torch.isfinite(v.grad).all()
        if counts:
            c1 = counts()
            assert c1["MatLUFactorNum"] == c0["MatLUFactorNum"]
            assert c1["MatSolveTranspos"] - c0["MatSolveTranspos"] == 1
        # the same through spsolve (its factorisation is cached on the layout)
        A2 = dA.with_values(v)
        x = spsolve(A2, b, backend=backend)
        cached = [f for f in dA._layout.cache("factorizations").values() if f.backend == ("petsc" if backend == "petsc"
                                                                                  else "scipy")]
        assert len(cached) == 1
        n0, t0 = cached[0].info.numeric_factorizations, cached[0].info.transpose_solves
        c0 = counts() if counts else None
        slasolve.global_sum((x * x).sum()).backward()
        assert cached[0].info.numeric_factorizations == n0
        assert cached[0].info.transpose_solves == t0 + 1
        if counts:
            assert counts()["MatLUFactorNum"] == c0["MatLUFactorNum"]
        # values changed in place between forward and backward: torch's error, no silent gradient
        x = F(b)
        with torch.no_grad():
            v.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            slasolve.global_sum((x * x).sum()).backward()
        # create_graph=True raises instead of returning incomplete second derivatives
        x = F(b.clone().requires_grad_())
        with pytest.raises(RuntimeError, match="differentiable once"):
            torch.autograd.grad(slasolve.global_sum((x * x).sum()), v, create_graph=True)


def _dup_row(A):
    C = sp.lil_matrix(A)
    C[5] = C[4]
    return sp.csr_matrix(C)


@pytest.mark.parametrize("case", ["emptyrows_ns", "dup_row", "zero_row_stored"])
def test_singular_raises_on_every_rank(comm, case):
    good = None
    if case == "dup_row":
        A = _dup_row(case_matrix("nonsym", 30, seed=11)[0])
    elif case == "zero_row_stored":
        good = sp.csr_matrix(case_matrix("spd", 30, seed=11)[0])
        A = good.copy()
        A.data[A.indptr[7]:A.indptr[8]] = 0.0  # stored zeros: structurally fine, numerically singular
    else:
        A = case_matrix(case, 30, seed=11)[0]
    dA = distribute(A, comm, "contiguous")
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    for backend in _backends(comm):
        with pytest.raises(FactorizationError, match="singular") as e:
            spsolve(dA, b, backend=backend)
        assert isinstance(e.value, slasolve.ConvergenceError) and e.value.info.reason == "DIVERGED_PC_FAILED"
        with pytest.raises(FactorizationError, match="singular"):
            factorized(dA, backend=backend)
        if good is not None:
            # the failure leaves nothing stale: good values of the same pattern solve next
            # (through the same cached layout)
            x = spsolve(dA.with_values(distribute(good, comm, "contiguous").values), b, backend=backend)
            assert _rel(_gather(dA, x), spla.spsolve(sp.csc_matrix(good), bg.numpy())) < 1e-12


def test_singular_laplacian_raises(comm):
    A = case_matrix("laplacian", 30, seed=12)[0]  # singular (constants), symmetric
    dA = distribute(A, comm, "contiguous")
    b = dA.scatter(_rhs(A.shape[0]), root=None)
    for backend in _backends(comm):
        with pytest.raises(FactorizationError):
            spsolve(dA, b, backend=backend)


def test_mumps_errors_translated_and_options_scoped(comm):
    from petsc4py import PETSc
    A = slasolve.testing.poisson_matrix((10, 10, 10))
    dA = distribute(A, comm, "contiguous")
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    if comm.size == 1:  # parallel MUMPS grows its workspace for this size: no error to provoke
        with pytest.raises(FactorizationError, match="workspace too small") as e:
            spsolve(dA, b, petsc_options={"mat_mumps_icntl_14": -90})  # ICNTL(14): workspace margin, %
        assert e.value.code in (-8, -9)
    else:
        spsolve(dA, b, petsc_options={"mat_mumps_icntl_14": -90})
    assert not PETSc.Options("direct_").hasName("mat_mumps_icntl_14")  # gone after the call
    x = spsolve(dA, b, petsc_options={"mat_mumps_icntl_14": 50})
    assert _rel(_gather(dA, x), spla.spsolve(sp.csc_matrix(A), bg.numpy())) < 1e-12


def test_nonfinite_input_raises_on_every_rank(comm):
    A = case_matrix("nonsym", 30, seed=13)[0]
    dA = distribute(A, comm, "contiguous")
    b = dA.scatter(_rhs(A.shape[0]), root=None)
    for backend in _backends(comm):
        bad_b = b.clone()
        if comm.rank == comm.size - 1:
            bad_b[0] = float("nan")
        with pytest.raises(ValueError, match="NaN"):
            spsolve(dA, bad_b, backend=backend)
        v = dA.values.detach().clone()
        A1 = dA.with_values(v)
        if comm.rank == 0:
            v[0] = float("inf")  # in place, after with_values' own check
        with pytest.raises(ValueError, match="NaN or infinite"):
            spsolve(A1, b, backend=backend)
        F = factorized(dA, backend=backend)
        with pytest.raises(ValueError, match="NaN"):
            F(bad_b)


def test_bad_arguments_raise_on_every_rank(comm):
    A = case_matrix("nonsym", 30, seed=14)[0]
    dA = distribute(A, comm, "contiguous")
    b = dA.scatter(_rhs(A.shape[0]), root=None)
    with pytest.raises(ValueError, match="factorization"):
        spsolve(dA, b, factorization="qr")
    with pytest.raises(ValueError, match="backend"):
        spsolve(dA, b, backend="cuda")
    with pytest.raises(ValueError, match="differ"):
        spsolve(dA, b, factorization="lu" if comm.rank == 0 else None) if comm.size > 1 else \
            (_ for _ in ()).throw(ValueError("differ"))
    wrong = b[:-1] if comm.rank == comm.size - 1 else b
    with pytest.raises(ValueError, match="shape"):
        spsolve(dA, wrong)
    if comm.size > 1:
        with pytest.raises(ValueError, match="one rank only"):
            spsolve(dA, b, backend="torch")
        with pytest.raises(ValueError, match="one rank only"):
            factorized(dA, backend="scipy")


def test_solve_method_direct(comm):
    A, _, _ = case_matrix("block2ns", 40, seed=15)
    dA = distribute(A, comm, "metis")
    bg = _rhs(A.shape[0])
    b = dA.scatter(bg, root=None)
    ref = spla.spsolve(sp.csc_matrix(A), bg.numpy())
    for backend in _backends(comm):
        x, info = slasolve.solve(dA, b, method="direct", backend=backend, return_info=True)
        assert info.converged and info.method == "direct" and info.pc == "lu"
        assert info.residual_norm < 1e-12 * np.linalg.norm(bg.numpy())
        assert _rel(_gather(dA, x), ref) < 1e-12
        x2 = slasolve.solve(dA, b, "direct", backend=backend, pc="lu")
        assert torch.allclose(x, x2, rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="factorization"):
        slasolve.solve(dA, b, method="direct", pc="ilu")


def test_local_inputs_single_rank():
    A, _, _ = case_matrix("nonsym", 30, seed=16)
    b = _rhs(30)
    ref = spla.spsolve(sp.csc_matrix(A), b.numpy())
    S = slasolve.SparseTensor.from_scipy(A)
    T = torch.sparse_csr_tensor(torch.from_numpy(A.indptr).long(), torch.from_numpy(A.indices).long(),
                                torch.from_numpy(A.data), A.shape)
    for backend in ["petsc", "torch"]:
        for Ain in (A, S, T):
            x = spsolve(Ain, b, backend=backend)
            assert _rel(x.numpy(), ref) < 1e-12
    # badly scaled rows and columns are not "singular" (SuperLU equilibrates, MUMPS scales)
    D = sp.diags(10.0 ** -np.arange(0, 60, 2)[:30])
    D2 = sp.diags(10.0 ** -np.linspace(0, 6, 30))
    for As in (D @ A, A @ D, D2 @ A @ D2):
        As = sp.csr_matrix(As)
        refs = spla.spsolve(sp.csc_matrix(As), b.numpy())
        for backend in ["petsc", "torch"]:
            xs = spsolve(As, b, backend=backend)
            assert _rel(xs.numpy(), refs) < 1e-10, backend
    # float32 in, float32 out (the factorisation runs in float64)
    for backend in ["petsc", "torch"]:
        x32 = spsolve(S.to(torch.float32), b.float(), backend=backend)
        assert x32.dtype == torch.float32 and _rel(x32.double().numpy(), ref) < 1e-6
    # value gradients reach a SparseTensor's values
    v = S.values.clone().requires_grad_()
    for backend in ["petsc", "torch"]:
        x = spsolve(S.with_values(v), b, backend=backend)
        x.sum().backward()
        g1 = v.grad.clone()
        v.grad = None
        # dense reference: dL/dA = -lam x^T with A^T lam = 1
        lam = np.linalg.solve(A.toarray().T, np.ones(30))
        C = A.tocoo()
        assert np.allclose(g1.numpy(), -(lam[C.row] * ref[C.col]), rtol=1e-10, atol=1e-12)


NO_PETSC = textwrap.dedent("""
    import sys
    sys.modules["petsc4py"] = None
    sys.modules["slepc4py"] = None
    import numpy as np, scipy.sparse as sp, scipy.sparse.linalg as spla, torch
    import slasolve
    from slasolve.testing import case_matrix
    assert "petsc4py.PETSc" not in sys.modules
    A = case_matrix("block2ns", 12, seed=3)[0]   # 12 rows, 64 entries: the full-Jacobian gradcheck below
    S = slasolve.SparseTensor.from_scipy(A)     # costs 2 solves per entry (30 rows: 304 entries)
    b = torch.from_numpy(np.linspace(-1, 1, A.shape[0]))
    x, info = slasolve.spsolve(S, b, return_info=True)
    assert (info.backend, info.solver) == ("scipy", "superlu"), info
    assert np.allclose(x.numpy(), spla.spsolve(sp.csc_matrix(A), b.numpy()), rtol=1e-12, atol=1e-13)
    F = slasolve.factorized(S)
    B = torch.stack([b, b * b], 1)
    assert np.allclose(F.solve(B, transpose=True).numpy(), spla.spsolve(sp.csc_matrix(A.T), B.numpy()),
                       rtol=1e-12, atol=1e-13)
    v = S.values.clone().requires_grad_()
    bq = b.clone().requires_grad_()
    assert torch.autograd.gradcheck(lambda v, b: slasolve.spsolve(S.with_values(v), b), (v, bq))
    x, info = slasolve.solve(S, b, method="direct", return_info=True)
    assert info.converged and info.backend == "scipy"
    try:
        slasolve.spsolve(S, b, backend="petsc")
    except ImportError as e:
        assert "petsc4py" in str(e)
    else:
        raise AssertionError("backend='petsc' without petsc4py must raise ImportError")
    C = sp.lil_matrix(A); C[3] = C[2]
    try:
        slasolve.spsolve(sp.csr_matrix(C), b)
    except slasolve.FactorizationError as e:
        assert "singular" in str(e)
    else:
        raise AssertionError("singular matrix must raise")
    print("OK")
""")


@pytest.mark.once   # one local subprocess, the same at every size: scripts/test.sh runs it at 1 rank only
def test_without_petsc4py(comm):
    if comm.rank != 0:  # a local subprocess; every rank asserts the same outcome below
        ok = comm.bcast(None, root=0)
    else:
        # a plain single process: without mpirun's environment (a child of an mpirun rank
        # cannot MPI_Init as a singleton)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HYDRA_"))}
        out = subprocess.run([sys.executable, "-c", NO_PETSC], capture_output=True, text=True, timeout=120,
                             env=env)
        ok = comm.bcast((out.returncode, out.stdout, out.stderr[-3000:]), root=0)
    rc, stdout, stderr = ok
    assert rc == 0, stderr
    assert "OK" in stdout


@pytest.mark.mpi
@pytest.mark.parametrize("dense", [[[0., 1, 1], [1, 0, 1], [0, 0, 1]], [[4., 1, 0], [1, 4, 1], [0, 1, 4]]])
def test_automatic_choice_on_structurally_nonsymmetric_and_symmetric(comm, dense):
    """PETSc 3.18's MatIsSymmetric segfaulted at 2 ranks on the first matrix (zero diagonal,
    structurally nonsymmetric); the symmetry test now uses an explicit transpose."""
    A = sp.csr_matrix(np.array(dense))
    dA = slasolve.DSparseTensor.from_global(A, comm)
    bg = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x, info = slasolve.spsolve(dA, dA.scatter(bg, root=None), return_info=True)
    assert np.allclose(_gather(dA, x), np.linalg.solve(np.array(dense), bg.numpy()), rtol=1e-12, atol=1e-12)
    sym = np.array_equal(np.array(dense), np.array(dense).T)
    assert info.factorization == ("cholesky" if sym else "lu")


@pytest.mark.mpi
def test_ranks_without_rows(comm):
    """A rank owning no rows takes part (a reshape of its empty residual raised on that
    rank alone and the others waited forever)."""
    A = sp.csr_matrix(np.array([[4.0, 1.0], [2.0, 5.0]]))
    N = 2
    lo = min(comm.rank, N)
    hi = N if comm.rank == comm.size - 1 else min(comm.rank + 1, N)   # ranks >= 2 own no rows
    sub = A[lo:hi]
    dA = slasolve.DSparseTensor.from_local_rows(sub.indptr.astype(np.int64), sub.indices.astype(np.int64),
                                       torch.tensor(sub.data), (N, N), comm)
    b = (torch.arange(lo, hi, dtype=torch.float64) + 1).requires_grad_()
    x = slasolve.spsolve(dA, b)
    assert np.allclose(x.detach().numpy(), np.linalg.solve(A.toarray(), [1.0, 2.0])[lo:hi])
    slasolve.global_sum(x.sum()).backward()
    assert np.allclose(b.grad.numpy(), np.linalg.solve(A.toarray().T, [1.0, 1.0])[lo:hi])
    F = slasolve.factorized(dA)
    B = torch.stack([b.detach(), 2 * b.detach()], 1)
    XT = F.solve(B, transpose=True)
    ref = np.linalg.solve(A.toarray().T, np.array([[1.0, 2.0], [2.0, 4.0]]))[lo:hi]
    assert np.allclose(XT.numpy(), ref)


@pytest.mark.mpi
@pytest.mark.parametrize("case", ["symmetric", "one_ulp", "structural", "far_symmetric", "far_one_ulp",
                                  "far_structural", "block_symmetric", "block_one_ulp", "block_far_one_ulp"])
def test_symmetry_test_agrees_with_petsc_transpose(comm, case):
    """The symmetry test (entries mirrored within a rank's rows: the pattern's cached mirror
    permutation; across ranks: a multiset hash) gives the answer of the explicit PETSc
    transpose on exactly symmetric, one-ulp-off and structurally nonsymmetric matrices, scalar
    and block, with the asymmetry near the diagonal or between the first and last row (on
    different ranks at 2+ ranks)."""
    pytest.importorskip("petsc4py")
    from slasolve.direct.petsc_backend import _exactly_symmetric
    from slasolve.petsc import create_petsc_mat
    n = 30
    R = sp.random(n, n, density=0.15, random_state=4, format="csr")
    S = (R + R.T + sp.identity(n) * 5).tolil()
    S[0, n - 1] = S[n - 1, 0] = 0.75
    if case.endswith("one_ulp"):
        i, j = (0, n - 1) if "far" in case else next((i, j) for i, j in zip(*S.nonzero()) if 0 < abs(i - j) < 3)
        S[i, j] = np.nextafter(S[i, j], np.inf)
    elif case.endswith("structural"):
        i, j = (1, n - 2) if "far" in case else (0, 2)
        S[i, j], S[j, i] = 1.0, 0.0
    S = S.tocsr()
    S.eliminate_zeros()
    if case.startswith("block"):
        S = sp.kron(S, sp.csr_matrix(np.array([[2.0, 0.5], [0.5, 3.0]]))).tobsr((2, 2))
    dA = slasolve.DSparseTensor.from_global(S, comm)
    mat = create_petsc_mat(dA, "aij")
    try:
        fast = _exactly_symmetric(mat, dA)
        reference = _exactly_symmetric(mat)
    finally:
        mat.destroy()
    assert fast == reference == case.endswith("symmetric"), (fast, reference)
