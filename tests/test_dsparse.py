"""MPI tests of DSparseTensor products against SciPy's global products.

Every rank builds the same global SciPy matrix and the same random vectors
(seeded), so every rank can check its own piece and the gathered result.
Run at any size: ``mpirun -n {1,2,4} python -m pytest --with-mpi -m mpi``.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

from slasolve import (DSparseTensor, Replicated, Shard, SparseShard, SparseTensor, col_shard,
                      row_shard)
from slasolve.testing import block_spd_matrix, grid_coords, poisson_matrix, random_matrix

pytestmark = pytest.mark.mpi
RTOL = 1e-12


def rel(a, b):
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    b = b.detach().cpu().numpy() if isinstance(b, torch.Tensor) else np.asarray(b)
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300)


def all_ok(comm, flag: bool) -> bool:
    """Every rank asserts the same thing: the AND over ranks."""
    return bool(comm.allreduce(int(bool(flag)), op=MPI.MIN))


def _rng_coords(n, seed=0):
    return np.random.default_rng(seed).uniform(size=(n, 2))


# name -> (global scipy matrix, coordinates of the (block) rows)
def _cases():
    return {
        "poisson2d": lambda: (poisson_matrix((12, 10)), grid_coords((12, 10))),
        "poisson3d": lambda: (poisson_matrix((6, 5, 4)), grid_coords((6, 5, 4))),
        "random": lambda: (random_matrix(90, density=0.06, seed=1), _rng_coords(90, 1)),
        "empty_rows": lambda: (random_matrix(60, density=0.08, seed=2, empty_rows=[0, 5, 31, 59]),
                               _rng_coords(60, 2)),
        "block2": lambda: (block_spd_matrix((5, 4), 2, seed=3), grid_coords((5, 4))),
        "block3": lambda: (block_spd_matrix((4, 4), 3, seed=4), grid_coords((4, 4))),
    }


CASES = _cases()
PARTITIONS = ("contiguous", "metis", "rcb", "hilbert")


def _vectors(n, m, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g), torch.rand(n, k, generator=g),
            torch.rand(m, generator=g), torch.rand(m, k, generator=g))


def check_row_shard(dA, A, comm):
    """dA @ x, dA @ X, dA.T @ y, dA.T @ Y against SciPy, via scatter/gather and directly."""
    n = A.shape[1]
    x, X, y, Y = _vectors(n, A.shape[0])
    ok = True
    for v in (x, X):
        out = dA.gather(dA @ dA.scatter(v, root=None), root=None)
        ok &= rel(out, A @ v.numpy()) < RTOL
    for v in (y, Y):
        out = dA.gather(dA.T @ dA.scatter(v, root=None), root=None)
        ok &= rel(out, A.T @ v.numpy()) < RTOL
    # independent of scatter/gather: the local rows are the partition-renumbered matrix's rows
    p = dA.spec.partition
    b = dA.block_shape[0] if dA.block_shape else 1
    if p is None:
        perm = np.arange(A.shape[0])
    else:
        perm = (np.asarray(p.perm)[:, None] * b + np.arange(b)).ravel()
    Ap = A.tocsr()[perm][:, perm]
    r0, r1 = dA.row_range
    loc = dA.local.to_scipy().tocsr() if not dA.block_shape else dA.local.scalar().to_scipy()
    ok &= abs(loc - Ap[r0:r1]).max() == 0 if loc.nnz or Ap[r0:r1].nnz else True
    xl = torch.from_numpy(x.numpy()[perm][r0:r1].copy())
    ok &= rel(dA @ xl, (Ap @ x.numpy()[perm])[r0:r1]) < RTOL
    # diagonal / off-diagonal blocks rebuild the local rows
    D = dA.diag.to_dense() if not dA.block_shape else dA.diag.scalar().to_dense()
    O = dA.offd.to_dense() if not dA.block_shape else dA.offd.scalar().to_dense()
    ghosts = dA.ghost_ids.numpy()
    gcols = (ghosts[:, None] * b + np.arange(b)).ravel()
    full = np.zeros((r1 - r0, A.shape[1]))
    full[:, r0:r1] = D.numpy()
    full[:, gcols] += O.numpy()
    ok &= np.array_equal(full, Ap[r0:r1].toarray())
    ok &= rel(dA.diagonal(), Ap.diagonal()[r0:r1]) < RTOL
    return ok


@pytest.mark.parametrize("partition", PARTITIONS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_row_shard_from_global(comm, case, partition):
    A, coords = CASES[case]()
    geometric = partition in ("rcb", "hilbert")
    dA = DSparseTensor.from_global(A if comm.rank == 0 else None, comm, partition=partition,
                                   coords=coords if geometric else None)
    assert dA.placement == row_shard() and dA.is_row_shard
    assert dA.global_shape[:2] == (A.shape[0] // (dA.block_shape or (1,))[0],) * 2
    assert comm.allreduce(dA.n_local) == A.shape[0]
    if partition == "contiguous":
        assert dA.spec.partition is None
    else:
        assert dA.spec.partition is not None and dA.spec.partition.nparts == comm.size
    assert all_ok(comm, check_row_shard(dA, A, comm))


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_shard_from_global_everywhere(comm, case):
    """A given on every rank (no scatter needed) gives the same tensor."""
    A, _ = CASES[case]()
    dA = DSparseTensor.from_global(A, comm)
    assert all_ok(comm, check_row_shard(dA, A, comm))


def _uneven_split(n, size):
    w = np.arange(1, size + 1, dtype=float)
    counts = np.maximum(1, np.floor(n * w / w.sum()).astype(int))
    counts[-1] = n - counts[:-1].sum()
    return np.concatenate([[0], np.cumsum(counts)])


@pytest.mark.parametrize("case", sorted(CASES))
def test_row_shard_from_local_rows(comm, case):
    """Each rank builds only its own rows (uneven split), with global column ids."""
    A, _ = CASES[case]()
    blocked = sp.isspmatrix_bsr(A)
    b = A.blocksize[0] if blocked else 1
    nb = A.shape[0] // b
    offs = _uneven_split(nb, comm.size)
    a, e = offs[comm.rank], offs[comm.rank + 1]
    if blocked:
        Aloc = A.tocsr()[a * b:e * b].tobsr((b, b))
        Aloc.sort_indices()
        dA = DSparseTensor.from_local_rows(Aloc.indptr, Aloc.indices, torch.from_numpy(Aloc.data.copy()),
                                           (nb, nb, b, b), comm, block_shape=(b, b))
    else:
        Aloc = A[a:e]
        dA = DSparseTensor.from_local_rows(Aloc.indptr, Aloc.indices, Aloc.data, A.shape, comm)
    assert dA.row_range == (a * b, e * b)
    assert all_ok(comm, check_row_shard(dA, A, comm))


def test_from_local_rows_sums_duplicates(comm):
    A = poisson_matrix((8, 5))
    offs = _uneven_split(A.shape[0], comm.size)
    Aloc = A[offs[comm.rank]:offs[comm.rank + 1]].tocoo()
    # every entry split in two halves, stored in reverse order
    rows = np.concatenate([Aloc.row, Aloc.row])[::-1]
    cols = np.concatenate([Aloc.col, Aloc.col])[::-1]
    vals = np.concatenate([Aloc.data / 2, Aloc.data / 2])[::-1]
    order = np.argsort(rows, kind="stable")
    rows, cols, vals = rows[order], cols[order], vals[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=Aloc.shape[0]))])
    dA = DSparseTensor.from_local_rows(indptr, cols, torch.from_numpy(vals.copy()), A.shape, comm)
    assert dA.local.nnz == A[offs[comm.rank]:offs[comm.rank + 1]].nnz
    assert all_ok(comm, check_row_shard(dA, A, comm))


def test_memory_sorted_rows_kept_lazy_layout_jacobi_snapshot(comm):
    """Sorted int64 rows are kept as given (no copy); a forward product builds neither the
    diagonal-block positions nor the off-diagonal pattern; a torch CG + Jacobi solve keeps
    a snapshot of the diagonal only; answers match SciPy's."""
    from slasolve.krylov import solve
    n = 60
    A = (random_matrix(n, n, density=0.1, seed=5) + sp.eye(n) * 8.0).tocsr()
    A = ((A + A.T) * 0.5).tocsr()
    A.sort_indices()
    offs = _uneven_split(n, comm.size)
    a, e = offs[comm.rank], offs[comm.rank + 1]
    Aloc = A[a:e]
    ip = torch.from_numpy(Aloc.indptr.astype(np.int64))
    ix = torch.from_numpy(Aloc.indices.astype(np.int64))
    v = torch.from_numpy(Aloc.data.copy())
    dA = DSparseTensor.from_local_rows(ip, ix, v, A.shape, comm)
    ok = dA.local.indices.data_ptr() == ix.data_ptr() and dA.values.data_ptr() == v.data_ptr()
    L = dA._layout
    x = torch.from_numpy(np.random.default_rng(1).standard_normal(n))
    ok &= rel(dA @ x[a:e], (A @ x.numpy())[a:e]) < RTOL
    ok &= L._diag_pos is None and L._offd is None and (L._diag is None) == (L.n_offd > 0)
    b = torch.from_numpy(A @ x.numpy())
    xs, info = solve(dA, b[a:e], "cg", backend="torch", pc="jacobi", rtol=1e-12, return_info=True)
    ok &= rel(xs, x[a:e]) < 1e-9 and info.converged
    snap = next(iter(L.cache("solvers").values()))._snapshot
    ok &= snap.shape == (e - a,) and torch.equal(snap, torch.from_numpy(A.diagonal()[a:e]))
    ok &= L._diag_pos is None and L._offd is None
    # a zero diagonal entry on one rank: every rank raises, naming the local row
    w = v.clone()
    loc = Aloc.tocoo()
    if comm.rank == comm.size - 1:
        w[int(np.nonzero((loc.row == 0) & (loc.col == a))[0][0])] = 0.0
    with pytest.raises(ValueError, match="row 0 is zero" if comm.rank == comm.size - 1 else "row 0"):
        solve(dA.with_values(w), b[a:e], "cg", backend="torch", pc="jacobi")
    # columns out of order: sorted into new arrays
    perm = torch.arange(ix.numel() - 1, -1, -1)
    rows = torch.repeat_interleave(torch.arange(e - a), ip[1:] - ip[:-1])
    order = torch.argsort(rows[perm], stable=True)
    dB = DSparseTensor.from_local_rows(ip, ix[perm][order], v[perm][order], A.shape, comm)
    ok &= torch.equal(dB.local.indices, ix) and torch.equal(dB.values, v)
    ok &= dB.local.indices.data_ptr() != ix.data_ptr() or ix.numel() <= 1
    assert all_ok(comm, ok)


