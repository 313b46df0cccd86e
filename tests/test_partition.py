"""Serial tests of slasolve.partition (partitioners and their quality)."""
import sys

import numpy as np
import pytest
import scipy.sparse as sp

from slasolve import partition as P
from slasolve.partition import Partition, PartitionQuality

METHODS = ("contiguous", "metis", "rcb", "hilbert")
NPARTS = (1, 2, 3, 4, 7)


# --------------------------------------------------------------------------
# fixtures / helpers
# --------------------------------------------------------------------------
def laplacian(shape):
    """5-point (2-D) / 7-point (3-D) finite-difference Laplacian, CSR."""
    from slasolve.testing import poisson_matrix
    return poisson_matrix(shape)


def grid_coords(shape):
    axes = [np.arange(m, dtype=float) for m in shape]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(shape))


GRIDS = {
    "2d": (40, 40),
    "3d": (12, 11, 10),
}


@pytest.fixture(scope="module", params=sorted(GRIDS))
def grid(request):
    shape = GRIDS[request.param]
    return laplacian(shape), grid_coords(shape)


def brute_force_quality(A, parts, nparts):
    """Reference quality by explicit loops over the stored entries."""
    A = A.tocoo()
    edges = set()
    ghosts = [set() for _ in range(nparts)]
    nbrs = [set() for _ in range(nparts)]
    for i, j in zip(A.row.tolist(), A.col.tolist()):
        pi, pj = int(parts[i]), int(parts[j])
        if i != j and pi != pj:
            edges.add((min(i, j), max(i, j)))
        if pi != pj:
            ghosts[pi].add(j)
            nbrs[pi].add(pj)
    sizes = np.zeros(nparts, dtype=np.int64)
    for p in parts:
        sizes[p] += 1
    return dict(
        edge_cut=len(edges),
        part_sizes=sizes,
        halo_size=np.array([len(g) for g in ghosts]),
        neighbours=np.array([len(s) for s in nbrs]),
        load_imbalance=sizes.max() / (len(parts) / nparts),
    )


def check_partition(part, A, nparts):
    n = A.shape[0]
    assert isinstance(part, Partition)
    assert part.nparts == nparts
    for name in ("parts", "perm", "iperm", "offsets"):
        assert getattr(part, name).dtype == np.int64, name
    parts, perm, iperm, off = part.parts, part.perm, part.iperm, part.offsets
    # parts cover all rows, every part non-empty
    assert parts.shape == (n,)
    assert parts.min() == 0 and parts.max() == nparts - 1
    sizes = np.bincount(parts, minlength=nparts)
    assert np.all(sizes > 0)
    # perm / iperm inverse permutations
    assert np.array_equal(np.sort(perm), np.arange(n))
    assert np.array_equal(perm[iperm], np.arange(n))
    assert np.array_equal(iperm[perm], np.arange(n))
    # offsets consistent with parts
    assert off.shape == (nparts + 1,)
    assert off[0] == 0 and off[-1] == n
    assert np.array_equal(np.diff(off), sizes)
    for p in range(nparts):
        seg = perm[off[p]:off[p + 1]]
        assert np.all(parts[seg] == p)
        assert np.all(np.diff(seg) > 0)  # stable: original order inside a part
        assert part.range(p) == (off[p], off[p + 1])
    # reordered matrix: row block p of A[perm][:, perm] is part p's rows
    B = A[perm][:, perm].tocsr()
    Ad = A.toarray()
    assert np.array_equal(B.toarray(), Ad[np.ix_(perm, perm)])
    for p in range(nparts):
        lo, hi = off[p], off[p + 1]
        rows = np.flatnonzero(parts == p)
        assert np.array_equal(B[lo:hi].toarray(), Ad[rows][:, perm])
        # diagonal block holds exactly the entries of A internal to part p
        internal = Ad[np.ix_(rows, rows)]
        assert np.count_nonzero(B[lo:hi, lo:hi].toarray()) == np.count_nonzero(internal)


