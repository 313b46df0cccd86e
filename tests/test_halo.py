"""MPI tests of slasolve.halo.HaloPlan: values, adjointness, autograd, traffic."""
import numpy as np
import pytest
import torch
from mpi4py import MPI

from slasolve import HaloPlan

pytestmark = pytest.mark.mpi

N_GLOBAL = 57


def all_ok(comm, flag) -> bool:
    return bool(comm.allreduce(int(bool(flag)), op=MPI.MIN))


def gdot(comm, a, b) -> float:
    return comm.allreduce(float((a * b).sum()), op=MPI.SUM)


def offsets_for(size):
    w = np.arange(size, 0, -1, dtype=float)  # uneven, decreasing ranges
    counts = np.maximum(1, np.floor(N_GLOBAL * w / w.sum()).astype(int))
    counts[-1] = N_GLOBAL - counts[:-1].sum()
    return np.concatenate([[0], np.cumsum(counts)])


def make_plan(comm, density=0.3, seed=0, empty_on=()):
    offs = offsets_for(comm.size)
    r = comm.rank
    start, end = int(offs[r]), int(offs[r + 1])
    rng = np.random.default_rng(seed + 101 * r)
    others = np.setdiff1d(np.arange(N_GLOBAL), np.arange(start, end))
    ghosts = np.sort(rng.choice(others, size=int(density * others.size), replace=False)) \
        if others.size and r not in empty_on else np.zeros(0, dtype=np.int64)
    plan = HaloPlan(comm, (start, end), torch.from_numpy(ghosts.astype(np.int64)))
    return plan, start, end, ghosts.astype(np.int64)


def global_vec(trailing=(), seed=5):
    return torch.rand((N_GLOBAL,) + trailing, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("trailing", [(), (3,), (2, 4)])
def test_forward_copies_owner_values(comm, trailing):
    plan, s, e, ghosts = make_plan(comm)
    xg = global_vec(trailing)
    out = plan.forward(xg[s:e].clone())
    assert out.shape == (len(ghosts),) + trailing
    assert all_ok(comm, torch.equal(out, xg[torch.from_numpy(ghosts)]))
    # the non-blocking pieces give the same
    h = plan.start_forward(xg[s:e].clone())
    assert all_ok(comm, torch.equal(plan.finish(h), out))


@pytest.mark.parametrize("trailing", [(), (3,)])
def test_reverse_sums_into_owners(comm, trailing):
    plan, s, e, ghosts = make_plan(comm, seed=1)
    g = torch.rand((len(ghosts),) + trailing, generator=torch.Generator().manual_seed(comm.rank))
    contrib = plan.reverse(g)
    # reference: every rank scatters its ghost contributions into a global array, summed
    full = np.zeros((N_GLOBAL,) + trailing)
    np.add.at(full, ghosts, g.numpy())
    comm.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM)
    assert contrib.shape == (e - s,) + trailing
    assert all_ok(comm, np.allclose(contrib.numpy(), full[s:e], rtol=1e-14, atol=1e-14))


@pytest.mark.parametrize("trailing", [(), (2,), (2, 3)])
def test_adjoint_identity(comm, trailing):
    """<F x, y> = <x, F^T y> with global (Allreduce) inner products; F^T = reverse."""
    plan, s, e, ghosts = make_plan(comm, seed=2, empty_on=(1,))
    gen = torch.Generator().manual_seed(10 + comm.rank)
    x = torch.rand((e - s,) + trailing, generator=gen)
    y = torch.rand((len(ghosts),) + trailing, generator=gen)
    lhs = gdot(comm, plan.forward(x), y)
    rhs = gdot(comm, x, plan.reverse(y))
    assert abs(lhs - rhs) <= 1e-12 * max(abs(lhs), 1.0)
    if comm.size > 1:
        assert abs(lhs) > 0  # the identity is not trivially 0 = 0


def test_autograd_forward_reverse_are_adjoint(comm):
    plan, s, e, ghosts = make_plan(comm, seed=3)
    gen = torch.Generator().manual_seed(20 + comm.rank)
    x = torch.rand(e - s, 2, generator=gen, requires_grad=True)
    w = torch.rand(len(ghosts), 2, generator=gen)
    (plan.forward(x) * w).sum().backward()
    ok = torch.allclose(x.grad, plan.reverse_raw(w), rtol=1e-14, atol=0)
    g = torch.rand(len(ghosts), 2, generator=gen, requires_grad=True)
    v = torch.rand(e - s, 2, generator=gen)
    (plan.reverse(g) * v).sum().backward()
    ok &= torch.allclose(g.grad, plan.forward_raw(v), rtol=1e-14, atol=0)
    assert all_ok(comm, ok)