@pytest.mark.parametrize("case", ["random", "block2", "poisson2d"])
def test_col_shard(comm, case):
    A, _ = CASES[case]()
    dA = DSparseTensor.from_global(A if comm.rank == 0 else None, comm, placement=col_shard())
    assert dA.placement == SparseShard(1) and not dA.is_row_shard
    b = dA.block_shape[1] if dA.block_shape else 1
    c0, c1 = (o * b for o in dA.spec.offsets[1][comm.rank:comm.rank + 2])
    x, X, y, Y = _vectors(A.shape[1], A.shape[0])
    ok = True
    for v in (x, X):
        ok &= rel(dA @ v[c0:c1], A @ v.numpy()) < RTOL          # replicated result
    for v in (y, Y):
        ok &= rel(dA.T @ v, (A.T @ v.numpy())[c0:c1]) < RTOL    # owned columns
    assert comm.allreduce(c1 - c0) == A.shape[1]
    assert all_ok(comm, ok)


@pytest.mark.parametrize("case", ["random", "block3", "empty_rows"])
def test_replicated(comm, case):
    A, _ = CASES[case]()
    dA = DSparseTensor.from_global(A if comm.rank == 0 else None, comm, placement=Replicated())
    x, X, y, Y = _vectors(A.shape[1], A.shape[0])
    ok = rel(dA @ x, A @ x.numpy()) < RTOL and rel(dA @ X, A @ X.numpy()) < RTOL
    ok &= rel(dA.T @ y, A.T @ y.numpy()) < RTOL and rel(dA.T @ Y, A.T @ Y.numpy()) < RTOL
    assert all_ok(comm, ok)


