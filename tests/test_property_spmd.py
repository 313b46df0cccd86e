"""SPMD properties: what one rank does differently must not hang the others (docs/testing.md).

* A setting that must be identical on every rank (method, tolerances, maxiter, pc,
  backend, k, which, sigma, ...) given differently on ONE rank raises ValueError/TypeError
  on EVERY rank (``check_collective(agree=...)``), never a hang or a silent mix.
* A rank that owns zero rows either works (results equal SciPy's) or every rank raises
  ValueError.

A hang is the failure these properties hunt: the module's tests run under a short
pytest-timeout with the ``thread`` method, which dumps every thread's stack and ends the
process (so ``mpirun`` ends the job) instead of leaving the ranks waiting forever.
This file sorts last among the property files on purpose: a hang here ends an MPI run
after the other properties have reported.
"""
import numpy as np
import pytest
import scipy.linalg
import scipy.sparse.linalg as spla
import torch
from hypothesis import strategies as st

import slasolve
from slasolve import DSparseTensor
from slasolve.testing import case_matrix, collective_property, distribute_or_none, eig_selection_error, property_config

#: seconds before a (hung) test dumps its stacks and ends the process
HANG_LIMIT = 3600 if property_config()["full"] else 240
pytestmark = [pytest.mark.mpi, pytest.mark.property, pytest.mark.timeout(HANG_LIMIT, method="thread")]

#: argument -> (value on every other rank, value on the odd rank)
SOLVE_ARGS = {
    "method": ("cg", "gmres"), "rtol": (1e-8, 1e-6), "rtol~": (1e-8, 1e-8 * (1 + 1e-12)),
    "atol": (0.0, 1e-10), "maxiter": (None, 50), "maxiter~": (100, 101), "pc": ("jacobi", "none"),
    "backend": ("petsc", "torch"), "restart": (30, 10),
}
EIGSH_ARGS = {
    "k": (2, 3), "which": ("LA", "SA"), "sigma": (None, 0.5), "sigma~": (0.5, 0.5 + 1e-9),
    "tol": (1e-8, 1e-6), "backend": ("slepc", "torch"), "maxiter": (None, 500), "ncv": (None, 12),
}


def _needs_ranks(comm, n=2):
    if comm.Get_size() < n:
        pytest.skip(f"needs >= {n} ranks: settings can only differ across ranks")


@st.composite
def mismatch_cases(draw):
    func = draw(st.sampled_from(("solve", "eigsh")))
    args = SOLVE_ARGS if func == "solve" else EIGSH_ARGS
    return {"func": func, "arg": draw(st.sampled_from(sorted(args))), "odd": draw(st.integers(0, 63)),
            "seed": draw(st.integers(0, 2 ** 16)), "n": draw(st.integers(12, 40)),
            "partition": draw(st.sampled_from(("contiguous", "metis", "random")))}


def _check_mismatch(comm, ex):
    A, coords, _ = case_matrix("spd", ex["n"], ex["seed"])
    # more ranks than rows (or metis leaving parts empty, seen at 16 ranks) is refused on every
    # rank by from_global: nothing to test then (the zero-rows property covers those layouts)
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return
    table = SOLVE_ARGS if ex["func"] == "solve" else EIGSH_ARGS
    same, odd = table[ex["arg"]]
    mine = odd if comm.Get_rank() == ex["odd"] % comm.Get_size() else same
    name = ex["arg"].rstrip("~")
    outcome = None
    try:
        if ex["func"] == "solve":
            kw = {"method": "cg", "rtol": 1e-8, "pc": "jacobi", name: mine}
            b = dA.scatter(torch.ones(A.shape[0]), root=None)
            slasolve.solve(dA, b, **kw)
        else:
            kw = {"k": 2, "which": "LA", name: mine}
            if kw.get("sigma") is not None:
                kw["which"] = "LM"  # shift-invert: the eigenvalues nearest sigma
            slasolve.eigsh(dA, **kw)
    except (ValueError, TypeError) as e:
        outcome = type(e).__name__
    outcomes = comm.allgather(outcome)
    assert all(o is not None for o in outcomes), (
        f"{ex['func']}({name}=...) differing on rank {ex['odd'] % comm.Get_size()} ({same!r} elsewhere, "
        f"{odd!r} there): outcomes per rank {outcomes}; every rank must raise ValueError/TypeError")


def test_settings_that_differ_across_ranks_raise_everywhere(comm):
    _needs_ranks(comm)
    collective_property(comm, mismatch_cases(), lambda ex: _check_mismatch(comm, ex),
                        name="settings_agree", examples=10, full_examples=150,
                        explicit=[{"func": f, "arg": a, "odd": 1, "seed": 0, "n": 16, "partition": "contiguous"}
                                  for f, a in (("solve", "rtol~"), ("solve", "maxiter"), ("eigsh", "k"),
                                               ("eigsh", "sigma"))]
                        # past 8 ranks: fewer rows than ranks, refused everywhere (SLASOLVE_SCALE_RANKS=16)
                        + [{"func": "eigsh", "arg": "backend", "odd": 46, "seed": 1, "n": 8, "partition": "metis"}])