def test_traffic_is_exactly_the_ghosts(comm):
    plan, s, e, ghosts = make_plan(comm, seed=4)
    assert plan.n_ghost == len(ghosts) and plan.n_owned == e - s
    for itemsize, width in ((8, 1), (4, 3)):
        b = plan.bytes_per_exchange(itemsize, width)
        assert b["recv"] == len(ghosts) * itemsize * width
        assert b["send"] == plan.n_send * itemsize * width
    assert comm.allreduce(plan.n_send) == comm.allreduce(plan.n_ghost)
    # the ids this rank sends to q are exactly the ghosts q asked this rank for
    all_ghosts = comm.allgather(ghosts)
    ok = True
    sent = {r: (plan.send_idx[a:b].numpy() + s) for r, a, b in plan._send_slices}
    for q, gq in enumerate(all_ghosts):
        want = gq[(gq >= s) & (gq < e)]
        got = sent.get(q, np.zeros(0, dtype=np.int64))
        ok &= np.array_equal(np.sort(got), want)
    ok &= set(plan.neighbours) == {q for q, gq in enumerate(all_ghosts) if ((gq >= s) & (gq < e)).any()} | \
        set(plan.recv_ranks)
    # messages go only to ranks that own a ghost
    owners = set((np.searchsorted(offsets_for(comm.size), ghosts, side="right") - 1).tolist())
    ok &= set(plan.recv_ranks) == owners
    assert all_ok(comm, ok)


def test_float32_and_empty(comm):
    plan, s, e, ghosts = make_plan(comm, seed=6, empty_on=tuple(range(comm.size)))
    assert plan.n_ghost == 0 and comm.allreduce(plan.n_send) == 0
    x = torch.rand(e - s, dtype=torch.float32)
    assert plan.forward(x).shape == (0,) and plan.forward(x).dtype == torch.float32
    assert torch.equal(plan.reverse(torch.zeros(0, dtype=torch.float32)), torch.zeros(e - s))
    plan2, s, e, ghosts = make_plan(comm, seed=7)
    xg = global_vec(seed=8).float()
    assert all_ok(comm, torch.equal(plan2.forward(xg[s:e].clone()), xg[torch.from_numpy(ghosts)]))


def test_wrong_first_dim_is_local_error(comm):
    """A wrong shape raises before any message is posted (every rank passes it here)."""
    plan, s, e, ghosts = make_plan(comm, seed=9)
    with pytest.raises(ValueError, match="rows along dim 0"):
        plan.forward(torch.zeros(e - s + 1))
    with pytest.raises(ValueError, match="rows along dim 0"):
        plan.reverse(torch.zeros(len(ghosts) + 1))
    # the plan still works afterwards
    xg = global_vec(seed=11)
    assert all_ok(comm, torch.equal(plan.forward(xg[s:e].clone()), xg[torch.from_numpy(ghosts)]))


def test_plans_share_one_duplicated_communicator(comm):
    """One Dup per parent communicator (cached as an attribute, as PETSc's inner
    communicator): building many plans creates no communicators (each used to Dup,
    and Open MPI fails near 65k communicators)."""
    plans = [make_plan(comm, seed=s)[0] for s in range(3)]
    t0 = MPI.Wtime()
    for _ in range(3000):
        HaloPlan(comm, plans[0].owned_range, plans[0].ghost_ids, offsets=plans[0].offsets)
    elapsed = MPI.Wtime() - t0
    if comm.size == 1:
        assert all(p.comm == comm for p in plans)
        return
    from slasolve.halo import plan as planmod
    inner = comm.Get_attr(planmod._KEYVAL)
    ok = all(p.comm == inner.comm for p in plans) and inner.comm != comm
    ok &= len({p.plan_id for p in plans}) == 3
    assert all_ok(comm, ok)
    assert elapsed < 60


def test_plans_on_split_communicator_do_not_interfere(comm):
    sub = comm.Split(comm.rank % 2, comm.rank)
    try:
        pw, s, e, gw = make_plan(comm, seed=12)
        ps, ss, es, gs = make_plan(sub, seed=13)
        xw, xs = global_vec(seed=14), global_vec(seed=15)
        # interleave exchanges on both communicators
        hw = pw.start_forward(xw[s:e].clone())
        hs = ps.start_forward(xs[ss:es].clone())
        ok = torch.equal(ps.finish(hs), xs[torch.from_numpy(gs)])
        ok &= torch.equal(pw.finish(hw), xw[torch.from_numpy(gw)])
        if sub.size > 1 and comm.size > 1:
            ok &= pw.comm != ps.comm
        assert all_ok(comm, ok)
    finally:
        sub.Free()


