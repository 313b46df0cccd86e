"""Graph partitioners: assign every row (unknown) of a sparse matrix to a rank.

Every function here is **local (not collective)**: it works on global NumPy
arrays on one process.  It is used by ``DSparseTensor.from_global`` and for
serial partition studies (128 parts of meshes with millions of unknowns), so
all work is vectorised with NumPy; loops run only over bits, bisection levels
or parts.

Methods
-------
``contiguous``
    Rows ``[offsets[p], offsets[p+1])`` in the user's order go to part ``p``,
    the first ``n % nparts`` parts getting one extra row (PETSc's
    ``PETSC_DECIDE`` split).
``metis``
    ``pymetis.part_graph`` (k-way) on the symmetrised pattern without diagonal.
``rcb``
    Recursive coordinate bisection along the longest extent of each box;
    any ``nparts`` (``k`` parts split into ``k // 2`` and ``k - k // 2``,
    point counts proportional).  Part sizes equal the contiguous split.
``hilbert``
    Coordinates quantised on a ``2**bits`` grid (same scale on every axis),
    sorted along the Hilbert curve (Skilling's algorithm, vectorised) and cut
    into ``nparts`` contiguous chunks of the contiguous-split sizes.

Conventions (decisions recorded here)
-------------------------------------
* A *graph* is a square sparse matrix (anything with ``.tocsr()``, a
  :class:`slasolve.sparse.SparseTensor` via ``to_scipy``, or a dense 2-D array);
  only its stored pattern is used (explicit zeros count as edges).
* ``edge_cut`` counts undirected edges ``{i, j}``, ``i != j``, of the
  symmetrised pattern whose ends lie in different parts.
* ``halo_size`` and ``neighbours`` use the pattern as stored (row ``i``
  references column ``j`` when ``A[i, j]`` is stored): they are the ghost
  columns and neighbour ranks a row-sharded matvec needs.  For a symmetric
  pattern the distinction vanishes.
* The renumbering is stable: inside a part, rows keep their original order.
* A partition in which some part is empty is an error (``ValueError``), never
  silently repaired; ``Partition.from_parts(..., allow_empty=True)`` builds one on
  purpose (ranks owning no rows, which PETSc and ``DSparseTensor`` support).
"""
from __future__ import annotations

import operator
import os
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np
import scipy.sparse as sp

from .placement import split_offsets

__all__ = [
    "PartitionQuality",
    "Partition",
    "METHODS",
    "contiguous",
    "metis",
    "rcb",
    "hilbert",
    "partition",
    "quality",
]

METHODS: Tuple[str, ...] = ("contiguous", "metis", "rcb", "hilbert")


# --------------------------------------------------------------------------
# validation helpers
# --------------------------------------------------------------------------
def _check_nparts(nparts: Any, n: int, name: str = "nparts") -> int:
    if isinstance(nparts, (bool, np.bool_)):
        raise TypeError(f"{name} must be an integer, got {type(nparts).__name__}")
    try:
        k = operator.index(nparts)
    except TypeError:
        raise TypeError(
            f"{name} must be an integer, got {type(nparts).__name__} ({nparts!r})"
        ) from None
    if k < 1:
        raise ValueError(f"{name} must be >= 1, got {k}")
    if k > n:
        raise ValueError(
            f"{name}={k} exceeds the number of rows n={n}: every part needs at "
            f"least one row"
        )
    return int(k)


def _as_csr(graph: Any, name: str = "graph") -> sp.csr_matrix:
    """Return the pattern of ``graph`` as a canonical square CSR matrix."""
    if sp.issparse(graph):
        g = graph.tocsr()
    elif hasattr(graph, "tocsr"):
        g = graph.tocsr()
    elif hasattr(graph, "to_scipy"):  # slasolve.sparse.SparseTensor
        g = graph.to_scipy()
        g = g.tocsr() if sp.issparse(g) else sp.csr_matrix(g)
    else:
        arr = np.asarray(graph)
        if arr.ndim != 2:
            raise ValueError(
                f"{name} must be a 2-D sparse matrix (scipy.sparse or anything "
                f"with .tocsr()), got an object of shape {arr.shape}"
            )
        g = sp.csr_matrix(arr)
    if g.ndim != 2 or g.shape[0] != g.shape[1]:
        raise ValueError(f"{name} must be square, got shape {tuple(g.shape)}")
    if not g.has_canonical_format:
        g = g.copy()
        g.sum_duplicates()  # sorts indices, merges duplicates
    return g


