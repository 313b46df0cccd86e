"""SPMD faults in user code and per-rank mismatches (issue 18), at any rank count:

* user code that slasolve calls inside a solve (a Krylov callback, a callable
  preconditioner, a ``LinearOperator``/``M``/callback given to ``slasolve.linalg``, the
  residual/Jacobian/callback of ``nonlinear_solve``) raising on ONE rank: every rank
  leaves the solve and raises -- the original exception where it happened, the same
  message naming that rank elsewhere -- and the next solve on the same objects works;
* ``requires_grad`` on some ranks only: ``ValueError`` on every rank in the forward;
* a replicated ``LinearOperator`` that differs on one rank: ``ValueError`` everywhere.

Each MPI run is under test.sh's timeout: a hang fails the run.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI
from scipy.sparse.linalg import LinearOperator

import slasolve
import slasolve.linalg as L
from slasolve.eigen import eigsh
from slasolve.testing import distribute

COMM = MPI.COMM_WORLD
N = 40
A_GLOBAL = sp.diags([-1.0, 2.3, -1.0], [-1, 0, 1], shape=(N, N), format="csr")
BACKENDS = ("petsc", "torch")


class Boom(Exception):
    pass


def failing_rank():
    return COMM.size - 1


def bad_after(calls, k):
    """A side effect that raises on the last rank at its k-th call."""
    calls.append(1)
    if COMM.rank == failing_rank() and len(calls) == k:
        raise Boom("user code failed")


def expect_everywhere(fn):
    """Run ``fn``; the last rank must raise Boom, the others an error naming it."""
    if COMM.rank == failing_rank():
        with pytest.raises(Boom, match="user code failed"):
            fn()
    else:
        with pytest.raises(Exception, match=rf"user code failed \(on rank {failing_rank()}"):
            fn()


def system():
    dA = distribute(A_GLOBAL, COMM)
    return dA, torch.ones(dA.n_local, dtype=torch.float64)


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
def test_solve_callback_raising_on_one_rank(backend):
    dA, b = system()
    calls = []
    expect_everywhere(lambda: slasolve.solve(dA, b, "cg", backend=backend,
                                             callback=lambda it, r: bad_after(calls, 3)))
    x = slasolve.solve(dA, b, "cg", backend=backend, rtol=1e-10)   # the same objects still work
    assert float(slasolve.global_sum(((dA @ x) - b).norm() ** 2)) < 1e-16


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["cg", "gmres"])
def test_solve_callable_preconditioner_raising_on_one_rank(backend, method):
    dA, b = system()
    calls = []

    def pc(r):
        bad_after(calls, 4)
        return r / 2.3
    expect_everywhere(lambda: slasolve.solve(dA, b, method, backend=backend, pc=pc))
    x = slasolve.solve(dA, b, method, backend=backend, pc=lambda r: r / 2.3, rtol=1e-10)
    assert float(slasolve.global_sum(((dA @ x) - b).norm() ** 2)) < 1e-16


@pytest.mark.mpi
@pytest.mark.parametrize("what", ["A", "M", "callback"])
@pytest.mark.parametrize("method", ["cg", "gmres", "minres", "bicgstab"])
def test_linalg_user_operator_raising_on_one_rank(what, method):
    calls = []
    f = getattr(L, method)

    def op(v):
        bad_after(calls, 3)
        return A_GLOBAL @ v
    kw = {"comm": COMM}
    if method != "minres":
        kw["atol"] = 0.0
    if method == "gmres":
        kw["callback_type"] = "pr_norm"
    if what == "A":
        args = (LinearOperator((N, N), matvec=op, dtype=float),)
    elif what == "M":
        args = (A_GLOBAL,)
        kw["M"] = LinearOperator((N, N), matvec=lambda v: (bad_after(calls, 3), v / 2.3)[1], dtype=float)
    else:
        args = (A_GLOBAL,)
        kw["callback"] = lambda *a: bad_after(calls, 2)
    expect_everywhere(lambda: f(*args, np.ones(N), **kw))
    x, info = f(A_GLOBAL, np.ones(N), comm=COMM, **({"atol": 0.0} if method != "minres" else {}))
    assert info == 0


@pytest.mark.mpi
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["residual", "jacobian", "callback"])
def test_nonlinear_user_code_raising_on_one_rank(backend, where):
    dA, _ = system()
    calls = []
    p = torch.ones(dA.n_local, dtype=torch.float64)

    def residual(u, p):
        r = dA @ u + u ** 3 - p    # (a raise before this product's halo exchange would be a
        if where == "residual":    # collective skipped on one rank inside the user's own code)
            bad_after(calls, 3)
        return r

    def jacobian(u, p):
        J = _plus_diag(dA.detach(), 3 * u ** 2)   # with_values is collective: raise after it
        if where == "jacobian":
            bad_after(calls, 2)
        return J

    cb = (lambda it, fnorm: bad_after(calls, 2)) if where == "callback" else None
    u0 = torch.zeros(dA.n_local, dtype=torch.float64)
    expect_everywhere(lambda: slasolve.nonlinear_solve(residual, u0, p, jacobian=jacobian, backend=backend,
                                                       callback=cb, comm=COMM))
    u = slasolve.nonlinear_solve(lambda u, p: dA @ u + u ** 3 - p, u0, p, jacobian=lambda u, p: _plus_diag(
        dA.detach(), 3 * u ** 2), backend=backend, rtol=1e-10, comm=COMM)
    r = dA @ u + u ** 3 - p
    assert float(slasolve.global_sum(r.norm() ** 2)) ** 0.5 < 1e-8


def _plus_diag(dA, d):
    """``A + diag(d)`` on ``A``'s pattern (the tridiagonal stores every diagonal entry)."""
    L_ = dA.local
    r0 = dA.row_range[0]
    rows = L_.row_indices()
    on_diag = L_.indices == rows + r0
    vals = dA.values.clone()
    vals[on_diag] += d[rows[on_diag]]
    return dA.with_values(vals)