def check_quality(q, A, parts, nparts):
    assert isinstance(q, PartitionQuality)
    ref = brute_force_quality(A, parts, nparts)
    assert isinstance(q.edge_cut, int)
    assert q.edge_cut == ref["edge_cut"]
    assert np.array_equal(q.part_sizes, ref["part_sizes"])
    assert np.array_equal(q.halo_size, ref["halo_size"])
    assert np.array_equal(q.neighbours, ref["neighbours"])
    assert q.load_imbalance == pytest.approx(ref["load_imbalance"])
    s = q.summary()
    assert isinstance(s, str) and "\n" not in s and str(q.edge_cut) in s


def run_method(method, A, coords, nparts):
    if method == "contiguous":
        return P.contiguous(A.shape[0], nparts, graph=A)
    if method == "metis":
        return P.metis(A, nparts)
    if method == "rcb":
        return P.rcb(coords, nparts, graph=A)
    return P.hilbert(coords, nparts, graph=A)


# --------------------------------------------------------------------------
# every method, both grids, several part counts
# --------------------------------------------------------------------------
@pytest.mark.parametrize("nparts", NPARTS)
@pytest.mark.parametrize("method", METHODS)
def test_partition_valid_and_quality(grid, method, nparts):
    A, coords = grid
    part = run_method(method, A, coords, nparts)
    assert part.method == method
    check_partition(part, A, nparts)
    check_quality(part.quality, A, part.parts, nparts)
    # the dispatcher gives the same partition and quality from A's pattern
    part2 = P.partition(A, nparts, method=method, coords=coords)
    assert np.array_equal(part2.parts, part.parts)
    check_quality(part2.quality, A, part2.parts, nparts)


@pytest.mark.parametrize("method", ("rcb", "hilbert"))
@pytest.mark.parametrize("nparts", (2, 3, 4, 5, 7, 16))
def test_geometric_balance(grid, method, nparts):
    A, coords = grid
    part = P.partition(A, nparts, method=method, coords=coords)
    assert part.quality.load_imbalance <= 1.01
    # sizes are exactly the PETSC_DECIDE split
    n = A.shape[0]
    expect = np.full(nparts, n // nparts)
    expect[: n % nparts] += 1
    assert np.array_equal(np.diff(part.offsets), expect)


@pytest.mark.parametrize("method", ("metis", "rcb", "hilbert"))
@pytest.mark.parametrize("nparts", (2, 4, 7))
def test_edge_cut_far_below_random(method, nparts):
    shape = GRIDS["2d"]
    A, coords = laplacian(shape), grid_coords(shape)
    rng = np.random.default_rng(0)
    rand_parts = rng.integers(0, nparts, size=A.shape[0])
    random_cut = P.quality(A, rand_parts, nparts).edge_cut
    cut = P.partition(A, nparts, method=method, coords=coords).quality.edge_cut
    assert cut < 0.1 * random_cut, (cut, random_cut)
    # a 2-D 40x40 grid split in k pieces needs roughly k * 40 cut edges at most
    assert cut <= 3 * 40 * nparts


def test_rcb_splits_longest_axis_and_proportionally():
    # 1-D strip of 10 x 2 points: 5 parts -> 2 + 3, all cuts across the long axis
    coords = grid_coords((10, 2))
    A = laplacian((10, 2))
    part = P.rcb(coords, 5, graph=A)
    for p in range(5):
        xs = coords[part.parts == p, 0]
        assert xs.max() - xs.min() == 1  # 2 columns of the strip per part
    assert part.quality.edge_cut == 4 * 2
    # order along the strip: parts 0, 1 on the left, 2..4 on the right
    left = np.unique(part.parts[coords[:, 0] < 4])
    assert set(left.tolist()) == {0, 1}


def test_contiguous_is_petsc_split():
    part = P.contiguous(10, 4)
    assert part.offsets.tolist() == [0, 3, 6, 8, 10]
    assert np.array_equal(part.perm, np.arange(10))
    assert part.quality is None
    assert part.parts.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]