@pytest.mark.parametrize("case", ["random", "poisson3d", "block2"])
def test_batch_shard(comm, case):
    A, _ = CASES[case]()
    S = SparseTensor.from_scipy(A)
    nbatch = 5
    g = torch.Generator().manual_seed(7)
    V = torch.rand((nbatch,) + tuple(S.values.shape), generator=g)
    SB = S.with_values(V)
    dA = DSparseTensor.from_global(SB if comm.rank == 0 else None, comm, placement=Shard(0))
    offs = dA.spec.offsets[0]
    a, e = offs[comm.rank], offs[comm.rank + 1]
    assert dA.local.batch_shape == (e - a,) and dA.global_shape == SB.shape
    assert comm.allreduce(e - a) == nbatch
    x, X, _, _ = _vectors(A.shape[1], A.shape[0])
    yx, yX = dA @ x, dA @ X
    ok = True
    for i, bidx in enumerate(range(a, e)):
        Ab = SB[bidx].to_scipy()
        ok &= rel(yx[i], Ab @ x.numpy()) < RTOL and rel(yX[i], Ab @ X.numpy()) < RTOL
    assert all_ok(comm, ok)


def test_with_values_reuses_layout_and_sees_inplace_changes(comm):
    A = random_matrix(50, density=0.1, seed=9)
    dA = DSparseTensor.from_global(A, comm, partition="metis")
    x = dA.scatter(torch.rand(50, generator=torch.Generator().manual_seed(1)), root=None)
    y1 = dA @ x
    yt1 = dA.T @ x
    v = dA.values.clone()
    dB = dA.with_values(v)
    assert dB._layout is dA._layout and dB.halo is dA.halo
    ok = rel(dB @ x, y1) < RTOL
    with torch.no_grad():
        v.mul_(3.0)  # in place, as torch.optim does: the product must see it
    ok &= rel(dB @ x, 3 * y1) < RTOL and rel(dB.T @ x, 3 * yt1) < RTOL
    dC = dA.with_values(-v)
    ok &= rel(dC @ x, -3 * y1) < RTOL
    ok &= rel(dA @ x, y1) < RTOL  # the original is untouched
    d32 = dA.to(torch.float32)
    ok &= d32.dtype == torch.float32 and rel((d32 @ x.float()).double(), y1) < 1e-5
    assert all_ok(comm, ok)


