"""The transient adjoint's batched work (issue 22): the source's vector-Jacobian products summed
per time level and made a batch of levels at a time, the value gradients of ``M`` and ``K`` made a
batch of steps at a time, and the source's errors combined over the ranks in the batched checks.

Gradients with small batches (so that many batches, partial ones and the starters of BDF2 are
exercised) against central finite differences and the Taylor test; a source that raises on one
rank at one time level, in the forward sweep or only in the adjoint, raises on every rank.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.timestepping import LinearTimeProblem, integrate
from slasolve.timestepping import linear as tlinear

from heat_line import check_fd_and_taylor, distributed_line, rank_random

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64


def allsum(t):
    return slasolve.global_sum(t, COMM)






@pytest.mark.parametrize("sch", ["cn", "bdf2", 0.7])
@pytest.mark.parametrize("batch,entries", [(1, 1 << 22), (3, 1 << 22), (4, 80)])
def test_batched_adjoint_gradient_fd_and_taylor(monkeypatch, sch, batch, entries):
    """Gradients of u0, a nonlinear time-dependent source's params, and M's and K's values through
    23 steps (batches of 1, 3 and 4 levels; value-gradient batches capped by ``entries``) match
    central finite differences and pass the Taylor test."""
    monkeypatch.setattr(tlinear, "ADJOINT_BATCH", batch)
    monkeypatch.setattr(tlinear, "VALUE_GRAD_ENTRIES", entries)
    dM, dK, x = distributed_line(COMM)
    N, dt = 23, 0.004
    u0, q, a = torch.cos(2 * x), torch.sin(3 * x), torch.tensor([0.7, -0.4], dtype=DT)
    Mv, Kv = dM.values.clone(), dK.values.clone()

    def src(t, q, a):
        # nonlinear in its params and in t: each time level's VJP differs
        return torch.tanh(q) * (1.0 + a[0] * t) + a[1] * torch.cos(7 * t + x) + q * q * t

    def loss(u0, q, a, Mv, Kv, **kw):
        P = LinearTimeProblem(dM.with_values(Mv), dK.with_values(Kv), src, scheme=sch, method="direct")
        mid, end = integrate(P, u0, q, a, dt=dt, n_steps=N, outputs=[9, N], **kw)
        return allsum((end ** 2).sum() + (mid * x).sum())

    m = (u0, q, a, Mv, Kv)
    leaves = [t.clone().requires_grad_(True) for t in m]
    loss(*leaves).backward()
    grads = [t.grad for t in leaves]
    # a is a parameter every rank uses identically: its gradient is this rank's share
    d = [rank_random(u0.shape, 1, COMM), rank_random(q.shape, 2, COMM), torch.tensor([0.3, -0.8], dtype=DT),
         0.1 * rank_random(Mv.shape, 4, COMM), 10 * rank_random(Kv.shape, 5, COMM)]
    ad = float(allsum(sum((g * e).sum() for g, e in zip(grads, d))))
    check_fd_and_taylor(loss, m, d, ad)


@pytest.mark.parametrize("when", ["forward", "adjoint"])
@pytest.mark.parametrize("method", [pytest.param("direct", marks=pytest.mark.petsc), "direct-scipy", "cg-torch"])
def test_source_error_on_one_rank_raises_on_every_rank(when, method):
    """The source raising on the last rank at one time level (in the forward sweep, or only when
    the adjoint differentiates it) raises the same exception type on every rank."""
    dM, dK, x = distributed_line(COMM)
    solver, _, backend = method.partition("-")

    def src(t, q):
        bad = COMM.rank == COMM.size - 1 and abs(t - 0.05) < 1e-12
        if bad and (when == "forward" or torch.is_grad_enabled()):
            raise KeyError("the source failed")
        return q * (1.0 + t)

    P = LinearTimeProblem(dM, dK, src, scheme="cn", method=solver, rtol=1e-12, backend=backend or None)
    q = torch.sin(3 * x).requires_grad_(True)
    with pytest.raises((KeyError, RuntimeError), match="the source failed"):
        u = integrate(P, torch.cos(2 * x), q, dt=0.01, n_steps=9)
        allsum((u * u).sum()).backward()
    # the problem is usable afterwards
    q = torch.sin(3 * x).requires_grad_(True)
    ok = LinearTimeProblem(dM, dK, lambda t, q: q, scheme="cn", method=solver, rtol=1e-12, backend=backend or None)
    u = integrate(ok, torch.cos(2 * x), q, dt=0.01, n_steps=3)
    allsum((u * u).sum()).backward()
    assert torch.isfinite(q.grad).all()


def test_source_returning_its_own_buffer():
    """A source that overwrites and returns one buffer at every call gives the trajectory and
    gradient of one that returns fresh tensors (the forward keeps f(t_m) for the next step)."""
    dM, dK, x = distributed_line(COMM)
    buf = torch.empty_like(x)

    def fresh(t, q):
        return torch.sin(q) * (1.0 + 3 * t)

    def reused(t, q):
        with torch.no_grad():
            buf.copy_(fresh(t, q.detach()))
        return buf if not torch.is_grad_enabled() else fresh(t, q)

    out = {}
    for name, src in (("fresh", fresh), ("reused", reused)):
        q = torch.sin(3 * x).requires_grad_(True)
        P = LinearTimeProblem(dM, dK, src, scheme="cn", method="direct", backend="scipy" if COMM.size == 1 else None)
        u = integrate(P, torch.cos(2 * x), q, dt=0.01, n_steps=7)
        allsum((u * u).sum()).backward()
        out[name] = (u.detach(), q.grad)
    assert torch.equal(out["fresh"][0], out["reused"][0]) and torch.equal(out["fresh"][1], out["reused"][1])