def _coo_pattern(g: sp.csr_matrix) -> Tuple[np.ndarray, np.ndarray]:
    """Row and column index (int64) of every stored entry of a CSR matrix."""
    n = g.shape[0]
    indptr = np.asarray(g.indptr, dtype=np.int64)
    rows = np.repeat(np.arange(n, dtype=np.int64), np.diff(indptr))
    cols = np.asarray(g.indices, dtype=np.int64)
    return rows, cols


def _check_coords(coords: Any, name: str = "coords") -> np.ndarray:
    try:
        x = np.asarray(coords, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a numeric array of shape (n, d): {exc}") from None
    if x.ndim != 2 or not 1 <= x.shape[1] <= 3:
        raise ValueError(
            f"{name} must have shape (n, d) with d in 1..3, got shape {x.shape}"
            + (" (use coords.reshape(-1, 1) for 1-D points)" if x.ndim == 1 else "")
        )
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty: nothing to partition")
    if not np.all(np.isfinite(x)):
        bad = int(np.count_nonzero(~np.isfinite(x).all(axis=1)))
        raise ValueError(f"{name} contains NaN or Inf ({bad} point(s))")
    return x


def _check_graph_size(g: Optional[sp.csr_matrix], n: int, name: str = "graph") -> None:
    if g is not None and g.shape[0] != n:
        raise ValueError(
            f"{name} has {g.shape[0]} rows but there are {n} points/rows to partition"
        )


def _geometric_args(coords: Any, nparts: int, graph: Any):
    """Local. ``(points, nparts, graph as CSR or None)`` of a geometric partitioner, checked."""
    x = _check_coords(coords)
    k = _check_nparts(nparts, x.shape[0])
    g = _as_csr(graph) if graph is not None else None
    _check_graph_size(g, x.shape[0])
    return x, k, g


def _split_sizes(n: int, nparts: int) -> np.ndarray:
    """PETSC_DECIDE split: the first ``n % nparts`` parts get one extra row."""
    return np.diff(split_offsets(n, nparts))


# --------------------------------------------------------------------------
# results
# --------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class PartitionQuality:
    """Local (not collective). Quality measures of a partition of a graph.

    Attributes
    ----------
    edge_cut : int
        Number of undirected edges ``{i, j}`` (``i != j``) of the symmetrised
        pattern whose ends lie in different parts.
    part_sizes : numpy.ndarray
        ``(nparts,)`` int64, rows per part.
    halo_size : numpy.ndarray
        ``(nparts,)`` int64, number of distinct rows owned by other parts that
        the rows of part ``p`` reference (ghosts of rank ``p``).
    neighbours : numpy.ndarray
        ``(nparts,)`` int64, number of distinct other parts part ``p``
        references.
    load_imbalance : float
        ``max(part_sizes) / mean(part_sizes)`` (1.0 is perfect).
    """

    edge_cut: int
    part_sizes: np.ndarray
    halo_size: np.ndarray
    neighbours: np.ndarray
    load_imbalance: float

    @property
    def nparts(self) -> int:
        """Number of parts."""
        return int(self.part_sizes.shape[0])

    def summary(self) -> str:
        """Local (not collective). One short human-readable line.

        Returns
        -------
        str
            Parts, edge cut, size range and imbalance, halo and neighbour
            counts (max / mean).
        """
        s, h, nb = self.part_sizes, self.halo_size, self.neighbours
        return (
            f"{self.nparts} parts: edge cut {self.edge_cut}, "
            f"sizes {int(s.min())}..{int(s.max())} (imbalance {self.load_imbalance:.3f}), "
            f"halo max {int(h.max())} mean {float(h.mean()):.1f}, "
            f"neighbours max {int(nb.max())} mean {float(nb.mean()):.1f}"
        )


@dataclass(frozen=True, eq=False)
class Partition:
    """Local (not collective). Assignment of rows to parts and its renumbering.

    Attributes
    ----------
    parts : numpy.ndarray
        ``(n,)`` int64, part of every row in the user's (original) numbering.
    nparts : int
        Number of parts (all non-empty).
    perm : numpy.ndarray
        ``(n,)`` int64, new index -> original index: part 0's rows first, the
        original order kept inside each part.
    iperm : numpy.ndarray
        ``(n,)`` int64, original index -> new index (inverse of ``perm``).
    offsets : numpy.ndarray
        ``(nparts + 1,)`` int64, part ``p`` owns new indices
        ``[offsets[p], offsets[p + 1])``.
    method : str
        Name of the partitioner that produced it.
    quality : PartitionQuality or None
        Quality measures, when a graph was available.
    """

    parts: np.ndarray
    nparts: int
    perm: np.ndarray
    iperm: np.ndarray
    offsets: np.ndarray
    method: str
    quality: Optional[PartitionQuality]

    @property
    def n(self) -> int:
        """Number of rows."""
        return int(self.parts.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        """``(nparts,)`` rows per part."""
        return np.diff(self.offsets)

    def range(self, p: int) -> Tuple[int, int]:
        """Local (not collective). New-index range ``(start, end)`` owned by part ``p``."""
        p = operator.index(p)
        if not 0 <= p < self.nparts:
            raise ValueError(f"p must be in [0, {self.nparts}), got {p}")
        return int(self.offsets[p]), int(self.offsets[p + 1])

    @classmethod
    def from_parts(
        cls,
        parts: Any,
        nparts: int,
        graph: Any = None,
        method: str = "custom",
        *,
        allow_empty: bool = False,
    ) -> "Partition":
        """Local (not collective). Build a partition from a part id per row.

        Parameters
        ----------
        parts : array_like of int, shape (n,)
            Part of every row, in ``[0, nparts)``.
        nparts : int
            Number of parts; every part must own at least one row.
        graph : sparse matrix, optional
            ``(n, n)`` pattern used to compute :attr:`Partition.quality`.
        method : str, optional
            Name recorded on the result.
        allow_empty : bool, optional
            Accept parts without rows (ranks owning no rows, as PETSc allows;
            ``DSparseTensor.from_global`` supports them). Default ``False``: an
            empty part is usually a partitioner's failure.

        Returns
        -------
        Partition

        Raises
        ------
        TypeError
            If ``nparts`` is not an integer or ``parts`` is not integral.
        ValueError
            If ``parts`` is not 1-D, has ids outside ``[0, nparts)``, some part
            is empty (unless ``allow_empty``), or ``graph`` does not match.
        """
        p = np.asarray(parts)
        if p.ndim != 1:
            raise ValueError(f"parts must be 1-D, got shape {p.shape}")
        if p.size and not np.issubdtype(p.dtype, np.integer):
            if np.issubdtype(p.dtype, np.floating) and np.all(p == np.round(p)):
                pass
            else:
                raise TypeError(f"parts must hold integers, got dtype {p.dtype}")
        p = p.astype(np.int64, copy=True)
        n = int(p.shape[0])
        k = _check_nparts(nparts, n if not allow_empty else np.iinfo(np.int64).max)
        if n and (p.min() < 0 or p.max() >= k):
            raise ValueError(
                f"parts must lie in [0, {k}), got values in [{int(p.min())}, {int(p.max())}]"
            )
        sizes = np.bincount(p, minlength=k)
        empty = np.flatnonzero(sizes == 0)
        if empty.size and not allow_empty:
            shown = ", ".join(str(int(e)) for e in empty[:10])
            more = f" (and {empty.size - 10} more)" if empty.size > 10 else ""
            raise ValueError(
                f"partition by {method!r} into nparts={k} left part(s) {shown}{more} "
                f"empty ({empty.size} of {k}); use fewer parts (nparts <= "
                f"{k - empty.size} would be a start) or another method"
            )
        # Stable counting sort; a small dtype lets numpy use radix sort (O(n)).
        key = p.astype(np.int16) if k <= np.iinfo(np.int16).max else p
        perm = np.argsort(key, kind="stable").astype(np.int64, copy=False)
        iperm = np.empty(n, dtype=np.int64)
        iperm[perm] = np.arange(n, dtype=np.int64)
        offsets = np.zeros(k + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        q = None
        if graph is not None:
            q = quality(graph, p, k)
        return cls(parts=p, nparts=k, perm=perm, iperm=iperm, offsets=offsets,
                   method=str(method), quality=q)

    def __repr__(self) -> str:
        q = f", {self.quality.summary()}" if self.quality is not None else ""
        return f"Partition(method={self.method!r}, n={self.n}, nparts={self.nparts}{q})"


# --------------------------------------------------------------------------
# quality
# --------------------------------------------------------------------------
def quality(graph: Any, parts: Any, nparts: int) -> PartitionQuality:
    """Local (not collective). Quality measures of ``parts`` on ``graph``.

    Parameters
    ----------
    graph : sparse matrix
        Square ``(n, n)`` matrix; only its stored pattern is used.
    parts : array_like of int, shape (n,)
        Part of every row, in ``[0, nparts)``.
    nparts : int
        Number of parts (empty parts are allowed here).

    Returns
    -------
    PartitionQuality

    Raises
    ------
    TypeError
        If ``nparts`` is not an integer.
    ValueError
        If ``graph`` is not square or does not match ``parts``, or part ids
        are out of range.
    """
    g = _as_csr(graph)
    n = g.shape[0]
    p = np.asarray(parts)
    if p.ndim != 1 or p.shape[0] != n:
        raise ValueError(f"parts must have shape ({n},) to match graph, got {p.shape}")
    p = p.astype(np.int64, copy=False)
    k = _check_nparts(nparts, max(n, 1))
    if n and (p.min() < 0 or p.max() >= k):
        raise ValueError(
            f"parts must lie in [0, {k}), got values in [{int(p.min())}, {int(p.max())}]"
        )
    sizes = np.bincount(p, minlength=k).astype(np.int64)

    rows, cols = _coo_pattern(g)
    pr = p[rows]
    pc = p[cols]
    cut = pr != pc  # off-part references (never on the diagonal)
    rows, cols, pr, pc = rows[cut], cols[cut], pr[cut], pc[cut]

    # edge cut: distinct undirected pairs among the off-part references
    lo = np.minimum(rows, cols)
    hi = np.maximum(rows, cols)
    edge_cut = int(np.unique(lo * n + hi).size)

    # halo: distinct (part, ghost column) pairs, counted per part
    ghost_keys = np.unique(pr * n + cols)
    halo = np.bincount(ghost_keys // n, minlength=k).astype(np.int64)

    # neighbours: distinct (part, other part) pairs, counted per part
    nb_keys = np.unique(pr * k + pc)
    neighbours = np.bincount(nb_keys // k, minlength=k).astype(np.int64)

    mean = n / k
    imbalance = float(sizes.max() / mean) if n else 1.0
    return PartitionQuality(edge_cut=edge_cut, part_sizes=sizes, halo_size=halo,
                            neighbours=neighbours, load_imbalance=imbalance)


# --------------------------------------------------------------------------
# partitioners
# --------------------------------------------------------------------------
def contiguous(n: int, nparts: int, graph: Any = None) -> Partition:
    """Local (not collective). Contiguous blocks of rows, PETSc's split.

    Parameters
    ----------
    n : int
        Number of rows.
    nparts : int
        Number of parts; the first ``n % nparts`` parts get one extra row
        (same as ``PETSC_DECIDE``).
    graph : sparse matrix, optional
        ``(n, n)`` pattern for :attr:`Partition.quality`.

    Returns
    -------
    Partition
        ``perm`` is the identity.
    """
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"n must be an integer, got {type(n).__name__}") from None
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    k = _check_nparts(nparts, n)
    g = _as_csr(graph) if graph is not None else None
    _check_graph_size(g, n)
    parts = np.repeat(np.arange(k, dtype=np.int64), _split_sizes(n, k))
    return Partition.from_parts(parts, k, graph=g, method="contiguous")


def _symmetric_adjacency(g: sp.csr_matrix) -> Tuple[np.ndarray, np.ndarray]:
    """CSR (xadj, adjncy), int64, of the symmetrised pattern without diagonal."""
    n = g.shape[0]
    b = sp.csr_matrix((np.ones(g.nnz, dtype=np.int8), g.indices, g.indptr), shape=g.shape)
    s = (b + b.T).tocsr()  # pattern union; sums of ones never cancel
    s.sum_duplicates()
    rows, cols = _coo_pattern(s)
    keep = rows != cols
    xadj = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows[keep], minlength=n), out=xadj[1:])
    return xadj, cols[keep]


def _import_pymetis():
    """Local. The ``pymetis`` module, its extension loaded with ``RTLD_DEEPBIND`` when slasolve
    imports it first.

    pymetis bundles its own METIS and exports its symbols; where another METIS is in the
    process's global symbol scope, pymetis's calls between its own METIS functions bind to that
    one and the two copies' memory bookkeeping corrupts the heap (a crash or a hang in
    ``free``). DOLFINx 0.5 sets ``RTLD_GLOBAL`` for every later import and never restores it,
    and its C++ library brings the system's ``libmetis`` (through CHOLMOD): ``import dolfinx``
    before the first METIS partition was enough. ``RTLD_DEEPBIND`` makes the extension look up
    its own symbols first; ``RTLD_LOCAL`` keeps them out of the global scope."""
    if sys.modules.get("pymetis") is None:
        flags = sys.getdlopenflags()
        sys.setdlopenflags(os.RTLD_NOW | os.RTLD_LOCAL | getattr(os, "RTLD_DEEPBIND", 0))
        try:
            import pymetis  # noqa: F401
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "slasolve.partition.metis needs pymetis: `pip install pymetis` "
                "(or `pip install slasolve[partition]`)"
            ) from exc
        finally:
            sys.setdlopenflags(flags)
    return sys.modules["pymetis"]


def metis(graph: Any, nparts: int) -> Partition:
    """Local (not collective). k-way METIS partition (via ``pymetis``).

    Parameters
    ----------
    graph : sparse matrix
        Square ``(n, n)`` matrix; METIS sees its symmetrised pattern without
        the diagonal.
    nparts : int
        Number of parts (1 is handled without calling METIS).

    Returns
    -------
    Partition

    Raises
    ------
    ImportError
        If ``pymetis`` is not installed.
    ValueError
        If METIS leaves a part empty (small graphs, many parts).
    """
    g = _as_csr(graph)
    n = g.shape[0]
    k = _check_nparts(nparts, n)
    if k == 1:
        return Partition.from_parts(np.zeros(n, dtype=np.int64), 1, graph=g, method="metis")
    pymetis = _import_pymetis()
    xadj, adjncy = _symmetric_adjacency(g)
    if hasattr(pymetis, "CSRAdjacency"):
        res = pymetis.part_graph(k, pymetis.CSRAdjacency(xadj, adjncy))
    else:  # pragma: no cover - older pymetis
        res = pymetis.part_graph(k, xadj=xadj, adjncy=adjncy)
    parts = np.asarray(res[1], dtype=np.int64)
    return Partition.from_parts(parts, k, graph=g, method="metis")


def rcb(coords: Any, nparts: int, graph: Any = None) -> Partition:
    """Local (not collective). Recursive coordinate bisection.

    Each box of points meant for ``k`` parts is split along its longest
    extent into boxes for ``k // 2`` and ``k - k // 2`` parts, with point
    counts proportional, so the final part sizes equal the contiguous split
    (``load_imbalance <= 1 + nparts / n``).

    Parameters
    ----------
    coords : array_like, shape (n, d)
        Point of every row, ``d`` in 1..3, finite.
    nparts : int
        Number of parts (any positive integer <= n).
    graph : sparse matrix, optional
        ``(n, n)`` pattern for :attr:`Partition.quality`.

    Returns
    -------
    Partition
    """
    x, k, g = _geometric_args(coords, nparts, graph)
    n = x.shape[0]
    csizes = split_offsets(n, k)
    parts = np.empty(n, dtype=np.int64)
    # Work list of (point ids, first part, number of parts); one pass per level.
    level = [(np.arange(n, dtype=np.int64), 0, k)]
    while level:
        nxt = []
        for idx, p0, kk in level:
            if kk == 1:
                parts[idx] = p0
                continue
            kl = kk // 2
            nl = int(csizes[p0 + kl] - csizes[p0])
            pts = x[idx]
            dim = int(np.argmax(pts.max(axis=0) - pts.min(axis=0)))
            order = np.argpartition(pts[:, dim], nl - 1)
            nxt.append((idx[order[:nl]], p0, kl))
            nxt.append((idx[order[nl:]], p0 + kl, kk - kl))
        level = nxt
    return Partition.from_parts(parts, k, graph=g, method="rcb")


# Bit-spreading masks: spread the low bits of a uint64 so that consecutive
# bits land ``d`` positions apart (Morton interleaving).
_SPREAD2 = (
    (16, 0x0000FFFF0000FFFF),
    (8, 0x00FF00FF00FF00FF),
    (4, 0x0F0F0F0F0F0F0F0F),
    (2, 0x3333333333333333),
    (1, 0x5555555555555555),
)
_SPREAD3 = (
    (32, 0x001F00000000FFFF),
    (16, 0x001F0000FF0000FF),
    (8, 0x100F00F00F00F00F),
    (4, 0x10C30C30C30C30C3),
    (2, 0x1249249249249249),
)


def _spread(v: np.ndarray, d: int) -> np.ndarray:
    if d == 1:
        return v
    if d == 2:
        v = v & np.uint64(0xFFFFFFFF)
        table = _SPREAD2
    else:
        v = v & np.uint64(0x1FFFFF)
        table = _SPREAD3
    for shift, mask in table:
        v = (v | (v << np.uint64(shift))) & np.uint64(mask)
    return v


def _hilbert_index(q: np.ndarray, bits: int) -> np.ndarray:
    """Hilbert-curve index of integer points ``q`` (shape (n, d), 0 <= q < 2**bits).

    Skilling's "AxestoTranspose" (AIP Conf. Proc. 707, 2004), vectorised over
    points with loops over bits and axes, then the transposed index is
    interleaved into one uint64 (``d * bits <= 64``).
    """
    n, d = q.shape
    if d * bits > 64:
        raise ValueError(f"bits={bits} too large for d={d} (need d*bits <= 64)")
    X = [q[:, i].astype(np.uint64) for i in range(d)]
    if d == 1:
        return X[0]
    M = 1 << (bits - 1)
    # inverse undo
    Q = M
    while Q > 1:
        P = np.uint64(Q - 1)
        Qu = np.uint64(Q)
        for i in range(d):
            hit = (X[i] & Qu) != 0
            if i == 0:
                X[0] = np.where(hit, X[0] ^ P, X[0])
            else:
                x0 = np.where(hit, X[0] ^ P, X[0])
                t = np.where(hit, np.uint64(0), (X[0] ^ X[i]) & P)
                X[0] = x0 ^ t
                X[i] = X[i] ^ t
        Q >>= 1
    # Gray encode
    for i in range(1, d):
        X[i] = X[i] ^ X[i - 1]
    t = np.zeros(n, dtype=np.uint64)
    Q = M
    while Q > 1:
        t ^= np.where((X[d - 1] & np.uint64(Q)) != 0, np.uint64(Q - 1), np.uint64(0))
        Q >>= 1
    for i in range(d):
        X[i] ^= t
    # interleave: bit b of axis i goes to position b*d + (d-1-i)
    h = np.zeros(n, dtype=np.uint64)
    for i in range(d):
        h |= _spread(X[i], d) << np.uint64(d - 1 - i)
    return h


def _quantise(x: np.ndarray, bits: int) -> np.ndarray:
    """Map points onto the integer grid ``[0, 2**bits)`` (same scale on every axis)."""
    lo = x.min(axis=0)
    ext = float((x.max(axis=0) - lo).max())
    top = float((1 << bits) - 1)
    if ext <= 0.0:
        return np.zeros(x.shape, dtype=np.uint64)
    q = np.floor((x - lo) * (top / ext))
    np.clip(q, 0.0, top, out=q)
    return q.astype(np.uint64)


def hilbert(coords: Any, nparts: int, graph: Any = None) -> Partition:
    """Local (not collective). Hilbert space-filling-curve partition.

    Points are quantised on a ``2**bits`` grid per axis (isotropic scaling of
    the bounding box; ``bits`` grows with ``log2(n)``, at most ``64 // d``),
    ordered along the Hilbert curve (ties keep the original order) and the
    curve is cut into ``nparts`` contiguous chunks of the contiguous-split
    sizes.

    Parameters
    ----------
    coords : array_like, shape (n, d)
        Point of every row, ``d`` in 1..3, finite.
    nparts : int
        Number of parts.
    graph : sparse matrix, optional
        ``(n, n)`` pattern for :attr:`Partition.quality`.

    Returns
    -------
    Partition
    """
    x, k, g = _geometric_args(coords, nparts, graph)
    n, d = x.shape
    if d == 1:
        order = np.argsort(x[:, 0], kind="stable")
    else:
        bits = int(min(64 // d, max(4, int(np.ceil(np.log2(max(n, 2)))) + 2)))
        h = _hilbert_index(_quantise(x, bits), bits)
        order = np.argsort(h, kind="stable")
    parts = np.empty(n, dtype=np.int64)
    parts[order] = np.repeat(np.arange(k, dtype=np.int64), _split_sizes(n, k))
    return Partition.from_parts(parts, k, graph=g, method="hilbert")


def partition(A: Any, nparts: int, method: str = "contiguous", coords: Any = None) -> Partition:
    """Local (not collective). Partition the rows of ``A`` into ``nparts`` parts.

    Parameters
    ----------
    A : sparse matrix
        Square matrix (``scipy.sparse`` or anything with ``.tocsr()``); for a
        block matrix pass the block (node) graph.
    nparts : int
        Number of parts, ``1 <= nparts <= A.shape[0]``.
    method : {"contiguous", "metis", "rcb", "hilbert"}
        Partitioner.
    coords : array_like, shape (n, d), optional
        Point of every row; required by ``"rcb"`` and ``"hilbert"``.

    Returns
    -------
    Partition
        With :attr:`Partition.quality` computed from ``A``'s pattern.

    Raises
    ------
    TypeError
        If ``nparts`` is not an integer.
    ValueError
        Unknown ``method``, non-square ``A``, bad ``nparts`` or ``coords``,
        or an empty part.

    Examples
    --------
    >>> import numpy as np, scipy.sparse as sp
    >>> from slasolve.partition import partition
    >>> T = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(8, 8))
    >>> A = (sp.kron(T, sp.eye(8)) + sp.kron(sp.eye(8), T)).tocsr()     # 8 x 8 grid
    >>> xy = np.stack(np.meshgrid(np.arange(8.0), np.arange(8.0)), -1).reshape(-1, 2)
    >>> p = partition(A, 4, method="rcb", coords=xy)
    >>> p.sizes.tolist()
    [16, 16, 16, 16]
    >>> p.quality.edge_cut              # four 4 x 4 quadrants
    16
    >>> np.array_equal(p.iperm[p.perm], np.arange(64))
    True
    """
    if not isinstance(method, str) or method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    g = _as_csr(A, name="A")
    n = g.shape[0]
    if method == "contiguous":
        return contiguous(n, nparts, graph=g)
    if method == "metis":
        return metis(g, nparts)
    if coords is None:
        raise ValueError(f"method={method!r} needs coords of shape ({n}, d)")
    x = _check_coords(coords)
    if x.shape[0] != n:
        raise ValueError(f"coords has {x.shape[0]} points but A has {n} rows")
    if method == "rcb":
        return rcb(x, nparts, graph=g)
    return hilbert(x, nparts, graph=g)
