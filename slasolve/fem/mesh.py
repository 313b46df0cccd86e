"""Distributed meshes: parallel structured boxes, meshio input and VTU output.

Layout (the same for every mesh in slasolve)
--------------------------------------------
Global node ids are split into contiguous ownership ranges that increase with
rank (PETSc's layout, and the row layout of the assembled ``DSparseTensor``):
rank ``r`` owns global nodes ``owned_range = [start, end)``. Each rank holds

* ``cells``: the cells it owns, as ``(n_local_cells, nv)`` *global* node ids;
  every global cell is owned by exactly one rank;
* ``node_ids``: the sorted global ids of every node it owns or that its cells
  touch; the touched-but-not-owned ones are its ghosts (``ghost_node_ids()``);
* ``node_coords``: their coordinates.

No rank ever builds an array of global size in :func:`box_mesh`, nor in
:func:`read_mesh` for XDMF + HDF5 files (read in slices, partitioned and
redistributed in parallel: :mod:`slasolve.fem.xdmf`, :mod:`slasolve.fem.distribute`);
other formats are read with meshio on rank 0 and scattered, for meshes that fit on
one node (convert them once with :func:`slasolve.fem.convert_mesh`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from mpi4py import MPI

from .._comm import allreduce_int, check_collective, get_comm
from ..partition import partition as partition_graph
from ..placement import split_offsets
from .cells import (CELL_DIM, CELL_FACETS, CELL_TYPES, CELL_VERTICES, CELLS_PER_BOX, HEX_BITS, KUHN_TETS,
                    MESHIO_DIM, ORIENTATION_FLIP, QUAD_BITS, TRI_BITS, facet_keys, signed_measure)
from .collapse import COLLAPSE_TYPES, collapse_cells, collapse_facets
from .simplex_split import SPLIT_TYPES, split_cells, split_facets

__all__ = ["Mesh", "FacetTags", "box_mesh", "boundary_nodes", "read_mesh", "write_mesh", "read_pvtu"]


@dataclass
class FacetTags:
    """Tagged facets (physical groups of facets, e.g. boundary markers) of a rank's cells.

    Each tagged facet is held by the rank of one cell that has it (for an interior facet,
    the cell with the lower file index), as in :class:`slasolve.fem.BoundaryFacets`.

    Attributes
    ----------
    cells : ``(k,)`` int64 local cell index (row of ``mesh.cells``).
    local_facet : ``(k,)`` int64 which facet of that cell (index into the cell's facet list,
        the same as ``BoundaryFacets.local_facet``).
    values : ``(k,)`` int32 tag values.
    """

    cells: torch.Tensor
    local_facet: torch.Tensor
    values: torch.Tensor

    def __len__(self) -> int:
        return int(self.cells.shape[0])


@dataclass
class Mesh:
    """A distributed mesh: the part of it that this rank holds (see the module doc).

    Attributes
    ----------
    comm : the communicator the mesh lives on.
    cell_type : ``"triangle"``, ``"quad"``, ``"tetra"`` or ``"hexahedron"``
        (vertex ordering as in :mod:`slasolve.fem.elements`).
    dim : spatial dimension (= topological dimension).
    cells : ``(n_local_cells, nv)`` int64 global node ids of the cells this rank owns.
    node_ids : ``(n_nodes_local,)`` sorted int64 global ids of the owned nodes and
        of every node touched by the local cells.
    node_coords : ``(n_nodes_local, dim)`` coordinates of ``node_ids``.
    owned_range : ``(start, end)``, this rank owns global nodes ``[start, end)``.
    n_global_nodes, n_global_cells : global sizes.
    boundary_mask : ``(n_nodes_local,)`` bool, True for nodes on the boundary of
        the domain (box faces, or facets belonging to a single cell for meshes
        read from a file), or ``None`` if unknown.
    original_ids : for :func:`read_mesh`, the index in the file's point array of
        each node in ``node_ids``; ``None`` for generated meshes.
    original_cell_ids : for meshes read in parallel (XDMF), the index in the file's
        cells of each local cell; ``None`` otherwise.
    cell_tags : ``(n_local_cells,)`` int32 tag (physical group) of each local cell, or ``None``;
        ``-1`` on cells that a sparse tag set (DOLFINx meshtags) leaves untagged.
    facet_tags : :class:`FacetTags` of the local cells, or ``None``.
    """

    comm: MPI.Comm
    cell_type: str
    dim: int
    cells: torch.Tensor
    node_ids: torch.Tensor
    node_coords: torch.Tensor
    owned_range: Tuple[int, int]
    n_global_nodes: int
    n_global_cells: int
    boundary_mask: Optional[torch.Tensor] = None
    original_ids: Optional[torch.Tensor] = field(default=None, repr=False)
    original_cell_ids: Optional[torch.Tensor] = field(default=None, repr=False)
    cell_tags: Optional[torch.Tensor] = field(default=None, repr=False)
    facet_tags: Optional[FacetTags] = field(default=None, repr=False)
    # (key of cells and coordinates, BoundaryFacets): fem.facets.boundary_facets' cache, made on first use
    _boundary_facets: Optional[Tuple[Any, Any]] = field(default=None, init=False, repr=False, compare=False)

    # ---- local queries (no communication)
    @property
    def n_owned(self) -> int:
        """Local. Number of owned nodes, ``end - start``."""
        return self.owned_range[1] - self.owned_range[0]

    @property
    def n_local_cells(self) -> int:
        return int(self.cells.shape[0])

    def _owned_slice(self) -> slice:
        s, e = self.owned_range
        i0 = int(torch.searchsorted(self.node_ids, torch.tensor(s, dtype=torch.int64)))
        return slice(i0, i0 + (e - s))

    def local_cells(self) -> torch.Tensor:
        """Local. ``cells`` with node ids replaced by positions in ``node_ids``."""
        return torch.searchsorted(self.node_ids, self.cells)

    def local_cell_coords(self) -> torch.Tensor:
        """Local. ``(n_local_cells, nv, dim)`` vertex coordinates of the local cells."""
        return self.node_coords[self.local_cells()]

    def owned_node_coords(self) -> torch.Tensor:
        """Local. ``(end - start, dim)`` coordinates of the owned nodes, in id order."""
        return self.node_coords[self._owned_slice()]

    def ghost_node_ids(self) -> torch.Tensor:
        """Local. Sorted global ids of the nodes touched by local cells but not owned."""
        s, e = self.owned_range
        return self.node_ids[(self.node_ids < s) | (self.node_ids >= e)]

    def owned_mask(self) -> torch.Tensor:
        """Local. ``(n_nodes_local,)`` bool, True where ``node_ids`` is owned."""
        s, e = self.owned_range
        return (self.node_ids >= s) & (self.node_ids < e)


# --------------------------------------------------------------------------- box meshes
_balanced_split = split_offsets  # PETSc's split (the first n % size ranks get one more); fem.xdmf uses it




def _box_args(n, lower, upper, cell, dtype, size):
    """Local. Validated ``(shape, lower, upper)`` of :func:`box_mesh`'s arguments."""
    if not isinstance(cell, str) or cell not in CELL_DIM:
        raise ValueError(f"cell must be one of {CELL_TYPES}, got {cell!r}")
    dim = CELL_DIM[cell]
    if isinstance(n, (int, np.integer)) and not isinstance(n, bool):
        shape = (int(n),) * dim
    else:
        try:
            shape = tuple(int(v) for v in n)
        except (TypeError, ValueError):
            raise TypeError(f"n must be an int or a sequence of {dim} ints, got {n!r}") from None
        if len(shape) != dim:
            raise ValueError(f"n must have {dim} entries for cell {cell!r}, got {len(shape)}")
    if min(shape) < 1:
        raise ValueError(f"n must be positive, got {shape}")
    lo = np.zeros(dim) if lower is None else np.asarray(lower, dtype=np.float64).reshape(-1)
    hi = np.ones(dim) if upper is None else np.asarray(upper, dtype=np.float64).reshape(-1)
    if lo.shape != (dim,) or hi.shape != (dim,):
        raise ValueError(f"lower and upper must have {dim} entries, got {lo.shape[0]} and {hi.shape[0]}")
    if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi)) and np.all(hi > lo)):
        raise ValueError(f"need finite lower < upper on every axis, got lower={lo.tolist()}, upper={hi.tolist()}")
    if dtype not in (torch.float64, torch.float32):
        raise TypeError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    if shape[-1] < size:
        raise ValueError(f"box_mesh: n[-1]={shape[-1]} cell layers cannot be split over {size} ranks "
                         f"(need n[-1] >= comm.size)")
    return shape, lo, hi