def test_scatter_gather_roots(comm):
    A = poisson_matrix((9, 7))
    dA = DSparseTensor.from_global(A, comm, partition="rcb", coords=grid_coords((9, 7)))
    xg = torch.arange(63.0)
    xl = dA.scatter(xg if comm.rank == 0 else None, root=0)
    back = dA.gather(xl, root=0)
    if comm.rank == 0:
        assert torch.equal(back, xg)
    else:
        assert back is None
    assert torch.equal(dA.gather(dA.scatter(xg, root=None), root=None), xg)


# -- gradients ---------------------------------------------------------------------------
def _grad_setup(comm, A):
    from slasolve.testing import global_offsets
    dA = DSparseTensor.from_global(A, comm)
    voff = global_offsets(comm, dA.values.shape[0])
    v_glob = torch.cat(comm.allgather(dA.values.detach())).clone().requires_grad_(True)
    return dA, voff, v_glob


@pytest.mark.parametrize("case", ["random", "block"])
@pytest.mark.parametrize("transpose", [False, True])
def test_gradcheck_row_shard(comm, case, transpose):
    """gradcheck of dA @ x and dA.T @ y w.r.t. values and the vector, at any size.

    Every rank sees the same global (replicated) inputs: global parameters ->
    local_slice -> distributed op -> replicate -> global output.
    """
    from slasolve.testing import local_slice, replicate
    A = random_matrix(8, density=0.25, seed=21) if case == "random" else block_spd_matrix((4, 1), 2, seed=5)
    dA, voff, v_glob = _grad_setup(comm, A)
    r = comm.rank
    r0, r1 = dA.row_range
    g = torch.Generator().manual_seed(3)
    x_glob = torch.rand(A.shape[0], generator=g, requires_grad=True)
    X_glob = torch.rand(A.shape[0], 2, generator=g, requires_grad=True)

    def f(v, x):
        vl = local_slice(v, voff[r], voff[r + 1], comm)
        xl = local_slice(x, r0, r1, comm)
        B = dA.with_values(vl)
        return replicate(B.T @ xl if transpose else B @ xl, comm)

    assert torch.autograd.gradcheck(f, (v_glob, x_glob))
    # multi-vector: fast mode (random projections; same torch seed on every rank)
    torch.manual_seed(1234)
    assert torch.autograd.gradcheck(f, (v_glob.detach().clone().requires_grad_(True), X_glob),
                                    fast_mode=True)