@pytest.mark.parametrize("d,bits", [(2, 1), (2, 3), (2, 5), (3, 1), (3, 2), (3, 4)])
def test_hilbert_curve_is_continuous(d, bits):
    q = grid_coords((2 ** bits,) * d).astype(np.uint64)
    h = P._hilbert_index(q, bits)
    assert np.array_equal(np.sort(h), np.arange(2 ** (bits * d)))
    walk = q[np.argsort(h)].astype(np.int64)
    assert np.all(np.abs(np.diff(walk, axis=0)).sum(axis=1) == 1)


@pytest.mark.parametrize("method", ("rcb", "hilbert"))
def test_geometric_degenerate_coords(method):
    n = 12
    # 1-D coords
    x = np.linspace(0, 1, n)[::-1].reshape(-1, 1)
    part = getattr(P, method)(x, 3)
    assert part.nparts == 3 and np.all(np.diff(part.offsets) == 4)
    # points sorted by x: each part is an interval of x
    for p in range(3):
        xs = x[part.parts == p, 0]
        others = x[part.parts != p, 0]
        assert np.all((others < xs.min()) | (others > xs.max()))
    # all points identical: still a valid balanced partition
    same = np.ones((n, 3))
    part = getattr(P, method)(same, 5)
    assert np.array_equal(np.bincount(part.parts), [3, 3, 2, 2, 2])


def test_from_parts_and_quality_function():
    A = laplacian((6, 5))
    rng = np.random.default_rng(1)
    parts = rng.permutation(np.arange(A.shape[0]) % 4)
    part = Partition.from_parts(parts, 4, graph=A)
    assert part.method == "custom"
    check_partition(part, A, 4)
    check_quality(part.quality, A, parts, 4)
    check_quality(P.quality(A, parts, 4), A, parts, 4)
    assert Partition.from_parts(parts, 4).quality is None
    assert "nparts=4" in repr(part)


def test_quality_nonsymmetric_pattern():
    # halo/neighbours follow the stored (directed) pattern, edge cut the
    # symmetrised one; the diagonal never counts
    A = sp.csr_matrix(np.array([
        [1, 1, 0, 0],
        [1, 1, 0, 1],
        [1, 0, 1, 0],
        [0, 0, 1, 1],
    ]))
    parts = np.array([0, 1, 1, 0])
    q = P.quality(A, parts, 2)
    check_quality(q, A, parts, 2)
    assert q.edge_cut == 4  # (0,1) stored both ways counts once
    assert q.halo_size.tolist() == [2, 2]
    # one-way reference: part 0 needs a ghost, part 1 does not
    U = sp.csr_matrix(np.array([[1, 1], [0, 1]]))
    qu = P.quality(U, np.array([0, 1]), 2)
    assert qu.edge_cut == 1
    assert qu.halo_size.tolist() == [1, 0]
    assert qu.neighbours.tolist() == [1, 0]
    # explicit duplicates / unsorted COO input is fine
    coo = sp.coo_matrix((np.ones(4), ([0, 0, 1, 1], [1, 1, 0, 0])), shape=(2, 2))
    assert P.quality(coo, np.array([0, 1]), 2).edge_cut == 1


def test_metis_empty_part_raises(monkeypatch):
    class FakeMetis:
        @staticmethod
        def part_graph(nparts, *args, **kwargs):
            return (0, [0, 0, 1, 1, 0, 1])  # part 2 left empty

    monkeypatch.setitem(sys.modules, "pymetis", FakeMetis)
    A = laplacian((6,))
    with pytest.raises(ValueError, match=r"part\(s\) 2 .*empty.*fewer parts"):
        P.metis(A, 3)


def test_metis_missing_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "pymetis", None)
    A = laplacian((6,))
    with pytest.raises(ImportError, match="pip install pymetis"):
        P.metis(A, 2)
    # nparts == 1 never calls metis
    assert P.metis(A, 1).nparts == 1