@st.composite
def zero_row_cases(draw):
    return {"kind": draw(st.sampled_from(("spd", "nonsym", "block2"))), "n": draw(st.integers(8, 24)),
            "seed": draw(st.integers(0, 2 ** 16)),
            # rows per rank as fractions; a zero fraction gives the rank no rows
            "weights": draw(st.lists(st.sampled_from((0, 0, 1, 2, 3)), min_size=4, max_size=4)),
            "call": draw(st.sampled_from(("matvec", "solve", "eigsh")))}


def _split(nb, weights, size):
    """Block-row offsets (``size + 1`` of them) from the drawn weights, repeated cyclically
    over the ranks: 4 weights are drawn, and at more ranks than that every rank must still
    get its slice (it once got none past rank 3: those ranks raised IndexError in the test
    while ranks 0-3 waited in ``from_local_rows``, a hang at 8 ranks)."""
    w = np.resize(np.asarray(weights, dtype=float), size)
    if w.sum() == 0:
        w[-1] = 1.0
    counts = np.floor(nb * w / w.sum()).astype(int)
    counts[np.argmax(w)] += nb - counts.sum()
    return np.concatenate([[0], np.cumsum(counts)])


def _check_zero_rows(comm, ex):
    A, _, bs = case_matrix(ex["kind"], ex["n"], ex["seed"])
    size, rank = comm.Get_size(), comm.Get_rank()
    nb = A.shape[0] // bs
    offs = _split(nb, ex["weights"], size)
    B = A.tocsr() if bs == 1 else A.tobsr(blocksize=(bs, bs))
    B.sort_indices()
    lo, hi = int(offs[rank]), int(offs[rank + 1])
    a, b = int(B.indptr[lo]), int(B.indptr[hi])
    ip, ix, v = B.indptr[lo:hi + 1] - a, B.indices[a:b], torch.from_numpy(B.data[a:b].copy())
    shape, block = (A.shape, ()) if bs == 1 else ((nb, nb, bs, bs), (bs, bs))
    outcome, dA = None, None
    try:
        dA = DSparseTensor.from_local_rows(ip, ix, v, shape, comm, block_shape=block)
    except ValueError:
        outcome = "ValueError"
    outcomes = comm.allgather(outcome)
    assert len(set(outcomes)) == 1, f"ranks disagree on a zero-row layout {np.diff(offs).tolist()}: {outcomes}"
    if outcome is not None:
        return  # refused on every rank: fine
    xg = np.random.default_rng(ex["seed"]).standard_normal(A.shape[0])
    x = torch.from_numpy(xg[lo * bs:hi * bs].copy())
    if ex["call"] == "matvec":
        y = torch.cat(comm.allgather(dA @ x)).numpy()
        assert np.allclose(y, A @ xg, rtol=1e-12, atol=1e-12), "matvec with a zero-row rank is wrong"
    elif ex["call"] == "solve":
        method = "cg" if ex["kind"] != "nonsym" else "gmres"
        sol = slasolve.solve(dA, x, method, rtol=1e-10)
        sol = torch.cat(comm.allgather(sol)).numpy()
        ref = spla.spsolve(A.tocsc(), xg)
        assert np.linalg.norm(sol - ref) <= 1e-8 * np.linalg.norm(ref), "solve with a zero-row rank is wrong"
    elif ex["kind"] != "nonsym":
        w, _ = slasolve.eigsh(dA, 2, which="LA", tol=1e-10)
        ev = scipy.linalg.eigvalsh(A.toarray())
        assert eig_selection_error(w.numpy(), ev, 2, "LA") <= 1e-6 * abs(ev).max()


def test_rank_with_zero_rows_works_or_raises_everywhere(comm):
    _needs_ranks(comm)
    collective_property(comm, zero_row_cases(), lambda ex: _check_zero_rows(comm, ex),
                        name="zero_rows", examples=8, full_examples=100,
                        explicit=[{"kind": k, "n": 12, "seed": 3, "weights": w, "call": c}
                                  for k, w, c in (("spd", [0, 0, 0, 0], "solve"), ("block2", [0, 1, 0, 2], "matvec"),
                                                  ("nonsym", [2, 0, 0, 1], "solve"), ("spd", [0, 3, 0, 0], "eigsh"))])


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 8, 16, 33])
def test_zero_row_layout_gives_every_rank_a_slice(size):
    # the layout helper of the zero-rows property, at rank counts past the 4 drawn weights
    for weights in ([0, 0, 0, 0], [0, 1, 0, 2], [3, 0, 0, 0], [1, 2, 3, 0]):
        for nb in (4, 12, 40):
            offs = _split(nb, weights, size)
            assert len(offs) == size + 1 and offs[0] == 0 and offs[-1] == nb
            assert np.all(np.diff(offs) >= 0)
            w = np.resize(weights, size)
            if w.any():  # a zero weight gives no rows (the drawn pattern is kept at every size)
                assert np.all(np.diff(offs)[w == 0] == 0)