def test_grad_values_formula(comm):
    """d<g, A x>/dA_k = g[row_k] x[col_k] on every rank's stored entries."""
    A = random_matrix(40, density=0.1, seed=22)
    dA = DSparseTensor.from_global(A, comm)
    g = torch.Generator().manual_seed(4)
    xg, wg = torch.rand(40, generator=g), torch.rand(40, generator=g)
    v = dA.values.clone().requires_grad_(True)
    r0, r1 = dA.row_range
    x, w = xg[r0:r1].clone(), wg[r0:r1].clone()
    (dA.with_values(v) @ x * w).sum().backward()
    rows = dA.local.row_indices() + r0
    expect = wg[rows] * xg[dA.local.indices]
    assert all_ok(comm, torch.allclose(v.grad, expect, rtol=1e-14, atol=0))


# -- issue 9: live values, bad vectors on one rank, ranks without rows ---------------------
def _dense_coupled(n=24, seed=11, block=None):
    """Every (block) row couples to every rank: each rank exchanges with every other."""
    A = sp.random(n, n, density=0.45, random_state=seed, format="csr") + sp.eye(n) * 3
    if block:
        return sp.kron(A, np.arange(1.0, 1 + block * block).reshape(block, block)).tobsr(
            blocksize=(block, block))
    return A.tocsr()


LIVE_CASES = {
    "banded": lambda: poisson_matrix((14, 6)),               # few boundary rows
    "coupled": lambda: _dense_coupled(),                      # most rows touch ghosts
    "block_banded": lambda: block_spd_matrix((6, 4), 2, seed=5).tobsr(blocksize=(2, 2)),
    "block_coupled": lambda: _dense_coupled(block=2),
}


