"""Parallel partition and redistribution of a mesh read in slices.

A parallel reader hands every rank a contiguous slice of the file's cells (global file
node ids) and a contiguous slice of its points; nothing here ever holds a global array.
:func:`distribute_cells` then

1. builds the dual graph (cells sharing a facet) in parallel: every facet, keyed by its
   sorted vertex ids, goes to a *referee* rank (chosen by its smallest vertex id), which
   pairs the two cells that share it, finds the boundary facets (seen once) and matches
   facet tags to the facets of the mesh;
2. partitions that graph (``"ptscotch"``: PT-Scotch through PETSc's ``MatPartitioning``,
   parallel; ``"metis"``: the graph gathered on rank 0 and cut with METIS, for small
   meshes; ``"block"``: the file's cell order, contiguous slices; or a given part per cell);
3. moves every cell (with its tag and its tagged facets) to its part (one Alltoallv);
4. gives every node to the lowest rank whose cells touch it (or to the rank named by a
   saved node layout), numbers the owned nodes rank after rank in file order, and fetches
   the coordinates, boundary flags and new ids of the touched nodes from the ranks that
   read them.

Every exchange is an Alltoallv of NumPy rows; every step is vectorised.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective, get_comm
from ..partition import PartitionQuality
from .cells import CELL_DIM, CELL_FACETS, CELL_VERTICES, ORIENTATION_FLIP, canonical_facets, facet_keys, signed_measure
from .mesh import Mesh, _facet_tags, _local_facets, _register_facet_matcher

__all__ = ["distribute_cells", "fetch_rows", "match_cell_tags", "partition_quality", "dual_graph",
           "dual_graph_laplacian", "PARALLEL_PARTITIONERS"]

PARALLEL_PARTITIONERS = ("ptscotch", "metis", "block")


# --------------------------------------------------------------------------- exchanges
class _Exchange:
    """Collective (construction and :meth:`back`). Rows sent to ranks, and the way back.

    ``_Exchange(comm, data, dest)`` sends row ``i`` of ``data`` to rank ``dest[i]``;
    ``.recv`` holds what this rank received (grouped by source rank, each source's rows in
    its order), ``.sources`` the source rank of each received row. ``.back(answer)``
    returns rows aligned with ``.recv`` to their senders, aligned with ``data``.
    """

    def __init__(self, comm: MPI.Comm, data: np.ndarray, dest: np.ndarray):
        self.comm = comm
        size = comm.Get_size()
        dest = np.asarray(dest, dtype=np.int64)
        # rows already grouped by rank (always on one rank) are sent as they are: no copy
        grouped = dest.size < 2 or bool(np.all(dest[1:] >= dest[:-1]))
        self.order = None if grouped else np.argsort(dest, kind="stable")
        self.send_counts = np.bincount(dest, minlength=size).astype(np.int64)
        send = np.ascontiguousarray(data if grouped else data[self.order])
        if size == 1:
            self.recv_counts = self.send_counts.copy()
            self.recv = send
        else:
            self.recv_counts = np.empty(size, dtype=np.int64)
            comm.Alltoall(self.send_counts, self.recv_counts)
            self.recv = _alltoallv_rows(comm, send, self.send_counts, self.recv_counts)
        self.sources = np.repeat(np.arange(size, dtype=np.int64), self.recv_counts)

    def back(self, answer: np.ndarray) -> np.ndarray:
        answer = np.ascontiguousarray(answer)
        if self.comm.Get_size() == 1:
            got = answer
        else:
            got = _alltoallv_rows(self.comm, answer, self.recv_counts, self.send_counts)
        if self.order is None:
            return got
        out = np.empty_like(got)
        out[self.order] = got
        return out


def _alltoallv_rows(comm: MPI.Comm, send: np.ndarray, send_counts: np.ndarray,
                    recv_counts: np.ndarray) -> np.ndarray:
    """Collective. Alltoallv of rows of any dtype/shape, as bytes."""
    row_shape = send.shape[1:]
    row = send.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
    recv = np.empty((int(recv_counts.sum()),) + row_shape, dtype=send.dtype)
    sc, rc = send_counts * row, recv_counts * row
    if max(int(sc.sum()), int(rc.sum())) >= 2 ** 31:
        raise ValueError(f"one exchange of {max(int(sc.sum()), int(rc.sum()))} bytes on one rank exceeds "
                         f"MPI's 2 GiB count limit: use more ranks")
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]])
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]])
    sb = send.reshape(-1).view(np.uint8) if send.size else np.empty(0, np.uint8)
    rb = recv.reshape(-1).view(np.uint8) if recv.size else np.empty(0, np.uint8)
    comm.Alltoallv([sb, (sc.astype(np.int32), sd.astype(np.int32)), MPI.BYTE],
                   [rb, (rc.astype(np.int32), rd.astype(np.int32)), MPI.BYTE])
    return recv


def fetch_rows(comm: MPI.Comm, offsets: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Collective. Rows ``ids`` of an array distributed in contiguous slices.

    Rank ``r`` holds ``rows`` = rows ``[offsets[r], offsets[r+1])`` of the global array;
    every rank asks for the (any, repeated) global row ids ``ids``. One request and one
    reply exchange, only the distinct ids travel.
    """
    ids = np.asarray(ids, dtype=np.int64)
    uid, inv = np.unique(ids, return_inverse=True)
    home = np.searchsorted(offsets, uid, side="right") - 1
    ex = _Exchange(comm, uid, home)
    answer = rows[ex.recv - offsets[comm.Get_rank()]]
    return ex.back(answer)[inv.reshape(-1)]