# --------------------------------------------------------------------------
# bad input
# --------------------------------------------------------------------------
@pytest.mark.parametrize("method", METHODS)
def test_bad_nparts(method):
    A = laplacian((5, 4))
    coords = grid_coords((5, 4))
    for bad in (0, -1, 21):
        with pytest.raises(ValueError, match="nparts"):
            P.partition(A, bad, method=method, coords=coords)
    for bad in (2.0, "2", None, True, 2.5):
        with pytest.raises(TypeError, match="nparts"):
            P.partition(A, bad, method=method, coords=coords)
    # numpy integers are integers
    assert P.partition(A, np.int32(2), method=method, coords=coords).nparts == 2


def test_bad_method_and_graph():
    A = laplacian((5, 4))
    with pytest.raises(ValueError, match="method"):
        P.partition(A, 2, method="scotch")
    with pytest.raises(ValueError, match="method"):
        P.partition(A, 2, method=None)
    rect = sp.random(5, 6, density=0.5, format="csr")
    with pytest.raises(ValueError, match="square"):
        P.partition(rect, 2)
    with pytest.raises(ValueError, match="square"):
        P.metis(rect, 2)
    with pytest.raises(ValueError, match="square"):
        P.quality(rect, np.zeros(5, dtype=int), 1)
    with pytest.raises(ValueError, match="square"):
        P.contiguous(5, 2, graph=rect)
    with pytest.raises(ValueError, match="graph"):
        P.rcb(grid_coords((5, 4)), 2, graph=laplacian((5, 5)))


@pytest.mark.parametrize("method", ("rcb", "hilbert"))
def test_bad_coords(method):
    A = laplacian((5, 4))
    n = A.shape[0]
    good = grid_coords((5, 4))
    fn = getattr(P, method)
    with pytest.raises(ValueError, match="coords"):
        P.partition(A, 2, method=method)  # coords missing
    for bad in (np.zeros(n), np.zeros((n, 4)), np.zeros((n, 0)), np.zeros((n, 2, 1))):
        with pytest.raises(ValueError, match="coords"):
            fn(bad, 2)
        with pytest.raises(ValueError, match="coords"):
            P.partition(A, 2, method=method, coords=bad)
    with pytest.raises(ValueError, match="coords"):
        P.partition(A, 2, method=method, coords=good[:-1])
    for val in (np.nan, np.inf, -np.inf):
        bad = good.copy()
        bad[3, 1] = val
        with pytest.raises(ValueError, match="coords.*NaN or Inf"):
            fn(bad, 2)
        with pytest.raises(ValueError, match="coords.*NaN or Inf"):
            P.partition(A, 2, method=method, coords=bad)


def test_bad_parts():
    with pytest.raises(ValueError, match=r"part\(s\) 1 .*empty"):
        Partition.from_parts([0, 0, 2, 2], 3)
    with pytest.raises(ValueError, match="parts must lie"):
        Partition.from_parts([0, 1, 3], 3)
    with pytest.raises(ValueError, match="parts must lie"):
        Partition.from_parts([0, -1, 2], 3)
    with pytest.raises(ValueError, match="1-D"):
        Partition.from_parts([[0, 1]], 2)
    with pytest.raises(TypeError, match="integers"):
        Partition.from_parts([0.5, 1.0], 2)
    with pytest.raises(TypeError, match="nparts"):
        Partition.from_parts([0, 1], 2.0)
    with pytest.raises(ValueError, match="nparts"):
        P.contiguous(3, 4)
    with pytest.raises(ValueError, match="parts must have shape"):
        P.quality(laplacian((4,)), np.zeros(3, dtype=int), 1)