def box_mesh(n: Union[int, Sequence[int]], lower: Optional[Sequence[float]] = None,
             upper: Optional[Sequence[float]] = None, cell: str = "triangle",
             comm: Optional[MPI.Comm] = None, dtype: torch.dtype = torch.float64) -> Mesh:
    """Collective. Structured mesh of the box ``[lower, upper]`` with ``n`` cells per axis.

    ``cell``: ``"triangle"`` / ``"quad"`` (2-D) or ``"tetra"`` / ``"hexahedron"`` (3-D).
    ``n``: an int (same on every axis) or one int per axis. ``lower``/``upper``
    default to the unit box.

    Nodes are numbered lexicographically, x fastest. The box is cut into slabs of
    cell layers along the last axis: with the balanced split ``c_0 = 0 < c_1 < ...
    < c_size = n[-1]`` (the first ``n[-1] % size`` ranks get one layer more), rank
    ``r`` owns the cell layers and node layers ``[c_r, c_{r+1})``, the last rank
    also the final node layer; its ghosts are the node layer ``c_{r+1}``. Each rank
    generates only its slab. Squares are cut into 2 triangles along the diagonal
    from the low corner, cubes into the 6 Kuhn tetrahedra (conforming); every
    cell is positively oriented. Bad arguments raise ``ValueError``/``TypeError`` on
    every rank, also when they are bad on one rank only; arguments that differ between
    ranks raise ``ValueError`` naming them (one small Allreduce validates them all).
    ``n[-1] < comm.size`` raises ``ValueError``.

    Examples
    --------
    >>> from slasolve.fem import box_mesh
    >>> mesh = box_mesh((2, 4), upper=(1.0, 2.0), cell="quad")   # slabs along y: up to 4 ranks
    >>> mesh.n_global_nodes, mesh.comm.allreduce(mesh.n_local_cells)
    (15, 8)
    """
    comm = get_comm(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    args, err = None, None
    try:
        args = _box_args(n, lower, upper, cell, dtype, size)
    except (ValueError, TypeError) as e:
        err = e
    # every rank must generate its slab of the same box (a box_mesh without communication
    # would otherwise let ranks disagree silently, or one rank raise alone)
    agree = None if args is None else {"n": args[0], "lower": args[1].tolist(), "upper": args[2].tolist(),
                                       "cell": cell, "dtype": str(dtype)}
    check_collective(comm, err, agree=agree if err is None else {"n": "invalid"})
    shape, lo, hi = args
    dim = CELL_DIM[cell]

    nn = np.array(shape) + 1                       # nodes per axis
    L = int(np.prod(nn[:-1]))                      # nodes per node layer
    c = _balanced_split(shape[-1], size)
    c0, c1 = int(c[rank]), int(c[rank + 1])
    last = rank == size - 1
    owned = (c0 * L, (c1 + (1 if last else 0)) * L)

    # touched nodes: node layers [c0, c1] (contiguous ids, already sorted)
    node_ids = np.arange(c0 * L, (c1 + 1) * L, dtype=np.int64)
    rem = node_ids.copy()
    idx = np.empty((node_ids.size, dim), dtype=np.int64)
    for d in range(dim):
        idx[:, d] = rem % nn[d]
        rem //= nn[d]
    coords = lo + (hi - lo) * (idx / np.array(shape, dtype=np.float64))
    # exact box faces (avoid rounding at upper)
    coords = np.where(idx == np.array(shape), hi, coords)
    boundary = ((idx == 0) | (idx == np.array(shape))).any(axis=1)

    # cells: base node of every box in the slab, x fastest
    ranges = [np.arange(s, dtype=np.int64) for s in shape[:-1]] + [np.arange(c0, c1, dtype=np.int64)]
    grids = np.meshgrid(*ranges[::-1], indexing="ij")[::-1]    # last axis slowest
    strides = np.concatenate([[1], np.cumprod(nn[:-1])]).astype(np.int64)
    base = sum(g.reshape(-1) * strides[d] for d, g in enumerate(grids))
    bits = np.arange(2 ** dim)
    corner = sum(((bits >> d) & 1) * strides[d] for d in range(dim))   # offset of each bit pattern
    pattern = {"triangle": TRI_BITS, "quad": QUAD_BITS[None], "tetra": KUHN_TETS,
               "hexahedron": HEX_BITS[None]}[cell]
    cells = (base[:, None, None] + corner[pattern][None]).reshape(-1, CELL_VERTICES[cell])

    return Mesh(comm=comm, cell_type=cell, dim=dim,
                cells=torch.from_numpy(np.ascontiguousarray(cells)),
                node_ids=torch.from_numpy(node_ids),
                node_coords=torch.from_numpy(coords).to(dtype),
                owned_range=(int(owned[0]), int(owned[1])),
                n_global_nodes=int(np.prod(nn)),
                n_global_cells=int(np.prod(shape)) * CELLS_PER_BOX[cell],
                boundary_mask=torch.from_numpy(boundary))


def boundary_nodes(mesh: Mesh, where: Optional[Callable[[torch.Tensor], torch.Tensor]] = None) -> torch.Tensor:
    """Local. Sorted global ids of the *owned* nodes on the domain boundary.

    ``where``: optional vectorised predicate, called with a ``(k, dim)`` tensor of
    coordinates and returning a ``(k,)`` bool tensor, e.g.
    ``lambda x: x[:, 0] < 1e-12`` for the face ``x = 0``.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    if mesh.boundary_mask is None:
        raise ValueError("this mesh has no boundary information (boundary_mask is None)")
    sel = mesh.boundary_mask & mesh.owned_mask()
    ids = mesh.node_ids[sel]
    if where is not None:
        keep = where(mesh.node_coords[sel])
        if not isinstance(keep, torch.Tensor):
            keep = torch.as_tensor(np.asarray(keep))
        keep = keep.reshape(-1)
        if keep.dtype != torch.bool or keep.shape[0] != ids.shape[0]:
            raise ValueError(f"where must return a ({ids.shape[0]},) bool tensor, got "
                             f"{keep.dtype} of shape {tuple(keep.shape)}")
        ids = ids[keep]
    return ids


# --------------------------------------------------------------------------- meshio input


def _boundary_points(cells: np.ndarray, cell: str, n_points: int) -> np.ndarray:
    keys, valid = facet_keys(cells, cell)
    key = keys[valid]                        # a collapsed cell's degenerate facets are no facets
    _, inv, counts = np.unique(key, axis=0, return_inverse=True, return_counts=True)
    once = counts[inv.reshape(-1)] == 1
    mask = np.zeros(n_points, dtype=bool)
    mask[key[once].reshape(-1)] = True
    return mask


def _local_facets(cells: np.ndarray, keys: np.ndarray, cell: str) -> np.ndarray:
    """Local. Which facet of ``cells[i]`` has the key ``keys[i]`` (:func:`~slasolve.fem.cells.canonical_facets`;
    each must have one)."""
    fk, valid = facet_keys(cells, cell)                                    # (k, nf, nfv)
    return ((fk == keys[:, None, :]).all(axis=2) & valid).argmax(axis=1).astype(np.int64)


def _facet_tags(cells: np.ndarray, local_facet: np.ndarray, values: np.ndarray) -> FacetTags:
    """Local. :class:`FacetTags` sorted by cell, then facet."""
    o = np.lexsort((local_facet, cells))
    return FacetTags(torch.from_numpy(np.asarray(cells, np.int64)[o]),
                     torch.from_numpy(np.asarray(local_facet, np.int64)[o]),
                     torch.from_numpy(np.asarray(values, np.int32)[o]))


def _node_graph(cells: np.ndarray, n: int):
    import scipy.sparse as sp

    nv = cells.shape[1]
    r = np.repeat(cells, nv, axis=1).reshape(-1)
    c = np.tile(cells, (1, nv)).reshape(-1)
    G = sp.csr_matrix((np.ones(r.size), (r, c)), shape=(n, n))
    G.sum_duplicates()
    return G


def _partition_nodes(cells: np.ndarray, points: np.ndarray, nparts: int, method: str) -> np.ndarray:
    """Part of every node (rank 0 only)."""
    n = points.shape[0]
    if nparts == 1:
        return np.zeros(n, dtype=np.int64)
    if method in ("block", "contiguous"):
        return (np.searchsorted(_balanced_split(n, nparts), np.arange(n), side="right") - 1).astype(np.int64)
    G = _node_graph(cells, n)
    return np.asarray(partition_graph(G, nparts, method, coords=points).parts, dtype=np.int64)


def _meshio_read(path: str):
    """Rank 0: ``meshio.read``, with every failure a ``ValueError`` naming the file and the problem.

    ``meshio.read`` itself prints and calls ``sys.exit(1)`` when no reader accepts the
    file, so the readers of the candidate formats are called directly here."""
    import meshio

    try:
        from pathlib import Path

        from meshio._helpers import _filetypes_from_path, reader_map
    except ImportError:  # another meshio layout: fall back on the public reader
        _filetypes_from_path = reader_map = None
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"read_mesh: cannot read {path!r}: the file is empty")
    if reader_map is None:
        readers = [("meshio", meshio.read)]
    else:
        try:
            formats = _filetypes_from_path(Path(path))
        except Exception as e:  # noqa: BLE001 - meshio.ReadError for unknown suffixes
            raise ValueError(f"read_mesh: cannot read {path!r}: {e} (give a file with a mesh "
                             f"format's suffix, e.g. .msh, .vtu, .vtk, .xdmf)") from None
        readers = [(f, reader_map[f]) for f in formats if f in reader_map]
    problems = []
    from .._faults import exit_status, restore_exit_status
    hint = exit_status()
    for fmt, reader in readers:
        try:
            return reader(path)
        except (Exception, SystemExit) as e:  # noqa: BLE001 - readers raise many types (even SystemExit)
            restore_exit_status(hint)   # a caught SystemExit is no exit
            cause = e.__cause__ or e.__context__
            detail = str(e) or (f"{type(cause).__name__}: {cause}" if cause is not None else "")
            problems.append(f"as {fmt}: {type(e).__name__}: {detail}".rstrip(": "))
    raise ValueError(f"read_mesh: cannot read {path!r} ({size} bytes): not a valid mesh file, or truncated "
                     f"({'; '.join(problems) or 'no reader for this suffix'})")


_MESHIO_FACET = {"triangle": "line", "quad": "line", "tetra": "triangle", "hexahedron": "quad"}
_TAG_KEYS = ("gmsh:physical", "cell_tags", "medit:ref")


def _meshio_arrays(path: str, who: str, simplices: bool = False, collapse: bool = False):
    """Rank 0: ``(cell type, cells, points, cell tags or None, (facet vertices, facet tags) or None)``
    of a meshio-readable file, every problem a ``ValueError`` naming the file.

    The blocks of the highest-dimensional cells must all be of one supported type (several
    blocks of it are concatenated, in file order), or, with ``simplices``, of any types
    :func:`~slasolve.fem.simplex_split.split_cells` splits (then split into triangles or
    tetrahedra, each keeping its cell's tag), or, with ``collapse``, of any types
    :func:`~slasolve.fem.collapse.collapse_cells` takes (then quads or hexahedra, triangles,
    tetrahedra, pyramids and wedges as collapsed ones); blocks one dimension lower carry facet
    tags and must be of that type's facet type (split or padded alike). Tags are the first of
    ``_TAG_KEYS`` present (gmsh physical groups, ...); facet blocks without tags carry nothing
    and are dropped."""
    m = _meshio_read(path)
    blocks = [(i, b.type, np.asarray(b.data)) for i, b in enumerate(m.cells) if len(b.data)]
    if not blocks:
        raise ValueError(f"{who}: {path!r} contains no cells")
    tdim = max(MESHIO_DIM.get(t, -1) for _, t, _ in blocks)
    types = sorted({t for _, t, _ in blocks if MESHIO_DIM.get(t, -1) == tdim})
    either = (f"pass simplices=True to split every cell into {'triangles' if tdim == 2 else 'tetrahedra'} (P1), "
              f"or collapse=True to make every cell a {'quad' if tdim == 2 else 'hexahedron'}, collapsed on "
              f"{'triangles' if tdim == 2 else 'tetrahedra, pyramids and wedges'} (Q1 on the "
              f"{'quads' if tdim == 2 else 'hexahedra'}, P1 on the {'triangles' if tdim == 2 else 'tetrahedra'})")
    if simplices or collapse:
        table, option = (SPLIT_TYPES, "simplices") if simplices else (COLLAPSE_TYPES, "collapse")
        unsupported = [t for t in types if t not in table]
        if unsupported:
            raise ValueError(f"{who}: {path!r} has {tdim}-D cells of type {unsupported}; {option}=True takes "
                             f"{sorted(table)} (first order only)")
        facet_types = ("line",) if tdim == 2 else ("triangle", "quad")
    else:
        if len(types) > 1:
            raise ValueError(f"{who}: {path!r} mixes {tdim}-D cell types {types}: a Mesh holds one cell type "
                             f"(one of {CELL_TYPES}); {either}")
        if types[0] not in CELL_DIM:
            hint = f"; {either}" if types[0] in SPLIT_TYPES else ""
            raise ValueError(f"{who}: {path!r} has {tdim}-D cells of type {types[0]!r}; supported: one of "
                             f"{CELL_TYPES} (P1/Q1: no higher-order cells, wedges or pyramids){hint}")
        facet_types = (_MESHIO_FACET[types[0]],)
    key = next((k for k in _TAG_KEYS if k in m.cell_data), None)
    lower = sorted({t for _, t, _ in blocks if MESHIO_DIM.get(t, -1) == tdim - 1})
    if key is not None and any(t not in facet_types for t in lower):
        raise ValueError(f"{who}: {path!r} has tagged facet elements {lower}; {'/'.join(types)} meshes need "
                         f"{' or '.join(map(repr, facet_types))} facets")

    def gather(kinds):
        sel = [(i, t, d.astype(np.int64)) for i, t, d in blocks if t in kinds]
        tags = None
        if key is not None and sel:
            tags = np.concatenate([np.asarray(m.cell_data[key][i]).reshape(-1) for i, _, _ in sel])
            if not np.issubdtype(tags.dtype, np.integer):
                raise ValueError(f"{who}: {path!r}: tags {key!r} must be integers, got {tags.dtype}")
            tags = tags.astype(np.int32)
        return [(t, d) for _, t, d in sel], tags

    points = np.asarray(m.points, dtype=np.float64)
    cell_blocks, ctags = gather(types)
    facet_blocks, ftags = gather(facet_types)
    for what, bl in (("cells", cell_blocks), ("facets", facet_blocks)):   # for every caller
        if any(d.size and (d.min() < 0 or d.max() >= points.shape[0]) for _, d in bl):
            raise ValueError(f"{who}: {path!r} has {what} referring to missing points")
    if simplices:
        ct, cells, points, parent = split_cells(cell_blocks, points)
        ctags = None if ctags is None else ctags[parent]
        if facet_blocks:
            fcells, fparent = split_facets(facet_blocks)
            ftags = None if ftags is None else ftags[fparent]
    elif collapse:
        ct, cells = collapse_cells(cell_blocks, points.shape[0])
        fcells = collapse_facets(facet_blocks) if facet_blocks else None
    else:
        ct, cells = types[0], np.concatenate([d for _, d in cell_blocks])
        fcells = np.concatenate([d for _, d in facet_blocks]) if facet_blocks else None
    if not facet_blocks or ftags is None:
        fcells = None
    return ct, cells, points, ctags, (None if fcells is None else (fcells, ftags))


def _read_and_distribute(path, size: int, partition: str, simplices: bool = False, collapse: bool = False):
    """Rank 0: read, clean up, partition and split the mesh into one payload per rank."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"read_mesh: no such file: {path!r}")
    cell, cells, points, ctags, ftags = _meshio_arrays(path, "read_mesh", simplices, collapse)
    dim = CELL_DIM[cell]
    if points.ndim != 2 or points.shape[1] < dim:
        raise ValueError(f"read_mesh: {path!r} has {points.shape[-1]}-D points for {dim}-D {cell} cells")
    if points.shape[1] > dim:
        extra = points[:, dim:]
        if np.any(extra != extra[:1]):
            raise ValueError(f"read_mesh: {path!r} has {cell} cells embedded in {points.shape[1]}-D "
                             f"(not flat); only flat meshes are supported")
        points = points[:, :dim]
    if not np.all(np.isfinite(points)):
        raise ValueError(f"read_mesh: {path!r} has non-finite point coordinates")
    tag_rows = None
    if ftags is not None:
        _match_facets = _FACET_MATCHERS[0]
        # [cell, sorted facet vertices, value] of every tagged facet (rank 0 holds the mesh anyway)
        tag_rows = _match_facets(MPI.COMM_SELF, cells, np.arange(cells.shape[0], dtype=np.int64), cell,
                                 points.shape[0], ftags, np.array([0, cells.shape[0]]),
                                 f"read_mesh({path!r})").tag_rows
    # keep only the points used by these cells
    used = np.unique(cells)
    n = used.size
    if n < size:
        raise ValueError(f"read_mesh: {n} nodes cannot be split over {size} ranks")
    cells = np.searchsorted(used, cells)
    points = points[used]
    # positive orientation
    neg = signed_measure(points, cells, cell) < 0
    cells[neg] = cells[neg][:, ORIENTATION_FLIP[cell]]
    boundary = _boundary_points(cells, cell, n)

    parts = _partition_nodes(cells, points, size, partition)
    if parts.shape != (n,) or parts.min() < 0 or parts.max() >= size:
        raise ValueError(f"read_mesh: partitioner returned invalid parts (shape {parts.shape})")
    # each cell goes to the lowest part among its vertices'; a node whose part then holds none
    # of its cells moves to the lowest part that does, so that every rank's owned nodes are
    # touched by its cells, as in the parallel reader (a saved layout is reloaded on that rule)
    owner = parts[cells].min(axis=1)
    touching = np.full(n, size, dtype=np.int64)
    np.minimum.at(touching, cells.reshape(-1), np.repeat(owner, cells.shape[1]))
    keys = np.unique(cells * size + owner[:, None])                 # (node, part of a cell touching it)
    pos = np.minimum(np.searchsorted(keys, np.arange(n) * size + parts), keys.size - 1)
    parts = np.where(keys[pos] == np.arange(n) * size + parts, parts, touching)
    perm = np.argsort(parts, kind="stable")          # new -> old
    iperm = np.empty(n, dtype=np.int64)
    iperm[perm] = np.arange(n)
    offsets = np.concatenate([[0], np.cumsum(np.bincount(parts, minlength=size))]).astype(np.int64)
    new_cells = iperm[cells]
    order = np.argsort(owner, kind="stable")
    cell_off = np.concatenate([[0], np.cumsum(np.bincount(owner, minlength=size))])
    payloads = []
    if tag_rows is not None:
        nfv = len(CELL_FACETS[cell][0])
        position = np.empty(order.size, dtype=np.int64)      # cell -> its row in its rank's cells
        position[order] = np.arange(order.size) - cell_off[owner[order]]
        t_cell, t_keys = tag_rows[:, 0], np.searchsorted(used, tag_rows[:, 1:1 + nfv])
        t_rank = owner[t_cell]
    for r in range(size):
        cr = new_cells[order[cell_off[r]:cell_off[r + 1]]]
        ids = np.union1d(np.arange(offsets[r], offsets[r + 1]), cr.reshape(-1)).astype(np.int64)
        old = perm[ids]
        payloads.append(dict(cells=cr, node_ids=ids, coords=points[old], boundary=boundary[old],
                             original=used[old], owned=(int(offsets[r]), int(offsets[r + 1]))))
        if ctags is not None:
            payloads[-1]["cell_tags"] = ctags[order[cell_off[r]:cell_off[r + 1]]]
        if tag_rows is not None:
            sel = t_rank == r
            lc = position[t_cell[sel]]
            lf = _local_facets(cells[t_cell[sel]], t_keys[sel], cell)
            payloads[-1]["facet_tags"] = (lc, lf, tag_rows[sel, 1 + nfv].astype(np.int32))
    meta = dict(cell=cell, dim=dim, n_nodes=int(n), n_cells=int(cells.shape[0]))
    return meta, payloads


def _mixed_cell_options(who: str, simplices, collapse) -> Optional[Exception]:
    """Local. The error (or None) of :func:`read_mesh`'s / ``convert_mesh``'s ``simplices`` and
    ``collapse`` (bools, not both)."""
    for name, v in (("simplices", simplices), ("collapse", collapse)):
        if not isinstance(v, bool):
            return TypeError(f"{who}: {name} must be a bool, got {type(v).__name__}")
    if simplices and collapse:
        return ValueError(f"{who}: simplices=True (P1 on simplices) and collapse=True (Q1 on collapsed cells) "
                          f"exclude each other; pass one")
    return None


#: (suffixes, accepts(path) or None, reader(path, comm=, partition=, dtype=)) of the parallel
#: readers :func:`read_mesh` dispatches to (registered by their modules: slasolve.fem.xdmf)
_PARALLEL_READERS: list = []
# the facet matcher of the meshio path (slasolve.fem.distribute's, which imports this module,
# registers itself when slasolve.fem is imported: no import cycle)
_FACET_MATCHERS: list = []


def _register_facet_matcher(match_facets: Callable) -> None:
    """Local. The function :func:`read_mesh`'s meshio path matches tagged facets to cells with
    (:mod:`slasolve.fem.distribute` registers its own)."""
    _FACET_MATCHERS.insert(0, match_facets)


def register_mesh_reader(suffixes: Tuple[str, ...], reader: Callable[..., "Mesh"],
                         accepts: Optional[Callable[[str], bool]] = None) -> None:
    """Local. Make :func:`read_mesh` read files whose (lower-case) name ends with one of
    ``suffixes`` with ``reader(path, comm=, partition=, dtype=)`` (collective), when
    ``accepts(path)`` (local; default: always) is true on every rank; other files of those
    suffixes keep meshio on rank 0. :mod:`slasolve.fem.xdmf` registers the XDMF reader."""
    _PARALLEL_READERS.append((tuple(s.lower() for s in suffixes), accepts, reader))


def read_mesh(path: Union[str, os.PathLike], comm: Optional[MPI.Comm] = None, partition: Optional[str] = None,
              dtype: torch.dtype = torch.float64, simplices: bool = False, collapse: bool = False) -> Mesh:
    """Collective. Read a mesh file and distribute it.

    **XDMF + HDF5** (``.xdmf``; as written by :func:`slasolve.fem.write_xdmf`, DOLFINx or
    meshio): read in parallel, every rank one contiguous slice of cells and points, then
    partitioned in parallel and redistributed (:func:`slasolve.fem.xdmf.read_xdmf_mesh`:
    ``partition`` ``None`` reuses the layout saved by ``write_xdmf`` on as many ranks, else
    PT-Scotch through PETSc; ``"ptscotch"``, ``"metis"``, ``"block"``, ``"saved"``). Cell
    tags (a ``Cell`` attribute ``cell_tags`` / ``gmsh:physical`` of the mesh grid, or, as
    DOLFINx's ``XDMFFile.write_meshtags`` writes them, a grid of the cell type including the
    mesh's Geometry, matched to the cells by vertex set in parallel) and facet tags (a grid
    of the facet type with an attribute) are kept in ``mesh.cell_tags`` and
    ``mesh.facet_tags``; ``mesh.original_ids`` / ``mesh.original_cell_ids`` give the
    file's point / cell index of each local node / cell. Grids of two cell types of the
    top dimension (mixed volume cells) raise ``ValueError`` naming the file and the types.
    Convert other formats once with :func:`slasolve.fem.convert_mesh` (with
    ``collapse=True`` or ``simplices=True`` for mixed cell types).

    **Other formats**, and XDMF files with several cell blocks (a ``Mixed`` topology) or
    inline data (meshio on rank 0, for meshes that fit on one node): as follows.
    Rank 0 reads the file (only ``path`` on rank 0 is used) and keeps the block(s)
    of the highest-dimensional cell type (one of ``triangle``, ``quad``, ``tetra``,
    ``hexahedron``; two types of that dimension, e.g. triangles and quads, raise
    ``ValueError`` naming the file and the types, unless ``collapse`` or ``simplices``), with their tags (gmsh physical groups,
    ``cell_tags`` or ``medit:ref``) in ``mesh.cell_tags`` and the tagged blocks of
    their facet type (lines, triangles or quads) in ``mesh.facet_tags``, as
    :func:`slasolve.fem.convert_mesh` keeps them; points not used by those cells are dropped, and flat 2-D
    meshes stored with 3-D points lose the constant z. Cells are reoriented to
    positive orientation. Nodes are partitioned with ``partition`` (a method of
    :func:`slasolve.partition.partition`: ``"metis"`` (default), ``"rcb"``, ``"hilbert"``,
    or ``"block"`` / ``"contiguous"`` to keep the file order) and renumbered so each rank owns a contiguous range; each
    cell goes to the owner of its smallest (renumbered) node id. Cells and the
    coordinates each rank needs are scattered from rank 0.

    The whole mesh is held on rank 0 while reading: this path is for meshes
    that fit in one node's memory (use :func:`box_mesh` for generated meshes of
    any size). A missing file raises ``FileNotFoundError``; an unreadable,
    truncated or unsupported one ``ValueError`` naming the file and the problem; on
    every rank. ``partition`` and ``dtype`` must be the same on every rank.
    ``mesh.original_ids`` gives each local node's index in the file's points.

    **Mixed cell types** (this path only; ``collapse`` and ``simplices`` exclude each other): the
    cells of the top dimension may mix triangles and quads, or tetrahedra, pyramids, wedges and
    hexahedra (gmsh's recombined, boundary-layer and hex-dominant meshes).

    * ``collapse=True``: Q1 on every cell. The mesh is a ``"quad"`` / ``"hexahedron"`` mesh
      whose triangles, tetrahedra, pyramids and wedges are collapsed Q1 cells with repeated
      vertices (:mod:`slasolve.fem.collapse`: triangle ``(a, b, c, c)``, tetrahedron
      ``(a, b, c, c, d, d, d, d)``, pyramid ``(a, b, c, d, e, e, e, e)``, wedge
      ``(a, b, c, c, d, e, f, f)``). On a collapsed triangle or tetrahedron the element is
      exactly P1, on a pyramid or wedge the collapsed trilinear element, on quads and
      hexahedra Q1; together they are conforming. Each cell keeps its tag (one cell per file
      cell, ``original_cell_ids`` the file's); tagged triangle facets are padded alike.
      A cell's degenerate facets (its repeated vertex in 2-D, a point or an edge in 3-D) are
      no facets (not boundary, not in the dual graph). A collapsed tetrahedron costs an 8x8
      element matrix (4x4 on a native tetra mesh).
    * ``simplices=True``: P1 on every cell. Every cell is split into triangles or tetrahedra
      that fit together across cells and ranks (:mod:`slasolve.fem.simplex_split`:
      quadrilateral faces cut along the diagonal through their smallest point index; each
      hexahedron into 12 tetrahedra around a new point at its vertex average, which gets a
      point index past the file's in ``original_ids``), keeping each cell's tag on its pieces
      and splitting tagged quadrilateral facets alike.

    For XDMF files read in parallel, convert once with ``convert_mesh(src, dst, collapse=True)``
    (or ``simplices=True``) instead: the file then holds one cell type. Either option on an
    XDMF file read in parallel whose cells the option would not make (``simplices=True`` on
    quads or hexahedra, ``collapse=True`` on triangles or tetrahedra) raises ``ValueError``.
    Both options at once, or on a file with higher-order cells, raise ``ValueError`` on every
    rank.
    """
    comm = get_comm(comm)
    check_collective(comm, _mixed_cell_options("read_mesh", simplices, collapse),
                     agree={"simplices": simplices, "collapse": collapse})
    if isinstance(path, (str, os.PathLike)):
        for suffixes, accepts, reader in _PARALLEL_READERS:
            # a file the parallel reader does not take (meshio's XDMF with a Mixed topology or
            # inline data) falls through to meshio on rank 0
            if os.fspath(path).lower().endswith(suffixes) and allreduce_int(
                    comm, int(accepts is None or bool(accepts(path))), op=MPI.MIN):
                mesh = reader(path, comm=comm, partition=partition, dtype=dtype)
                option = "simplices" if simplices else "collapse" if collapse else None
                if option and (mesh.cell_type in ("triangle", "tetra")) != bool(simplices):
                    # the cell type is the file's, the same on every rank
                    raise ValueError(f"read_mesh: {os.fspath(path)!r} holds {mesh.cell_type} cells; {option}=True "
                                     f"{'splits' if simplices else 'collapses'} cells while reading other formats: "
                                     f"convert the source mesh with convert_mesh(src, dst, {option}=True) and "
                                     f"read dst")
                return mesh
    if partition is None:
        partition = "metis"
    rank, size = comm.Get_rank(), comm.Get_size()
    err = None
    if not isinstance(partition, str):
        err = TypeError(f"partition must be a str, got {type(partition).__name__}")
    elif dtype not in (torch.float64, torch.float32):
        err = TypeError(f"dtype must be torch.float64 or torch.float32, got {dtype}")
    check_collective(comm, err, agree={"partition": partition, "dtype": str(dtype)})
    result = None
    if rank == 0:
        try:
            result = _read_and_distribute(path, size, partition, simplices, collapse)
        except Exception as e:  # noqa: BLE001 - broadcast to every rank below
            err = e
    if size > 1:
        info = comm.bcast(None if err is None else (type(err).__name__, str(err)), root=0)
        if info is not None:
            if err is not None:
                raise err
            exc = {"FileNotFoundError": FileNotFoundError, "TypeError": TypeError,
                   "ImportError": ImportError}.get(info[0], ValueError)
            raise exc(info[1] + " (raised on rank 0)")
        meta = comm.bcast(result[0] if rank == 0 else None, root=0)
        mine = comm.scatter(result[1] if rank == 0 else None, root=0)
    else:
        if err is not None:
            raise err
        meta, (mine,) = result
    return Mesh(comm=comm, cell_type=meta["cell"], dim=meta["dim"],
                cells=torch.from_numpy(np.ascontiguousarray(mine["cells"], dtype=np.int64)),
                node_ids=torch.from_numpy(mine["node_ids"]),
                node_coords=torch.from_numpy(np.ascontiguousarray(mine["coords"])).to(dtype),
                owned_range=mine["owned"], n_global_nodes=meta["n_nodes"], n_global_cells=meta["n_cells"],
                boundary_mask=torch.from_numpy(mine["boundary"]),
                original_ids=torch.from_numpy(mine["original"].astype(np.int64)),
                cell_tags=torch.from_numpy(mine["cell_tags"]) if "cell_tags" in mine else None,
                facet_tags=_facet_tags(*mine["facet_tags"]) if "facet_tags" in mine else None)


# --------------------------------------------------------------------------- VTU output
_VTK_TYPES = {np.dtype(np.float64): "Float64", np.dtype(np.float32): "Float32",
              np.dtype(np.int64): "Int64", np.dtype(np.int32): "Int32", np.dtype(np.int8): "Int8",
              np.dtype(np.uint8): "UInt8", np.dtype(np.uint32): "UInt32", np.dtype(np.uint64): "UInt64",
              np.dtype(np.int16): "Int16", np.dtype(np.uint16): "UInt16"}


def _np(x) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    a = np.ascontiguousarray(np.asarray(x))
    if a.dtype == np.bool_:
        a = a.astype(np.uint8)
    return a


def _fetch_ghosts(mesh: Mesh, owned_values: np.ndarray) -> np.ndarray:
    """Collective. Values on all of ``node_ids`` from values on the owned nodes (point-to-point
    via one alltoall of requests and one of replies; I/O helper, not a performance path)."""
    comm = mesh.comm
    size = comm.Get_size()
    s, e = mesh.owned_range
    out = np.empty((mesh.node_ids.shape[0],) + owned_values.shape[1:], dtype=owned_values.dtype)
    ids = mesh.node_ids.numpy()
    om = mesh.owned_mask().numpy()
    out[om] = owned_values
    if size == 1:
        return out
    starts = np.asarray(comm.allgather(s), dtype=np.int64)
    ghosts = ids[~om]
    owner = np.searchsorted(starts, ghosts, side="right") - 1
    requests = [ghosts[owner == r] for r in range(size)]
    asked = comm.alltoall(requests)
    replies = comm.alltoall([owned_values[a - s] for a in asked])
    gvals = np.empty((ghosts.size,) + owned_values.shape[1:], dtype=owned_values.dtype)
    for r in range(size):
        gvals[owner == r] = replies[r]
    out[~om] = gvals
    return out


def _pvtu_xml(piece_names, points_dtype, point_data, cell_data) -> str:
    from xml.sax.saxutils import quoteattr

    def arrays(data, tag):
        lines = []
        for name, a in data.items():
            ncomp = 1 if a.ndim == 1 else int(np.prod(a.shape[1:]))
            lines.append(f'      <PDataArray type="{_VTK_TYPES[a.dtype]}" Name={quoteattr(name)} '
                         f'NumberOfComponents="{ncomp}"/>')
        return [f"    <{tag}>"] + lines + [f"    </{tag}>"]

    out = ['<?xml version="1.0"?>',
           '<VTKFile type="PUnstructuredGrid" version="0.1" byte_order="LittleEndian">',
           '  <PUnstructuredGrid GhostLevel="0">']
    out += arrays(point_data, "PPointData")
    out += arrays(cell_data, "PCellData")
    out += ["    <PPoints>",
            f'      <PDataArray type="{_VTK_TYPES[np.dtype(points_dtype)]}" NumberOfComponents="3"/>',
            "    </PPoints>"]
    out += [f'    <Piece Source={quoteattr(p)}/>' for p in piece_names]
    out += ["  </PUnstructuredGrid>", "</VTKFile>", ""]
    return "\n".join(out)


def write_mesh(path: Union[str, os.PathLike], mesh: Mesh,
               point_data: Optional[Dict[str, Union[torch.Tensor, np.ndarray]]] = None,
               cell_data: Optional[Dict[str, Union[torch.Tensor, np.ndarray]]] = None,
               gather: bool = False) -> str:
    """Collective. Write the distributed mesh and its data for ParaView.

    ``point_data``: name -> array whose first dimension is either the number of
    owned nodes (``mesh.n_owned``; ghost values are fetched from their owners)
    or ``len(mesh.node_ids)``. ``cell_data``: name -> ``(n_local_cells, ...)``.
    Every piece also carries the point array ``global_id`` and the cell array
    ``rank``.

    ``gather=False`` (default): each rank writes ``<stem>_<rank>.vtu`` (its cells
    and ghost layer) next to ``<stem>.pvtu``, which rank 0 writes; ``path`` names
    the ``.pvtu`` (its suffix is replaced by ``.pvtu``). ``gather=True``: the mesh
    is gathered to rank 0 and written to ``path`` in any meshio format (this needs
    the whole mesh in rank 0's memory). Returns the path of the written index /
    file (on every rank). Errors in the data, and arguments that differ between
    ranks, raise on every rank. The files are written to temporary names next to the
    targets and renamed only after every rank has written its part, so a failure
    (disk full, permissions, bad data on one rank) raises on every rank and leaves the
    previous files untouched (no temporaries left behind).

    The index names its pieces relative to its own folder (``u_0000.vtu`` next to
    ``out/u.pvtu``), so the set can be moved as a whole. ParaView opens the ``.pvtu``
    as one dataset; :func:`read_pvtu` reassembles it into one ``meshio.Mesh`` (meshio
    itself reads only the single pieces).
    """
    import meshio

    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    comm = mesh.comm
    rank, size = comm.Get_rank(), comm.Get_size()
    path = os.fspath(path)
    n_loc, n_own, n_cells = mesh.node_ids.shape[0], mesh.n_owned, mesh.n_local_cells
    pdata, cdata, err = {}, {}, None
    try:
        for name, v in (point_data or {}).items():
            a = _np(v)
            if a.ndim == 0 or a.shape[0] not in (n_loc, n_own):
                raise ValueError(f"point_data[{name!r}] must have first dimension {n_own} (owned nodes) or "
                                 f"{n_loc} (local nodes), got shape {a.shape}")
            pdata[name] = a
        for name, v in (cell_data or {}).items():
            a = _np(v)
            if a.ndim == 0 or a.shape[0] != n_cells:
                raise ValueError(f"cell_data[{name!r}] must have first dimension {n_cells}, got shape {a.shape}")
            cdata[name] = a
    except Exception as e:  # noqa: BLE001
        err = e
    # every rank must agree on the arrays (otherwise the fetch below would hang), the
    # target and the mode
    check_collective(comm, err, agree={"path": path, "gather": bool(gather), "point_data names": sorted(pdata),
                                       "cell_data names": sorted(cdata)})
    # first dimension: owned vs local must be decided collectively when sizes coincide
    om = mesh.owned_mask().numpy()
    for name in sorted(pdata):
        a = pdata[name]
        is_owned = a.shape[0] == n_own and n_own != n_loc
        any_owned = comm.allreduce(int(is_owned), op=MPI.MAX) if size > 1 else int(is_owned)
        if any_owned:
            pdata[name] = _fetch_ghosts(mesh, a if a.shape[0] == n_own else a[om])
    pdata["global_id"] = mesh.node_ids.numpy().astype(np.int64)
    cdata["rank"] = np.full(n_cells, rank, dtype=np.int32)
    coords = mesh.node_coords.detach().cpu().numpy().astype(np.float64)
    pts = np.zeros((coords.shape[0], 3))
    pts[:, :mesh.dim] = coords
    local_cells = mesh.local_cells().numpy()

    if gather:
        own_pts = comm.gather(pts[om], root=0)
        own_pd = {k: comm.gather(v[om], root=0) for k, v in sorted(pdata.items())}
        all_cells = comm.gather(mesh.cells.numpy(), root=0)
        all_cd = {k: comm.gather(v, root=0) for k, v in sorted(cdata.items())}
        mine = {}
        if rank == 0:
            mine[path] = lambda tmp: meshio.write(tmp, meshio.Mesh(
                np.concatenate(own_pts), [(mesh.cell_type, np.concatenate(all_cells))],
                point_data={k: np.concatenate(v) for k, v in own_pd.items()},
                cell_data={k: [np.concatenate(v)] for k, v in all_cd.items()}))
        _staged_write(comm, mine, {})
        return path

    stem = path[:-len(".pvtu")] if path.endswith(".pvtu") else os.path.splitext(path)[0]
    index = stem + ".pvtu"
    piece = f"{stem}_{rank:04d}.vtu"
    pieces = {piece: lambda tmp: meshio.write(
        tmp, meshio.Mesh(pts, [(mesh.cell_type, local_cells)], point_data=pdata,
                         cell_data={k: [v] for k, v in cdata.items()}), file_format="vtu", binary=True)}
    last = {}
    if rank == 0:
        names = [os.path.basename(f"{stem}_{r:04d}.vtu") for r in range(size)]
        xml = _pvtu_xml(names, np.float64, pdata, cdata)

        def write_index(tmp):
            with open(tmp, "w") as fh:
                fh.write(xml)
        last[index] = write_index
    _staged_write(comm, pieces, last)
    return index


def read_pvtu(path: Union[str, os.PathLike]):
    """Local. The dataset of a ``.pvtu`` index written by :func:`write_mesh` as ONE
    ``meshio.Mesh`` (meshio reads ``.vtu`` pieces but not the ``.pvtu`` index).

    The pieces are read with meshio from the paths in the index (relative to its
    folder). When every piece carries the point array ``global_id`` (as
    :func:`write_mesh` writes it), points shared between pieces (ghost copies) are
    merged: the result has one point per global id, in global id order, cells in
    piece order -- the same arrays as ``write_mesh(..., gather=True)`` writes to a
    ``.vtu``. Without ``global_id`` the pieces are concatenated. Reads everything
    on the calling rank.
    """
    import xml.etree.ElementTree as ET

    import meshio

    path = os.fspath(path)
    root = ET.parse(path).getroot()
    grid = root.find("PUnstructuredGrid")
    if root.get("type") != "PUnstructuredGrid" or grid is None:
        raise ValueError(f"{path!r} is not a .pvtu (PUnstructuredGrid) file")
    folder = os.path.dirname(os.path.abspath(path))
    sources = [p.get("Source") for p in grid.findall("Piece")]
    if not sources or any(not s for s in sources):
        raise ValueError(f"{path!r}: no pieces (or a Piece without Source)")
    pieces = [meshio.read(s if os.path.isabs(s) else os.path.join(folder, s), file_format="vtu")
              for s in sources]
    cell_types = sorted({c.type for m in pieces for c in m.cells})
    merge = all("global_id" in m.point_data for m in pieces)
    if merge:
        gids = [np.asarray(m.point_data["global_id"], dtype=np.int64).reshape(-1) for m in pieces]
        n = int(max(int(g.max()) if g.size else -1 for g in gids)) + 1
        maps = gids
    else:
        offs = np.cumsum([0] + [len(m.points) for m in pieces])
        n = int(offs[-1])
        maps = [np.arange(offs[i], offs[i + 1]) for i in range(len(pieces))]
    points = np.zeros((n, pieces[0].points.shape[1]), dtype=pieces[0].points.dtype)
    seen = np.zeros(n, dtype=bool)
    for m, g in zip(pieces, maps):
        points[g] = m.points
        seen[g] = True
    if not seen.all():
        raise ValueError(f"{path!r}: the pieces do not cover global ids 0..{n - 1} "
                         f"({int((~seen).sum())} missing)")
    point_data = {}
    for name in pieces[0].point_data:
        if all(name in m.point_data for m in pieces):
            first = np.asarray(pieces[0].point_data[name])
            out = np.zeros((n,) + first.shape[1:], dtype=first.dtype)
            for m, g in zip(pieces, maps):
                out[g] = m.point_data[name]
            point_data[name] = out
    cells, cell_data = [], {name: [] for name in pieces[0].cell_data
                            if all(name in m.cell_data for m in pieces)}
    for ct in cell_types:
        blocks = [(m, g, i) for m, g in zip(pieces, maps) for i, c in enumerate(m.cells) if c.type == ct]
        cells.append((ct, np.concatenate([g[m.cells[i].data] for m, g, i in blocks])))
        for name in cell_data:
            cell_data[name].append(np.concatenate([np.asarray(m.cell_data[name][i]) for m, _, i in blocks]))
    return meshio.Mesh(points, cells, point_data=point_data, cell_data=cell_data)


def _staged_write(comm: MPI.Comm, files: Dict[str, Callable[[str], None]],
                  last: Dict[str, Callable[[str], None]]) -> None:
    """Collective. Write files so that a failure on any rank changes none of them.

    ``files`` / ``last``: this rank's ``{final path: writer(temporary path)}``. Each rank
    writes into a private temporary directory next to the final files (same file system;
    the temporary file has the final file's name, so formats that name companion files
    after it keep valid references), then, only once every rank succeeded, moves
    ``files`` into place, and after them ``last`` (the ``.pvtu`` index, so that it never
    names pieces that were not replaced). Temporaries are removed in every case; any
    error is raised on every rank. Only a failing ``os.replace`` (after every write
    succeeded) can leave a mix of old and new files.
    """
    import shutil
    import tempfile

    staged, tmpdirs, err = [], [], None
    try:
        for final, write in list(files.items()) + list(last.items()):
            folder = os.path.dirname(os.path.abspath(final))
            tmpdir = tempfile.mkdtemp(prefix=".slasolve-write-", dir=folder)
            tmpdirs.append(tmpdir)
            tmp = os.path.join(tmpdir, os.path.basename(final))
            write(tmp)
            staged.append((final, tmpdir))
    except Exception as e:  # noqa: BLE001 - raised on every rank below
        err = OSError(f"write_mesh: cannot write {final!r}: {type(e).__name__}: {e}") \
            if not isinstance(e, (ValueError, TypeError)) else e
    try:
        check_collective(comm, err)
        for phase in (files, last):
            err = None
            try:
                for final, tmpdir in staged:
                    if final in phase:
                        for name in os.listdir(tmpdir):   # the file and any companions
                            os.replace(os.path.join(tmpdir, name),
                                       os.path.join(os.path.dirname(os.path.abspath(final)), name))
            except Exception as e:  # noqa: BLE001
                err = OSError(f"write_mesh: cannot move {final!r} into place: {e}")
            check_collective(comm, err)
    finally:
        for tmpdir in tmpdirs:
            shutil.rmtree(tmpdir, ignore_errors=True)