# --------------------------------------------------------- settings that differ per rank
@pytest.mark.mpi
@pytest.mark.parametrize("call", ["solve", "spsolve", "eigsh", "nonlinear"])
def test_requires_grad_on_some_ranks_raises_everywhere(call):
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    dA, b = system()
    if COMM.rank == 0:
        dA.values.requires_grad_(True)
    with pytest.raises(ValueError, match="must be the same on every rank"):
        if call == "solve":
            slasolve.solve(dA, b, "cg")
        elif call == "spsolve":
            slasolve.spsolve(dA, b)
        elif call == "eigsh":
            eigsh(dA, 2)
        else:
            p = torch.ones(3, dtype=torch.float64, requires_grad=COMM.rank == 0)
            slasolve.nonlinear_solve(lambda u, p: u + u ** 3 - p, torch.zeros(3, dtype=torch.float64), p,
                                     backend="torch", comm=COMM)


@pytest.mark.mpi
def test_replicated_linear_operator_differing_on_one_rank_raises():
    if COMM.size == 1:
        pytest.skip("needs two ranks")
    B = A_GLOBAL * (1.5 if COMM.rank == failing_rank() else 1.0)
    op = LinearOperator((N, N), matvec=lambda v: B @ v, dtype=float)
    with pytest.raises(ValueError, match="not the same operator on every rank"):
        L.cg(op, np.ones(N), atol=0.0, comm=COMM)
    op = LinearOperator((N, N), matvec=lambda v: A_GLOBAL @ v, dtype=float)
    x, info = L.cg(op, np.ones(N), atol=0.0, comm=COMM)
    assert info == 0 and np.linalg.norm(A_GLOBAL @ x - 1.0) <= 1e-5 * np.sqrt(N)
