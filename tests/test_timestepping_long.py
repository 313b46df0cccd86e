"""Gradients through long trajectories (issue 22): 10 to 1000 time steps.

For each length the gradient of a loss of an intermediate and the final state, with respect to
the initial state, a source and the stiffness values, is compared between full storage and 5
snapshots (binomial schedule: the same operations on the same data, so equal to 1e-12), with a
central finite difference along a random direction, and by the Taylor test. Both backends: one
MUMPS factorisation (petsc) and the native torch CG, on a 1-D heat equation on 12 points.

Test-time budget: a case costs ~15 N steps (full storage and its adjoint, 5 snapshots: ~7 forward
sweeps at N = 1000, the finite difference and the Taylor test), and a step is latency-bound
(a few reductions, halo exchanges and a solve: ~1 ms at 1 rank, several ms at 4 oversubscribed
ranks: 100 steps took 70-80 s per case at 2 ranks on a busy 2-core machine). So 10 steps run at
every rank count, 100 steps at 1 rank, and 1000 steps only with ``SLASOLVE_LONG_TESTS=1`` (40-70 s
per case at 1 rank on the same busy machine). The default suite's 1000 steps:
``test_thousand_steps_checkpointed_equals_full_storage_and_taylor`` (no finite difference: the
Taylor test checks the same derivative) at 1 and 2 ranks, with ``backend="scipy"``: SuperLU, on
several ranks on every rank of the gathered step matrix, whose steps run on whole vectors (~0.1
collectives a step against ~100 for a MUMPS solve at 2 ranks): ~5 s at 1 rank and 12-19 s at 2
ranks on the busy machine (load ~6), against 47-109 s with MUMPS
(``bench/results/transient_long_2ranks.json``).

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve.testing import taylor_test
from slasolve.timestepping import LinearTimeProblem, integrate

from heat_line import distributed_line, rank_random

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DT = torch.float64
# T = N dt stays 0.1 (the slowest mode decays by e^-1): the loss depends on every input at every length
T_END = 0.1


def allsum(t):
    return slasolve.global_sum(t, COMM)






LONG = os.environ.get("SLASOLVE_LONG_TESTS") == "1"


def full_and_checkpointed(loss, params):
    """The gradients of ``loss(*params)`` with full storage and with 5 snapshots (each concatenated),
    after checking that they agree to 1e-12 of the largest entry."""
    grads = {}
    for kw in ({}, {"checkpoints": 5}):
        leaves = [t.clone().requires_grad_(True) for t in params]
        loss(*leaves, **kw).backward()
        grads[repr(kw)] = torch.cat([t.grad for t in leaves])
    full, ck = grads["{}"], grads[repr({"checkpoints": 5})]
    scale = float(allsum(full.abs().max()))
    assert scale > 0
    assert float(allsum((ck - full).abs().max())) <= 1e-12 * scale
    return full, ck


@pytest.mark.parametrize("n_steps", [10, pytest.param(100, marks=pytest.mark.skipif(
    COMM.size > 1, reason="test-time budget: 100 steps at 1 rank")), pytest.param(1000, marks=pytest.mark.skipif(
        not LONG, reason="test-time budget: 1000 steps with SLASOLVE_LONG_TESTS=1"))])
@pytest.mark.parametrize("method", [pytest.param("direct", marks=pytest.mark.petsc), "cg-torch"])
def test_long_trajectory_gradient(method, n_steps):
    pytest.importorskip("checkpoint_schedules")
    dM, dK, x = distributed_line(COMM)
    solver, _, backend = method.partition("-")
    dt = T_END / n_steps
    u0, q, Kv = torch.cos(2 * x), torch.sin(3 * x), dK.values.clone()

    def loss(u0, q, Kv, **kw):
        P = LinearTimeProblem(dM, dK.with_values(Kv), lambda t, q: q * (1.0 + t), scheme="cn", method=solver,
                              pc="jacobi", rtol=1e-13, backend=backend or None)
        mid, end = integrate(P, u0, q, dt=dt, n_steps=n_steps, outputs=[n_steps // 2, n_steps], **kw)
        return allsum((end ** 2).sum() + (mid * x).sum())

    full, ck = full_and_checkpointed(loss, (u0, q, Kv))
    # central difference along a random direction: h^2 truncation ~1e-10, rounding ~1e-16 |J| / h
    # (the CG tolerance 1e-13 adds ~1e-13 |J| / h): far below the 1e-6 asked
    d = [rank_random(u0.shape, 1, COMM), rank_random(q.shape, 2, COMM), 10 * rank_random(Kv.shape, 3, COMM)]
    h = 1e-5
    with torch.no_grad():
        fd = (loss(*[t + h * e for t, e in zip((u0, q, Kv), d)])
              - loss(*[t - h * e for t, e in zip((u0, q, Kv), d)])) / (2 * h)
    n0, nq = u0.shape[0], q.shape[0]
    ad = float(allsum((full[:n0] * d[0]).sum() + (full[n0:n0 + nq] * d[1]).sum() + (full[n0 + nq:] * d[2]).sum()))
    assert abs(ad - float(fd)) <= 1e-6 * abs(ad), (ad, float(fd))
    # the Taylor test with the checkpointed gradient (its J(m + h dm) by full storage: the same values)
    r = taylor_test(loss, [u0, q, Kv], d, dJdm=float(allsum((ck[:n0] * d[0]).sum() + (ck[n0:n0 + nq] * d[1]).sum()
                                                            + (ck[n0 + nq:] * d[2]).sum())), steps=3)
    assert r.rate > 1.9
    assert np.isfinite(r.rate)


@pytest.mark.skipif(COMM.size > 2 and not LONG, reason="test-time budget: 1 and 2 ranks (4 oversubscribed "
                    "ranks with SLASOLVE_LONG_TESTS=1)")
def test_thousand_steps_checkpointed_equals_full_storage_and_taylor():
    """1000 Crank-Nicolson steps in the default suite at 1 and 2 ranks: the gradient with respect
    to ``u0``, the source and the stiffness values with 5 snapshots (binomial schedule, 6284
    recomputed steps) equals full storage to 1e-12, and passes the Taylor test (second-order
    remainders); ~13,000 steps in all. One SuperLU factorisation serves every step, on every rank
    (``backend="scipy"``: on several ranks each solve is one Allgatherv; a MUMPS solve makes ~100
    collectives at 2 ranks, which made this test 30-250 s there; the MUMPS path's 1000 steps run
    in the test above with SLASOLVE_LONG_TESTS=1)."""
    pytest.importorskip("checkpoint_schedules")
    n_steps = 1000
    dM, dK, x = distributed_line(COMM)
    dt = T_END / n_steps
    u0, q, Kv = torch.cos(2 * x), torch.sin(3 * x), dK.values.clone()

    def loss(u0, q, Kv, **kw):
        P = LinearTimeProblem(dM, dK.with_values(Kv), lambda t, q: q * (1.0 + t), scheme="cn", method="direct",
                              backend="scipy")
        mid, end = integrate(P, u0, q, dt=dt, n_steps=n_steps, outputs=[n_steps // 2, n_steps], **kw)
        return allsum((end ** 2).sum() + (mid * x).sum())

    full, ck = full_and_checkpointed(loss, (u0, q, Kv))
    d = [rank_random(u0.shape, 1, COMM), rank_random(q.shape, 2, COMM), 10 * rank_random(Kv.shape, 3, COMM)]
    n0, nq = u0.shape[0], q.shape[0]
    dJdm = float(allsum((ck[:n0] * d[0]).sum() + (ck[n0:n0 + nq] * d[1]).sum() + (ck[n0 + nq:] * d[2]).sum()))
    r = taylor_test(loss, [u0, q, Kv], d, dJdm=dJdm, steps=2)
    assert np.isfinite(r.rate) and r.rate > 1.9