def test_freeing_the_parent_frees_the_duplicate(comm):
    sub = comm.Dup()
    make_plan(sub, seed=16)
    from slasolve.halo import plan as planmod
    inner = sub.Get_attr(planmod._KEYVAL) if comm.size > 1 else None
    sub.Free()
    assert inner is None or inner.comm == MPI.COMM_NULL


@pytest.mark.timeout(60)
def everybody_plan(comm):
    """A plan where every rank needs every other rank's entries: ``(plan, start, end, ghosts)``."""
    offs = offsets_for(comm.size)
    s, e = int(offs[comm.rank]), int(offs[comm.rank + 1])
    others = np.setdiff1d(np.arange(N_GLOBAL), np.arange(s, e))
    return HaloPlan(comm, (s, e), torch.from_numpy(others)), s, e, others


def test_bad_input_on_one_rank_raises_on_its_neighbours(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    plan, s, e, others = everybody_plan(comm)
    x = torch.rand(e - s + (1 if comm.rank == 0 else 0), 2)
    with pytest.raises(ValueError, match="rank 0|rows along dim 0"):
        plan.forward(x)
    g = torch.rand(len(others), 1 if comm.rank == 1 else 2)
    with pytest.raises(ValueError, match="item"):
        plan.reverse(g)
    g32 = torch.rand(len(others), 2, dtype=torch.float32 if comm.rank == 0 else torch.float64)
    with pytest.raises(ValueError, match="dtype"):
        plan.reverse(g32)
    xg = global_vec((2,), seed=17)
    assert all_ok(comm, torch.equal(plan.forward(xg[s:e].clone()), xg[torch.from_numpy(others)]))


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.int64])
@pytest.mark.parametrize("trailing", [(), (3,), (2, 2)])
def test_array_exchanges_equal_global_references(comm, dtype, trailing):
    """forward_array / reverse_array (NumPy in and out, kept buffers) against the global vector
    and an ``np.add.at`` scatter of every rank's ghosts, called twice (the buffers are reused)."""
    plan, s, e, ghosts = make_plan(comm, seed=21)
    for rep in range(2):
        xg = (global_vec(trailing, seed=30 + rep).numpy() * 100).astype(dtype)
        got = plan.forward_array(xg[s:e].copy())
        assert got.dtype == dtype and got.shape == (len(ghosts),) + trailing
        assert all_ok(comm, np.array_equal(got, xg[ghosts]))
        g = (np.random.default_rng(comm.rank + 7 * rep).random((len(ghosts),) + trailing) * 100).astype(dtype)
        full = np.zeros((N_GLOBAL,) + trailing, dtype=np.float64)
        np.add.at(full, ghosts, g.astype(np.float64))
        comm.Allreduce(MPI.IN_PLACE, full, op=MPI.SUM)
        out = plan.reverse_array(g)
        assert out.dtype == dtype and out.shape == (e - s,) + trailing
        assert all_ok(comm, np.allclose(out.astype(np.float64), full[s:e], rtol=1e-6))
        # the tensor path gives the same bits
        assert all_ok(comm, np.array_equal(plan.reverse_raw(torch.from_numpy(g)).numpy(), out))


def test_array_exchange_bad_input_on_one_rank_raises_everywhere(comm):
    if comm.size < 2:
        pytest.skip("needs 2 ranks")
    plan, s, e, others = everybody_plan(comm)
    with pytest.raises(ValueError, match="rank 0|rows along dim 0"):
        plan.forward_array(np.zeros(e - s + (1 if comm.rank == 0 else 0)))
    bad = np.empty(len(others), dtype=object) if comm.rank == 1 else np.zeros(len(others))
    with pytest.raises((TypeError, ValueError), match="rank 1|hold numbers"):
        plan.reverse_array(bad)
    with pytest.raises((TypeError, ValueError), match="rank 0|NumPy array"):
        plan.forward_array([0.0] * (e - s) if comm.rank == 0 else np.zeros(e - s))
    xg = global_vec((2,), seed=17).numpy()
    assert all_ok(comm, np.array_equal(plan.forward_array(xg[s:e].copy()), xg[others]))