@pytest.mark.parametrize("case", sorted(LIVE_CASES))
def test_products_use_values_at_call_time(comm, case):
    """Writes that do not bump ``_version`` (``.data``, numpy views) must reach the next
    product, forward and transposed, as scipy on the current values says."""
    A = LIVE_CASES[case]()
    blk = A.blocksize if A.format == "bsr" else None
    dA = DSparseTensor.from_global(SparseTensor.from_scipy(A) if blk else A, comm)
    n = A.shape[0]
    g = torch.Generator().manual_seed(3)
    x, X = torch.rand(n, generator=g), torch.rand(n, 2, generator=g)
    xl, Xl = dA.scatter(x, root=None), dA.scatter(X, root=None)
    ok = rel(dA.gather(dA @ xl, root=None), A @ x.numpy()) < RTOL  # fills any cache
    ok &= rel(dA.gather(dA.T @ xl, root=None), A.T @ x.numpy()) < RTOL
    scale = 1.0
    for how in ("data_mul", "numpy_view", "data_copy"):
        if how == "data_mul":
            dA.values.data.mul_(2.0)
            scale *= 2.0
        elif how == "numpy_view":
            dA.values.numpy()[...] *= -3.0
            scale *= -3.0
        else:
            dA.values.data.copy_(dA.values.data * 0.5)
            scale *= 0.5
        ok &= rel(dA.gather(dA @ xl, root=None), scale * (A @ x.numpy())) < RTOL
        ok &= rel(dA.gather(dA @ Xl, root=None), scale * (A @ X.numpy())) < RTOL
        ok &= rel(dA.gather(dA.T @ Xl, root=None), scale * (A.T @ X.numpy())) < RTOL
    assert all_ok(comm, ok)


def _size_at_least(comm, k):
    if comm.size < k:
        pytest.skip(f"needs {k} ranks")


def _raises_everywhere(comm, fn, match=None):
    """Every rank raises ValueError/TypeError (no rank hangs or returns)."""
    try:
        fn()
        raised, msg = False, ""
    except (ValueError, TypeError) as e:
        raised, msg = True, str(e)
    ok = raised and (match is None or match in msg or comm.rank == 0)
    return all_ok(comm, ok)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("block", [None, 2])
def test_bad_vector_on_one_rank_raises_on_every_neighbour(comm, block):
    _size_at_least(comm, 2)
    A = _dense_coupled(block=block)
    dA = DSparseTensor.from_global(SparseTensor.from_scipy(A) if block else A, comm)
    assert all_ok(comm, set(dA.halo.neighbours) == set(range(comm.size)) - {comm.rank})
    m = dA.n_local
    x = torch.rand(m + (1 if comm.rank == 0 else 0))
    assert _raises_everywhere(comm, lambda: dA @ x, "rank 0")
    assert _raises_everywhere(comm, lambda: dA.T @ x, "rank 0")
    # (n, 1) on rank 0, (n, 2) elsewhere: locally valid, globally inconsistent
    X = torch.rand(m, 1 if comm.rank == 0 else 2)
    assert _raises_everywhere(comm, lambda: dA @ X, "columns")
    assert _raises_everywhere(comm, lambda: dA.T @ X, "columns")
    # a matrix cast on one rank only (a local op): the next product raises, never wrong
    dB = dA.to(torch.float32) if comm.rank == comm.size - 1 else dA
    assert _raises_everywhere(comm, lambda: dB @ torch.rand(m, dtype=dB.dtype), "dtype")
    assert _raises_everywhere(comm, lambda: dB.T @ torch.rand(m, dtype=dB.dtype), "dtype")
    # nothing was left in flight: the next products are right
    xg = torch.rand(A.shape[0], generator=torch.Generator().manual_seed(2))
    ok = rel(dA.gather(dA @ dA.scatter(xg, root=None), root=None), A @ xg.numpy()) < RTOL
    ok &= rel(dA.gather(dA.T @ dA.scatter(xg, root=None), root=None), A.T @ xg.numpy()) < RTOL
    assert all_ok(comm, ok)


@pytest.mark.timeout(60)
def test_with_values_dtype_on_one_rank_raises_everywhere(comm):
    _size_at_least(comm, 2)
    dA = DSparseTensor.from_global(poisson_matrix((8, 5)), comm)
    v = dA.values.detach().clone()
    if comm.rank == 1:
        v = v.float()
    with pytest.raises(ValueError, match="values dtype"):
        dA.with_values(v)