# --------------------------------------------------------------------------
# speed smoke test (no timing asserts)
# --------------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_speed_smoke_1m_nodes_128_parts():
    shape = (1000, 1000)
    A = laplacian(shape)
    coords = grid_coords(shape)
    for method in ("rcb", "hilbert"):
        part = P.partition(A, 128, method=method, coords=coords)
        q = part.quality
        assert q.part_sizes.sum() == A.shape[0]
        assert q.load_imbalance <= 1.01
        # a good 128-way split of a 1000^2 grid cuts ~ 2 * sqrt(128) * 1000 edges
        assert q.edge_cut < 50_000


def test_from_parts_allow_empty():
    p = Partition.from_parts([0, 0, 2, 2], 3, allow_empty=True)
    assert list(p.offsets) == [0, 2, 2, 4] and list(p.perm) == [0, 1, 2, 3]
    p = Partition.from_parts([1, 1], 4, allow_empty=True)  # more parts than rows
    assert list(p.offsets) == [0, 0, 2, 2, 2]
    with pytest.raises(ValueError, match=r"exceeds the number of rows"):
        Partition.from_parts([1, 1], 4)


@pytest.mark.mpi
def test_from_global_with_an_empty_part(comm):
    """from_global accepts a Partition with an empty part: that rank owns no rows."""
    import torch
    from mpi4py import MPI
    from slasolve import DSparseTensor
    from slasolve.testing import poisson_matrix
    A = poisson_matrix((7, 5))
    n, size = A.shape[0], comm.size
    rows_part = np.arange(n) % max(size - 1, 1) + (1 if size > 1 else 0)  # part 0 empty
    part = Partition.from_parts(rows_part, size, allow_empty=True)
    dA = DSparseTensor.from_global(A, comm, partition=part)
    assert dA.n_local == (0 if comm.rank == 0 and size > 1 else dA.n_local)
    x = torch.rand(n, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    y = dA.gather(dA @ dA.scatter(x, root=None), root=None)
    z = dA.gather(dA.T @ dA.scatter(x, root=None), root=None)
    ok = np.allclose(y.numpy(), A @ x.numpy(), rtol=1e-13) and np.allclose(z.numpy(), A.T @ x.numpy(), rtol=1e-13)
    assert comm.allreduce(int(ok), op=MPI.MIN) == 1


FOREIGN_METIS = """
import ctypes, ctypes.util, os, sys
# what `import dolfinx` (0.5) leaves behind: RTLD_GLOBAL for every later import, and the system's
# libmetis (through its C++ library's CHOLMOD) in the global symbol scope
sys.setdlopenflags(os.RTLD_NOW | os.RTLD_GLOBAL)
ctypes.CDLL(sys.argv[1], mode=os.RTLD_GLOBAL)
import numpy as np, scipy.sparse as sp
from slasolve.partition import metis
rng = np.random.default_rng(0)
for trial in range(3):
    n = int(rng.integers(50, 3000))
    A = sp.random(n, n, density=min(1.0, 8.0 / n), random_state=int(rng.integers(1 << 30)), format="csr")
    A = A + A.T + sp.eye(n)
    for k in (2, 3, 5, 8):
        assert np.bincount(metis(A, k).parts, minlength=k).min() > 0
print("partitions ok")
"""


@pytest.mark.once
def test_metis_beside_a_global_system_metis():
    """pymetis bundles METIS with its symbols exported: with another METIS in the global symbol
    scope (after `import dolfinx`), its internal calls bound to that copy and the process crashed
    (SEGV) or hung in free() in the first partition. slasolve loads pymetis with RTLD_DEEPBIND."""
    import ctypes.util
    import os
    import subprocess

    pytest.importorskip("pymetis")
    lib = ctypes.util.find_library("metis")
    if lib is None:
        pytest.skip("no system libmetis to put in the global scope")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", FOREIGN_METIS, lib], capture_output=True, text=True,
                         timeout=240, env=env)
    assert out.returncode == 0 and "partitions ok" in out.stdout, (out.returncode, out.stdout[-2000:],
                                                                 out.stderr[-3000:])
