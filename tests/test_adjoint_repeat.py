"""The backward of a CG / MINRES solve whose adjoint system is the forward one.

With the petsc backend, CG and MINRES solve ``A^T lam = g`` with the forward's KSP on ``A``
itself. When ``g`` equals the forward's ``b`` on every rank and both start from the same
initial guess (the compliance ``f . u`` of topology optimisation), the adjoint solve would
repeat the forward solve, so the forward's answer is returned (``info.adjoint.same_as_forward``).

Checks: the gradients equal SciPy's (``lam = A^-1 g``; value gradient ``-lam_i x_j``) and
``torch.autograd.gradcheck``; the shortcut is taken only when every condition holds on every
rank (a right-hand side that differs on one rank, GMRES, a user ``x0``, a callable
preconditioner, ``b`` changed in place after the solve); warm starts (``x0="previous"``)
keep it. Run serially and under mpirun -n 2 / 3 / 4 with --with-mpi.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve import DSparseTensor
from slasolve.testing import global_offsets, local_slice

pytestmark = [pytest.mark.mpi, pytest.mark.skipif(slasolve.krylov.default_backend() != "petsc",
                                                  reason="the petsc backend's symmetric adjoint path")]
COMM = MPI.COMM_WORLD


def poisson2d(n):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    return (sp.kron(I, D) + sp.kron(D, I)).tocsr()


def system(n=9, scale=None):
    A = poisson2d(n)
    if scale is not None:  # a symmetric rescaling D A D (new values, still SPD)
        d = sp.diags(1.0 + scale * np.sin(np.arange(A.shape[0])))
        A = (d @ A @ d).tocsr()
    dA = DSparseTensor.from_global(A, COMM, partition="contiguous")
    r0, r1 = dA.row_range
    bg = np.cos(np.arange(A.shape[0]) * 0.37) + 0.5
    return A, dA, bg, r0, r1


def reference_grads(A, dA, bg, fg, r0, r1):
    """SciPy: x = A^-1 b, lam = A^-1 f; d(f.x)/db = lam, d(f.x)/dA_ij = -lam_i x_j (this
    rank's stored entries, in their order)."""
    x = spla.spsolve(A.tocsc(), bg)
    lam = spla.spsolve(A.tocsc(), fg)
    loc = dA.local
    rows = np.repeat(np.arange(r0, r1), np.diff(loc.indptr.numpy()))
    return lam[r0:r1], -lam[rows] * x[loc.indices.numpy()]


def run(dA, b, f, *, values=None, **kw):
    vals = (dA.values.detach().clone() if values is None else values).requires_grad_(True)
    b = b.clone().requires_grad_(True)
    x, info = slasolve.solve(dA.with_values(vals), b, kw.pop("method", "cg"), rtol=1e-12, return_info=True,
                             **kw)
    slasolve.global_sum((f * x).sum()).backward()
    return x, info, b.grad, vals.grad


def assert_close(got, ref, tol=1e-8):
    err = COMM.allreduce(float(np.abs(got.detach().numpy() - ref).max(initial=0.0)), op=MPI.MAX)
    nrm = COMM.allreduce(float(np.abs(ref).max(initial=0.0)), op=MPI.MAX)
    assert err <= tol * nrm, (err, nrm)


@pytest.mark.parametrize("method, pc", [("cg", "gamg"), ("cg", "jacobi"), ("minres", "jacobi")])
def test_compliance_takes_the_forward_answer(method, pc):
    A, dA, bg, r0, r1 = system()
    b = torch.from_numpy(bg[r0:r1])
    x, info, gb, gv = run(dA, b, b, method=method, pc=pc)
    assert info.adjoint.same_as_forward and info.adjoint.iterations == 0 and info.adjoint.converged
    assert not info.same_as_forward and info.iterations > 0
    ref_b, ref_v = reference_grads(A, dA, bg, bg, r0, r1)
    assert_close(gb, ref_b)
    assert_close(gv, ref_v)
    assert torch.equal(gb, x.detach())  # bitwise the forward's answer, not a copy of b


@pytest.mark.parametrize("case", ["one_rank_differs", "gmres", "user_x0", "callable_pc"])
def test_no_shortcut_unless_every_condition_holds(case):
    A, dA, bg, r0, r1 = system()
    b = torch.from_numpy(bg[r0:r1])
    fg = bg.copy()
    kw = {}
    if case == "one_rank_differs":  # the last rank's weights differ in one entry (or the only rank's)
        last = COMM.size - 1
        lo = A.shape[0] * last // COMM.size
        fg[min(lo, A.shape[0] - 1)] += 1.0
    elif case == "gmres":
        kw = dict(method="gmres", pc="jacobi")
    elif case == "user_x0":
        kw = dict(x0=torch.full((r1 - r0,), 0.1, dtype=torch.float64))
    else:
        d = torch.from_numpy(A.diagonal()[r0:r1].copy())
        kw = dict(pc=lambda r: r / d)
    f = torch.from_numpy(fg[r0:r1])
    _, info, gb, gv = run(dA, b, f, **kw)
    assert not info.adjoint.same_as_forward and info.adjoint.iterations > 0
    ref_b, ref_v = reference_grads(A, dA, bg, fg, r0, r1)
    assert_close(gb, ref_b)
    assert_close(gv, ref_v)


def test_b_changed_in_place_after_the_solve():
    """The comparison is with the b the forward solved (kept), not with b's storage now."""
    A, dA, bg, r0, r1 = system()
    vals = dA.values.detach().clone().requires_grad_(True)
    b = torch.from_numpy(bg[r0:r1].copy())
    x = slasolve.solve(dA.with_values(vals), b, "cg", pc="jacobi", rtol=1e-12)
    f = b.clone()
    with torch.no_grad():
        b.mul_(3.0)   # now g = f differs from b's storage, but equals the b that was solved
    slasolve.global_sum((f * x).sum()).backward()
    _, ref_v = reference_grads(A, dA, bg, bg, r0, r1)
    assert_close(vals.grad, ref_v)
    # and the other way round: weights equal to the new b are not the forward's system
    vals2 = dA.values.detach().clone().requires_grad_(True)
    b2 = torch.from_numpy(bg[r0:r1].copy())
    x2, info2 = slasolve.solve(dA.with_values(vals2), b2, "cg", pc="jacobi", rtol=1e-12, return_info=True)
    with torch.no_grad():
        b2.mul_(3.0)
    slasolve.global_sum((b2 * x2).sum()).backward()
    assert not info2.adjoint.same_as_forward
    _, ref_v2 = reference_grads(A, dA, bg, 3.0 * bg, r0, r1)
    assert_close(vals2.grad, ref_v2)


@pytest.mark.parametrize("reuse_pc", [False, "lagged", "interpolation"])
def test_warm_started_loop(reuse_pc):
    """x0="previous" over new values: forward and adjoint start from equal iterates, so
    every backward takes the forward answer; gradients equal SciPy's at every step."""
    for k, scale in enumerate([None, 0.1, 0.2]):
        A, dA, bg, r0, r1 = system(scale=scale)
        b = torch.from_numpy(bg[r0:r1])
        _, info, gb, gv = run(dA, b, b, pc="gamg", x0="previous", reuse_pc=reuse_pc,
                              options_prefix=f"adjrep_{reuse_pc}_")
        assert info.adjoint.same_as_forward, k
        ref_b, ref_v = reference_grads(A, dA, bg, bg, r0, r1)
        assert_close(gb, ref_b)
        assert_close(gv, ref_v)


def test_gradcheck_through_the_shortcut(monkeypatch):
    """Finite differences of c(v) = b . A(v)^-1 b, whose backward takes the forward answer."""
    import importlib
    ks = importlib.import_module("slasolve.krylov.adjoint")
    A, dA, bg, r0, r1 = system(n=4)
    b = torch.from_numpy(bg[r0:r1])
    taken = []
    real = ks.repeats_forward
    monkeypatch.setattr(ks, "repeats_forward", lambda *a: taken.append(real(*a)) or taken[-1])

    nnz = dA.values.shape[0]
    offs = global_offsets(COMM, nnz)
    lo = offs[COMM.rank]

    def compliance(v_global):  # replicated input: every rank perturbs the same entry
        x = slasolve.solve(dA.with_values(local_slice(v_global, lo, lo + nnz, COMM)), b, "cg", pc="jacobi",
                           rtol=1e-13)
        return slasolve.global_sum((b * x).sum())

    v = torch.cat(COMM.allgather(dA.values.detach())).requires_grad_(True)
    assert torch.autograd.gradcheck(compliance, (v,), eps=1e-6, atol=1e-7, rtol=1e-5)
    assert True in taken   # the gradient gradcheck checked came through the shortcut