@pytest.mark.timeout(60)
def test_collective_arguments_must_agree(comm):
    _size_at_least(comm, 2)
    A = poisson_matrix((6, 5))
    with pytest.raises(ValueError, match="root"):
        DSparseTensor.from_global(A, comm, root=comm.rank % 2)
    with pytest.raises(ValueError, match="partition"):
        DSparseTensor.from_global(A, comm, partition="metis" if comm.rank == 0 else "contiguous")
    dA = DSparseTensor.from_global(A, comm)
    with pytest.raises(ValueError, match="root"):
        dA.gather(torch.zeros(dA.n_local), root=comm.rank % 2)
    with pytest.raises(ValueError, match="columns"):
        dA.gather(torch.zeros(dA.n_local, 1 + comm.rank % 2), root=0)
    with pytest.raises(ValueError, match="root"):
        dA.scatter(torch.zeros(30), root=comm.size + 3)


def _rows_with_empty_rank(comm, A, empty):
    """CSR pieces where rank ``empty`` owns no rows and the others split the rest."""
    n, size = A.shape[0], comm.size
    owners = [r for r in range(size) if r != empty] or [0]
    counts = np.zeros(size, dtype=np.int64)
    base = np.full(len(owners), n // len(owners))
    base[: n % len(owners)] += 1
    counts[owners] = base
    offs = np.concatenate([[0], np.cumsum(counts)])
    a, b = int(offs[comm.rank]), int(offs[comm.rank + 1])
    C = A.tocsr()[a:b]
    return C.indptr, C.indices, C.data, offs


@pytest.mark.parametrize("empty", ["first", "last"])
def test_rank_owning_no_rows(comm, empty):
    """As in PETSc, a rank may own no rows: products, transposes, scatter/gather work."""
    A = random_matrix(40, density=0.15, seed=4)
    e = 0 if empty == "first" else comm.size - 1
    ip, ix, v, offs = _rows_with_empty_rank(comm, A, e if comm.size > 1 else -1)
    dA = DSparseTensor.from_local_rows(ip, ix, v, A.shape, comm)
    ok = dA.row_range == (int(offs[comm.rank]), int(offs[comm.rank + 1]))
    g = torch.Generator().manual_seed(5)
    x, X = torch.rand(40, generator=g), torch.rand(40, 3, generator=g)
    for vec in (x, X):
        xl = dA.scatter(vec, root=None)
        ok &= rel(dA.gather(dA @ xl, root=None), A @ vec.numpy()) < RTOL
        ok &= rel(dA.gather(dA.T @ xl, root=None), A.T @ vec.numpy()) < RTOL
        back = dA.gather(xl, root=0)
        ok &= (back is None) if comm.rank != 0 else torch.equal(back, vec)
    # gradients flow on every rank (the empty one gets empty gradients)
    vals = dA.values.detach().clone().requires_grad_(True)
    xl = dA.scatter(x, root=None).requires_grad_(True)
    dA.with_values(vals).matvec(xl).sum().backward()
    ok &= vals.grad.shape == vals.shape and xl.grad.shape == xl.shape
    colsum = torch.from_numpy(np.asarray(A.sum(axis=0)).ravel())
    ok &= rel(dA.gather(xl.grad, root=None), colsum) < RTOL
    assert all_ok(comm, ok)


def test_from_global_more_ranks_than_rows(comm):
    A = random_matrix(max(comm.size - 1, 1), density=0.9, seed=6)
    dA = DSparseTensor.from_global(A, comm)
    x = torch.rand(A.shape[0], generator=torch.Generator().manual_seed(7))
    out = dA.gather(dA @ dA.scatter(x, root=None), root=None)
    assert all_ok(comm, rel(out, A @ x.numpy()) < RTOL)