# --------------------------------------------------------------------------- dual graph
@dataclass
class _Facets:
    """What the referees found out about the facets of this rank's (slice of) cells."""
    neighbours: np.ndarray        # (n, nf) global id of the cell across each facet, -1 on the boundary,
    #                               -2 for a collapsed cell's degenerate facets (no facets)
    tag_rows: np.ndarray          # (k, 1 + nfv + 1): [cell id, facet vertices (sorted), value] -> cell slices


def _row_groups(keys: np.ndarray, n_nodes: int):
    """Local. ``(ids, n)``: equal rows of the non-negative ``(m, k)`` ``keys`` (entries below
    ``n_nodes``) get the same id in ``0..n-1``. The columns are packed into as few int64
    words as their bit width allows (one for triangles up to 2M nodes), so this is one 1-D
    sort instead of ``np.unique(axis=0)``'s much slower sort of row records."""
    m, k = keys.shape
    if m == 0:
        return np.zeros(0, dtype=np.int64), 0
    bits = max(1, int(n_nodes - 1).bit_length())
    per = max(1, 63 // bits)
    words = []
    for j in range(0, k, per):             # at most k (<= 4) columns
        w = np.zeros(m, dtype=np.int64)
        for c in range(j, min(k, j + per)):
            w = (w << bits) | keys[:, c]
        words.append(w)
    if len(words) == 1:
        u, inv = np.unique(words[0], return_inverse=True)
        return inv.reshape(-1).astype(np.int64, copy=False), int(u.size)
    order = np.lexsort(words[::-1])
    srt = [w[order] for w in words]
    new = np.ones(m, dtype=bool)
    new[1:] = np.logical_or.reduce([w[1:] != w[:-1] for w in srt])
    ids = np.cumsum(new) - 1
    inv = np.empty(m, dtype=np.int64)
    inv[order] = ids
    return inv, int(ids[-1]) + 1


def _referee(keys: np.ndarray, n_nodes: int, size: int) -> np.ndarray:
    return np.minimum(keys[:, 0] * size // max(n_nodes, 1), size - 1)


def _match_facets(comm: MPI.Comm, cells: np.ndarray, cell_ids: np.ndarray, cell_type: str, n_nodes: int,
                  facet_tags: Optional[Tuple[np.ndarray, np.ndarray]], cell_offsets: np.ndarray,
                  what: str) -> _Facets:
    """Collective. Dual graph, boundary facets and facet tags, by facet referees.

    ``facet_tags``: ``(vertices (k, nfv), values (k,))`` read by this rank (any slice);
    each tag is sent on to the rank whose slice holds the lowest-numbered cell having that
    facet (``cell_offsets``). A tag naming a facet that no cell has raises ``ValueError``
    on every rank, as does a facet shared by more than two cells. Facets are keyed by
    :func:`~slasolve.fem.cells.canonical_facets` (a collapsed cell's triangle face meets its
    neighbour's whichever vertex either repeats); degenerate ones stay home (neighbour -2).
    """
    size = comm.Get_size()
    n, nf = cells.shape[0], len(CELL_FACETS[cell_type])
    nfv = len(CELL_FACETS[cell_type][0])
    keys, valid = facet_keys(cells, cell_type)
    keys, valid = keys.reshape(-1, nfv), valid.reshape(-1)
    owner_cell = np.repeat(cell_ids, nf)
    degenerate = not valid.all()
    if degenerate:
        keys, owner_cell = keys[valid], owner_cell[valid]
    ex = _Exchange(comm, np.concatenate([keys, owner_cell[:, None]], axis=1), _referee(keys, n_nodes, size))
    if facet_tags is not None:
        tv, tval = facet_tags
        # a degenerate tag's key matches no facet: "no cell has" below
        tkeys = canonical_facets(np.asarray(tv, dtype=np.int64).reshape(-1, nfv))[0]
        tex = _Exchange(comm, np.concatenate([tkeys, np.asarray(tval, np.int64).reshape(-1, 1)], axis=1),
                        _referee(tkeys, n_nodes, size))
        trecv = tex.recv
    else:
        trecv = np.empty((0, nfv + 1), dtype=np.int64)
    m = ex.recv.shape[0]
    allk = np.concatenate([ex.recv[:, :nfv], trecv[:, :nfv]])
    err = None
    nbr = np.full(m, -1, dtype=np.int64)
    tag_rows = np.empty((0, nfv + 2), dtype=np.int64)
    dest = np.empty(0, dtype=np.int64)
    if allk.shape[0]:
        inv, nu = _row_groups(allk, n_nodes)
        fi, ti = inv[:m], inv[m:]
        cnt = np.bincount(fi, minlength=nu)
        c = ex.recv[:, nfv]
        if m and cnt.max() > 2:
            bad = allk[:m][np.flatnonzero(cnt[fi] > 2)[0]]
            err = ValueError(f"{what}: the facet with vertices {bad.tolist()} belongs to {int(cnt.max())} cells "
                             f"(a mesh where a facet has more than two cells is not supported)")
        else:
            o = np.argsort(fi, kind="stable")
            fs = fi[o]
            two = np.flatnonzero((fs[1:] == fs[:-1]))   # sorted positions p with a twin at p + 1
            nbr[o[two]] = c[o[two + 1]]
            nbr[o[two + 1]] = c[o[two]]
            if ti.size:
                absent = cnt[ti] == 0
                if absent.any():
                    bad = trecv[np.flatnonzero(absent)[0], :nfv]
                    err = ValueError(f"{what}: {int(absent.sum())} facet tag(s) name facets that no cell has, "
                                     f"e.g. vertices {bad.tolist()} (file node ids)")
                else:
                    first = np.full(nu, np.iinfo(np.int64).max)
                    np.minimum.at(first, fi, c)
                    target = first[ti]
                    tag_rows = np.concatenate([target[:, None], trecv], axis=1)
                    dest = np.searchsorted(cell_offsets, target, side="right") - 1
    check_collective(comm, err)
    back = ex.back(nbr)
    if degenerate:
        neighbours = np.full(n * nf, -2, dtype=np.int64)
        neighbours[valid] = back
        neighbours = neighbours.reshape(n, nf)
    else:
        neighbours = back.reshape(n, nf)
    if facet_tags is not None:
        tag_rows = _Exchange(comm, tag_rows, dest).recv
    return _Facets(neighbours, tag_rows)


def match_cell_tags(comm: MPI.Comm, cells: np.ndarray, tag_cells: np.ndarray, tag_values: np.ndarray,
                    n_nodes: int, what: str) -> np.ndarray:
    """Collective. Tags given per vertex set (DOLFINx's meshtags of cells) on this rank's cells.

    ``cells``: ``(n, nv)`` file node ids of this rank's slice of cells; ``tag_cells`` /
    ``tag_values``: ``(k, nv)`` file node ids and ``(k,)`` integer values of any slice of
    the tagged cells. Cells and tags meet at the referee of their sorted vertex set. Returns
    the ``(n,)`` int64 tag of each cell, ``-1`` for a cell no tag names. A tag naming no
    cell, or a cell tagged twice with different values, raises ``ValueError`` on every rank.
    """
    size = comm.Get_size()
    nv = cells.shape[1]
    keys = np.sort(np.asarray(cells, np.int64), axis=1)
    tkeys = np.sort(np.asarray(tag_cells, np.int64).reshape(-1, nv), axis=1)
    ex = _Exchange(comm, keys, _referee(keys, n_nodes, size))
    tex = _Exchange(comm, np.concatenate([tkeys, np.asarray(tag_values, np.int64).reshape(-1, 1)], axis=1),
                    _referee(tkeys, n_nodes, size))
    m = ex.recv.shape[0]
    answer = np.full(m, -1, dtype=np.int64)
    err = None
    if m + tex.recv.shape[0]:
        inv, nu = _row_groups(np.concatenate([ex.recv, tex.recv[:, :nv]]), n_nodes)
        ci, ti = inv[:m], inv[m:]
        vals = tex.recv[:, nv]
        absent = np.bincount(ci, minlength=nu)[ti] == 0
        lo, hi = np.full(nu, np.iinfo(np.int64).max), np.full(nu, np.iinfo(np.int64).min)
        np.minimum.at(lo, ti, vals)
        np.maximum.at(hi, ti, vals)
        if absent.any():
            err = ValueError(f"{what}: {int(absent.sum())} cell tag(s) name cells that the mesh does not have, "
                             f"e.g. vertices {tex.recv[np.flatnonzero(absent)[0], :nv].tolist()} "
                             f"(file node ids)")
        elif ti.size and (lo[ti] != hi[ti]).any():
            bad = tex.recv[np.flatnonzero(lo[ti] != hi[ti])[0], :nv]
            err = ValueError(f"{what}: the cell with vertices {bad.tolist()} has two different tags")
        else:
            tagged = lo[ci] <= hi[ci]
            answer[tagged] = lo[ci][tagged]
    check_collective(comm, err)
    return ex.back(answer)


def _local_graph(cell_ids: np.ndarray, neighbours: np.ndarray):
    """Local. CSR rows (indptr, global column ids) of the local cells' dual-graph edges."""
    has = neighbours >= 0
    indptr = np.concatenate([[0], np.cumsum(has.sum(axis=1))]).astype(np.int64)
    return indptr, neighbours[has]


# --------------------------------------------------------------------------- partitioners
def _partition_ptscotch(comm: MPI.Comm, n_local: int, n_global: int, indptr, cols) -> np.ndarray:
    from petsc4py import PETSc

    it = PETSc.IntType
    if n_global >= np.iinfo(it).max:
        raise ValueError(f"{n_global} cells exceed PETSc's {np.dtype(it).itemsize * 8}-bit indices")
    A = PETSc.Mat().createAIJ(size=((n_local, n_global), (n_local, n_global)),
                              csr=(indptr.astype(it), cols.astype(it), np.ones(cols.size)), comm=comm)
    part = PETSc.MatPartitioning().create(comm=comm)
    try:
        part.setAdjacency(A)
        part.setType("ptscotch")
        iset = PETSc.IS()
        part.apply(iset)
        parts = np.array(iset.getIndices(), dtype=np.int64)
        iset.destroy()
    finally:
        part.destroy()
        A.destroy()
    return parts


def _partition_metis(comm: MPI.Comm, n_local: int, indptr, cols) -> np.ndarray:
    """Collective. The dual graph gathered on rank 0 and cut by METIS (small meshes only)."""
    size, rank = comm.Get_size(), comm.Get_rank()
    counts = comm.gather(n_local, root=0)
    degs = comm.gather(np.diff(indptr), root=0)
    adj = comm.gather(cols, root=0)
    err, parts = None, None
    if rank == 0:
        try:
            import scipy.sparse as sp

            from ..partition import metis

            xadj = np.concatenate([[0], np.cumsum(np.concatenate(degs))]).astype(np.int64)
            adjncy = np.concatenate(adj)
            n = int(xadj.size - 1)
            graph = sp.csr_matrix((np.ones(adjncy.size), adjncy, xadj), shape=(n, n))
            p = metis(graph, size).parts
            parts = np.split(np.asarray(p, dtype=np.int64), np.cumsum(counts)[:-1])
        except ValueError:   # METIS left a part empty (tiny meshes): keep the file's order
            parts = [np.full(c, r, dtype=np.int64) for r, c in enumerate(counts)]
        except ImportError as e:
            err = ImportError(f"partition='metis': {e}")
    check_collective(comm, err)
    return comm.scatter(parts, root=0) if size > 1 else parts[0]


def _partition(comm, method, cell_ids, neighbours, n_cells_global):
    size = comm.Get_size()
    n = cell_ids.shape[0]
    if size == 1 or method == "block":
        return np.full(n, comm.Get_rank(), dtype=np.int64)
    indptr, cols = _local_graph(cell_ids, neighbours)
    if method == "ptscotch":
        parts = _partition_ptscotch(comm, n, n_cells_global, indptr, cols)
    else:
        parts = _partition_metis(comm, n, indptr, cols)
    # a partitioner leaving a rank without cells (tiny meshes): keep the file's order instead
    sizes = np.bincount(parts, minlength=size)
    comm.Allreduce(MPI.IN_PLACE, sizes, op=MPI.SUM)
    if (sizes == 0).any():
        return np.full(n, comm.Get_rank(), dtype=np.int64)
    return parts


# --------------------------------------------------------------------------- distribute
def distribute_cells(comm: Optional[MPI.Comm], cell_type: str, cells: np.ndarray, cell_offset: int,
                     points: np.ndarray, point_offset: int, *, n_points: int, n_cells: int,
                     cell_tags: Optional[np.ndarray] = None,
                     facet_tags: Optional[Tuple[np.ndarray, np.ndarray]] = None,
                     partition="ptscotch", node_offsets: Optional[np.ndarray] = None,
                     dtype: torch.dtype = torch.float64, what: str = "mesh") -> Mesh:
    """Collective. A :class:`Mesh` from slices of a mesh's cells and points.

    Parameters
    ----------
    comm : the communicator.
    cell_type : ``"triangle"``, ``"quad"``, ``"tetra"`` or ``"hexahedron"``.
    cells : ``(n, nv)`` file node ids of this rank's cells, the file's cells
        ``[cell_offset, cell_offset + n)`` (slices in rank order covering ``n_cells``).
    points : ``(m, dim)`` coordinates of the file's points ``[point_offset, point_offset + m)``
        (slices in rank order covering ``n_points``).
    cell_tags : ``(n,)`` integer tag of each cell in ``cells``, or None.
    facet_tags : ``(facet vertices (k, nfv) file node ids, values (k,))`` of any slice of
        the file's facet tags, or None.
    partition : ``"ptscotch"``, ``"metis"``, ``"block"`` or a ``(n,)`` integer array (the
        part of each cell of ``cells``).
    node_offsets : ``(size + 1,)`` saved node layout: rank ``r`` owns the file's nodes
        ``[node_offsets[r], node_offsets[r+1])`` (used with the saved cell parts to reload a
        mesh exactly as it was written); default: lowest touching rank.
    what : the name used in error messages (the file).

    Returns
    -------
    Mesh
        Cells in increasing file order on each rank, ``original_cell_ids`` / ``original_ids``
        the file's cell / point indices, ``cell_tags`` and ``facet_tags`` when given. Points no
        cell uses are dropped. Cells are reoriented to positive orientation.
    """
    comm = get_comm(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    dim, nv = CELL_DIM[cell_type], CELL_VERTICES[cell_type]
    cells = np.ascontiguousarray(cells, dtype=np.int64).reshape(-1, nv)
    n = cells.shape[0]
    cell_ids = cell_offset + np.arange(n, dtype=np.int64)
    cell_offsets = np.concatenate([[0], np.cumsum(comm.allgather(n))]).astype(np.int64)
    point_offsets = np.concatenate([[0], np.cumsum(comm.allgather(points.shape[0]))]).astype(np.int64)
    err = None
    if n and (cells.min() < 0 or cells.max() >= n_points):
        err = ValueError(f"{what}: cells refer to points outside 0..{n_points - 1}")
    elif cell_tags is not None and np.asarray(cell_tags).shape[0] != n:
        err = ValueError(f"{what}: {np.asarray(cell_tags).shape[0]} cell tags for {n} cells")
    elif not np.all(np.isfinite(points)):
        err = ValueError(f"{what}: non-finite point coordinates")
    check_collective(comm, err)

    facets = _match_facets(comm, cells, cell_ids, cell_type, n_points, facet_tags, cell_offsets, what)
    if isinstance(partition, str):
        parts = _partition(comm, partition, cell_ids, facets.neighbours, n_cells)
    else:
        parts = np.asarray(partition, dtype=np.int64)

    # ---- move the cells (id, vertices, tag, neighbours) and their facet tags to their parts
    tags = np.zeros((n, 1), np.int64) if cell_tags is None else np.asarray(cell_tags, np.int64).reshape(-1, 1)
    rows = np.concatenate([cell_ids[:, None], cells, tags, facets.neighbours], axis=1)
    got = _Exchange(comm, rows, parts).recv
    got = got[np.argsort(got[:, 0], kind="stable")]
    my_ids, my_cells, my_tags, my_nbr = got[:, 0], got[:, 1:1 + nv], got[:, 1 + nv], got[:, 2 + nv:]
    tag_rows = None
    if facet_tags is not None:
        slice_pos = facets.tag_rows[:, 0] - cell_offset
        tag_rows = _Exchange(comm, facets.tag_rows, parts[slice_pos]).recv

    # ---- node owners: the lowest touching rank (or the saved layout); boundary flags
    touched = np.unique(my_cells)
    nfv = len(CELL_FACETS[cell_type][0])
    bfacets = my_cells[:, np.asarray(CELL_FACETS[cell_type])][my_nbr == -1]     # (b, nfv)
    on_boundary = np.isin(touched, bfacets.reshape(-1))
    home = np.searchsorted(point_offsets, touched, side="right") - 1
    ex = _Exchange(comm, np.stack([touched, on_boundary.astype(np.int64)], axis=1), home)
    li = ex.recv[:, 0] - point_offsets[rank]
    m_loc = points.shape[0]
    if node_offsets is None:
        owner_at_home = np.full(m_loc, size, dtype=np.int64)
        np.minimum.at(owner_at_home, li, ex.sources)
    bnd_at_home = np.zeros(m_loc, dtype=bool)
    bnd_at_home[li[ex.recv[:, 1] == 1]] = True
    if node_offsets is None:
        owner = ex.back(owner_at_home[li])
    else:
        owner = np.searchsorted(np.asarray(node_offsets, np.int64), touched, side="right") - 1
    pt = np.ascontiguousarray(points, dtype=np.float64).reshape(m_loc, -1)
    coords = ex.back(pt[li])
    boundary = ex.back(bnd_at_home[li])

    # ---- new global ids: owned nodes numbered rank after rank, in file order
    mine = owner == rank
    n_owned = int(mine.sum())
    start = int(comm.exscan(n_owned) or 0) if size > 1 else 0
    new_ids = np.empty(touched.size, dtype=np.int64)
    new_ids[mine] = start + np.arange(n_owned, dtype=np.int64)
    owned_files = touched[mine]
    gex = _Exchange(comm, touched[~mine], owner[~mine])
    pos = np.searchsorted(owned_files, gex.recv)
    err = None
    if gex.recv.size and (pos.max() >= owned_files.size or np.any(owned_files[np.minimum(pos, owned_files.size - 1)]
                                                                  != gex.recv)):
        err = ValueError(f"{what}: the saved node layout does not match the cells (a node is owned by a rank "
                         f"none of whose cells touch it)")
    check_collective(comm, err)
    new_ids[~mine] = gex.back(start + pos)
    n_global_nodes = comm.allreduce(n_owned) if size > 1 else n_owned

    order = np.argsort(new_ids, kind="stable")
    node_ids = new_ids[order]
    local_cells = np.searchsorted(touched, my_cells)           # positions in touched
    inv_order = np.empty_like(order)
    inv_order[order] = np.arange(order.size)
    local_cells = inv_order[local_cells]                       # positions in node_ids
    xyz = coords[order]
    # ---- positive orientation
    neg = signed_measure(xyz, local_cells, cell_type) < 0 if local_cells.shape[0] else np.zeros(0, bool)
    local_cells[neg] = local_cells[neg][:, ORIENTATION_FLIP[cell_type]]
    file_cells = touched[order][local_cells]                   # file ids, reoriented

    ftags = None
    if tag_rows is not None:
        lc = np.searchsorted(my_ids, tag_rows[:, 0])
        ftags = _facet_tags(lc, _local_facets(file_cells[lc], tag_rows[:, 1:1 + nfv], cell_type),
                            tag_rows[:, 1 + nfv])

    return Mesh(comm=comm, cell_type=cell_type, dim=dim,
                cells=torch.from_numpy(np.ascontiguousarray(node_ids[local_cells])),
                node_ids=torch.from_numpy(node_ids),
                node_coords=torch.from_numpy(np.ascontiguousarray(xyz[:, :dim])).to(dtype),
                owned_range=(start, start + n_owned), n_global_nodes=int(n_global_nodes),
                n_global_cells=int(n_cells), boundary_mask=torch.from_numpy(boundary[order]),
                original_ids=torch.from_numpy(touched[order].copy()),
                original_cell_ids=torch.from_numpy(my_ids.copy()),
                cell_tags=None if cell_tags is None else torch.from_numpy(my_tags.astype(np.int32)),
                facet_tags=ftags)


# --------------------------------------------------------------------------- quality
def dual_graph(mesh: Mesh) -> Tuple[np.ndarray, np.ndarray]:
    """Collective. The dual graph of a distributed mesh: cells sharing a facet.

    Cells are numbered rank after rank (``offsets[r] + local index``, the numbering of
    ``Assembler.cell_range``). Returns ``(indptr, cols)``: CSR rows of this
    rank's cells, ``cols`` the global ids of the cells across their facets (any rank; in
    facet order). Built by the facet referees of :func:`distribute_cells` (one exchange
    there and back): works on any mesh, not only on boxes.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    comm = mesh.comm
    n = mesh.n_local_cells
    offsets = np.concatenate([[0], np.cumsum(comm.allgather(n))]).astype(np.int64)
    ids = offsets[comm.Get_rank()] + np.arange(n, dtype=np.int64)
    f = _match_facets(comm, mesh.cells.numpy(), ids, mesh.cell_type, mesh.n_global_nodes, None, offsets,
                      "dual_graph")
    return _local_graph(ids, f.neighbours)


def dual_graph_laplacian(mesh: Mesh, dtype: torch.dtype = torch.float64):
    """Collective. The graph Laplacian ``L = D - W`` of the dual graph (:func:`dual_graph`):
    ``W_ef = 1`` for cells sharing a facet, a row-sharded ``DSparseTensor`` over the cells
    numbered rank after rank (rows: this rank's cells). ``theta @ (L @ theta)`` (summed over
    ranks) is ``sum over neighbour pairs (theta_e - theta_f)^2``: the smoothness regulariser
    of a per-cell parameter on any mesh (on a box mesh it equals
    :func:`slasolve.fem.cell_laplacian`)."""
    from ..dsparse import DSparseTensor

    indptr, nbr = dual_graph(mesh)
    comm, n = mesh.comm, mesh.n_local_cells
    start = int(comm.exscan(n) or 0) if comm.Get_size() > 1 else 0
    deg = np.diff(indptr)
    rows = np.concatenate([np.repeat(np.arange(n), deg), np.arange(n)])
    cols = np.concatenate([nbr, start + np.arange(n)])
    vals = np.concatenate([-np.ones(nbr.size), deg.astype(np.float64)])
    order = np.lexsort((cols, rows))
    ip = np.concatenate([[0], np.cumsum(deg + 1)]).astype(np.int64)
    n_global = int(comm.allreduce(n)) if comm.Get_size() > 1 else n
    return DSparseTensor.from_local_rows(ip, cols[order], torch.from_numpy(vals[order]).to(dtype),
                                         (n_global, n_global), comm)


def partition_quality(mesh: Mesh) -> PartitionQuality:
    """Collective. Quality of the cell partition of ``mesh``: its dual graph (cells sharing a
    facet) cut by the ranks.

    Returns
    -------
    slasolve.partition.PartitionQuality
        ``edge_cut``: facets whose two cells are on different ranks; ``part_sizes``: cells
        per rank; ``halo_size``: per rank, the distinct cells on other ranks across its
        facets; ``neighbours``: per rank, the distinct other ranks across its facets;
        ``load_imbalance``: ``max(cells per rank) / mean``. The same on every rank.

    Examples
    --------
    >>> from slasolve.fem import box_mesh, partition_quality
    >>> q = partition_quality(box_mesh((4, 4), cell="quad"))    # slabs along y: 4 cells across
    >>> int(q.part_sizes.sum()), q.edge_cut == 4 * (q.nparts - 1)
    (16, True)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    comm = mesh.comm
    size, rank = comm.Get_size(), comm.Get_rank()
    n = mesh.n_local_cells
    offsets = np.concatenate([[0], np.cumsum(comm.allgather(n))]).astype(np.int64)
    ids = offsets[rank] + np.arange(n, dtype=np.int64)
    f = _match_facets(comm, mesh.cells.numpy(), ids, mesh.cell_type, mesh.n_global_nodes, None, offsets,
                      "partition_quality")
    nbr = f.neighbours[f.neighbours >= 0]
    other = nbr[(nbr < offsets[rank]) | (nbr >= offsets[rank + 1])]
    other_parts = np.searchsorted(offsets, other, side="right") - 1
    local = np.array([other.size, np.unique(other).size, np.unique(other_parts).size], dtype=np.int64)
    per_rank = np.array(comm.allgather(local), dtype=np.int64).reshape(size, 3)
    sizes = np.diff(offsets)
    return PartitionQuality(edge_cut=int(per_rank[:, 0].sum()) // 2, part_sizes=sizes,
                            halo_size=per_rank[:, 1], neighbours=per_rank[:, 2],
                            load_imbalance=float(sizes.max() / sizes.mean()) if sizes.sum() else 1.0)


_register_facet_matcher(_match_facets)
