"""``HaloPlan.bound_exchange``: a plan's exchange of float64 rows with persistent requests on kept
buffers and no headers (``BoundExchange``), which the ``slasolve.fem`` Newton kernels use inside
SNES's callbacks. Its results equal ``forward_array`` / ``reverse_array``'s bit for bit (and the
global references), whatever the row shape, with ranks that exchange nothing, called repeatedly
(no result aliases the kept buffers) and interleaved with the checked exchanges of the same and
other plans. The kernels make no checked exchange inside ``nonlinear_solve`` (one bound exchange per
forward / reverse they need), only while they run (the methods keep the checked ones, also after a
kernel raised), with the same answers as the methods."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve import HaloPlan
from slasolve.halo.plan import BoundExchange

from nl_problems import LU, diffusion, solid

pytestmark = pytest.mark.mpi
N_GLOBAL = 61


def _all(comm, flag) -> bool:
    return bool(comm.allreduce(int(bool(flag)), op=MPI.MIN))


def _plan(comm, seed, empty_on=()):
    """A plan on uneven ranges with random ghosts (none on the ranks ``empty_on``)."""
    w = np.arange(comm.size, 0, -1, dtype=float)
    counts = np.maximum(1, np.floor(N_GLOBAL * w / w.sum()).astype(int))
    counts[-1] = N_GLOBAL - counts[:-1].sum()
    offs = np.concatenate([[0], np.cumsum(counts)])
    s, e = int(offs[comm.rank]), int(offs[comm.rank + 1])
    others = np.setdiff1d(np.arange(N_GLOBAL), np.arange(s, e))
    rng = np.random.default_rng(seed + 31 * comm.rank)
    ghosts = np.sort(rng.choice(others, size=others.size // 3, replace=False)) \
        if others.size and comm.rank not in empty_on else np.zeros(0, dtype=np.int64)
    return HaloPlan(comm, (s, e), torch.from_numpy(ghosts.astype(np.int64))), s, e, ghosts


@pytest.mark.parametrize("trailing", [(), (3,), (2, 2)])
@pytest.mark.parametrize("empty_on", [(), (0,)])
def test_bound_exchanges_equal_the_checked_ones(comm, trailing, empty_on):
    plan, s, e, ghosts = _plan(comm, 7, empty_on)
    other, _, _, other_ghosts = _plan(comm, 8)
    fwd, rev = plan.bound_exchange(0, trailing), plan.bound_exchange(1, trailing)
    assert isinstance(fwd, BoundExchange) and plan.bound_exchange(0, trailing) is fwd   # kept
    kept = []
    for rep in range(3):
        xg = np.random.default_rng(50 + rep).random((N_GLOBAL,) + trailing)
        g = np.random.default_rng(60 + rep + 13 * comm.rank).random((len(ghosts),) + trailing)
        got = fwd.run(xg[s:e].copy())
        # a checked exchange of another plan and of this one in between (their own tags)
        other.forward_array(xg[s:e].copy())
        checked_rev = plan.reverse_array(g)
        summed = rev.run(g)
        assert _all(comm, got.shape == (len(ghosts),) + trailing and np.array_equal(got, xg[ghosts]))
        assert _all(comm, np.array_equal(got, plan.forward_array(xg[s:e].copy())))
        assert _all(comm, summed.shape == (e - s,) + trailing and np.array_equal(summed, checked_rev))
        full = np.zeros((N_GLOBAL,) + trailing)
        np.add.at(full, ghosts, g)
        comm.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM)
        assert _all(comm, np.allclose(summed, full[s:e], rtol=1e-13, atol=0))
        kept.append((got, summed, xg[ghosts].copy(), checked_rev))
    # earlier results are not views of the kept buffers
    assert _all(comm, all(np.array_equal(a, b) and np.array_equal(c, d) for a, c, b, d in kept))


def _spy(monkeypatch):
    """Counts of the checked array exchanges and of the bound ones."""
    seen = {"checked": 0, "bound": 0}
    for name in ("forward_array", "reverse_array"):
        real = getattr(HaloPlan, name)

        def counted(self, a, real=real):
            seen["checked"] += 1
            return real(self, a)
        monkeypatch.setattr(HaloPlan, name, counted)
    real_run = BoundExchange.run

    def run(self, a):
        seen["bound"] += 1
        return real_run(self, a)
    monkeypatch.setattr(BoundExchange, "run", run)
    return seen


@pytest.mark.parametrize("make", ["diffusion", "solid"])
def test_kernels_inside_nonlinear_solve_use_only_bound_exchanges(comm, make, monkeypatch):
    from slasolve.fem.nonlinear import NonlinearProblem
    sp, P = diffusion(comm) if make == "diffusion" else solid(comm, 0.05)
    u0 = sp.zeros()
    with monkeypatch.context() as m:   # the reference: the kernels on the checked exchanges
        m.setattr(NonlinearProblem, "_bound_kernels", lambda self, r, t: (r, t))
        ref, rinfo = slasolve.nonlinear_solve(P.residual, u0, jacobian=P.jacobian, rtol=1e-10, linear_solver=LU,
                                              return_info=True)
    seen = _spy(monkeypatch)
    u, info = slasolve.nonlinear_solve(P.residual, u0, jacobian=P.jacobian, rtol=1e-10, linear_solver=LU,
                                       return_info=True)
    assert info.converged and info.iterations == rinfo.iterations
    assert np.allclose(info.residual_history, rinfo.residual_history, rtol=1e-8, atol=1e-12 * rinfo.residual_history[0])
    num = comm.allreduce(float(((u - ref) ** 2).sum()), op=MPI.SUM)
    den = comm.allreduce(float((ref ** 2).sum()), op=MPI.SUM)
    assert num <= 1e-24 * den
    if comm.size == 1:
        assert seen == {"checked": 0, "bound": 0}
    else:
        # a residual: one forward and one reverse; a tangent where the residual was: one reverse
        assert seen["checked"] == 0
        assert seen["bound"] == 2 * info.function_evaluations + info.jacobian_evaluations
    assert P._np_bound is False
    # the methods keep the checked exchanges and give the kernels' answers
    seen.update(checked=0, bound=0)
    with torch.no_grad():
        r = P.residual(u)
    assert seen["bound"] == 0 and (comm.size == 1 or seen["checked"] >= 2)
    res, _ = P.iterate_kernels(P.residual, P.jacobian, ())
    out = np.empty(u.shape[0])
    res(u.numpy().copy(), out)
    assert _all(comm, np.array_equal(out, r.numpy()))


def test_the_flag_is_cleared_when_a_kernel_raises(comm):
    """An overflowing tangent raises on every rank from inside the kernel; the methods called next
    use the checked exchanges again (a bad input there raises collectively, as before)."""
    sp, P = diffusion(comm)
    res, tan = P.iterate_kernels(P.residual, P.jacobian, ())
    n = sp.zeros().shape[0]
    x = np.full(n, 1e160) if comm.rank == comm.size - 1 else np.full(n, 0.1)
    with np.errstate(all="ignore"):
        res(x, np.empty(n))
        with pytest.raises(ValueError, match="NaN or infinite|rank"):
            tan(x)
    assert P._np_bound is False
    bad = sp.zeros() if comm.rank else torch.zeros(sp.zeros().shape[0] + 1, dtype=torch.float64)
    with pytest.raises(ValueError), torch.no_grad():
        P.residual(bad)
