"""Cell-level operators on distributed box meshes: density filters and neighbour graphs.

Used by PDE-constrained optimisation (topology optimisation, regularised inverse
problems), where design variables live on the cells. Each rank holds the cells it
owns; for :func:`~slasolve.fem.box_mesh` meshes those are a contiguous range of the
*global cell ids*, which are lexicographic over the boxes (x fastest, last axis
slowest) times the cells per box (1 for quads / hexahedra, 2 triangles, 6 tetrahedra)
and do not depend on the number of ranks. Cell-to-cell operators are therefore
:class:`~slasolve.DSparseTensor` row shards over cell ids, built from each rank's own
rows with :meth:`~slasolve.DSparseTensor.from_local_rows` (no global arrays; the halo
exchange and the differentiable matvec come with it). The neighbours of a cell are
found by arithmetic on the box indices, so the radius may span any number of ranks'
slabs.

* :class:`BoxCells` -- ids, box indices and centroids of the local cells of a box mesh.
* :class:`DensityFilter` -- the linear "hat" filter of topology optimisation,
  ``x_phys = (H x) / (H 1)``, ``H_ef = max(0, rmin - |c_e - c_f|)`` (Bruns & Tortorelli;
  the ``H``/``Hs`` of the 88-line code), differentiable in ``x``.
* :func:`cell_laplacian` -- graph Laplacian ``L = D - W`` over cells whose centroids are
  closer than a radius (smoothness regularisers ``theta^T L theta``).
"""
from __future__ import annotations

import math
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective
from ..dsparse import DSparseTensor
from .cells import CELLS_PER_BOX, HEX_BITS, KUHN_TETS, QUAD_BITS, TRI_BITS
from .mesh import Mesh

__all__ = ["BoxCells", "DensityFilter", "cell_laplacian"]


def _pattern(cell: str) -> np.ndarray:
    return {"triangle": TRI_BITS, "quad": QUAD_BITS[None], "tetra": KUHN_TETS,
            "hexahedron": HEX_BITS[None]}[cell]


class BoxCells:
    """Collective (constructor). The cell numbering of a :func:`~slasolve.fem.box_mesh` mesh.

    Parameters
    ----------
    mesh : Mesh
        Made by ``box_mesh(n, lower, upper, cell, comm)``.
    n : int or sequence of int
        The ``n`` it was made with (cells per axis).

    Attributes
    ----------
    shape : cells per axis; ``lower``, ``upper``, ``h`` (box size per axis, numpy);
    cells_per_box; cell_range ``(start, end)``: global ids of the local cells;
    n_global : global number of cells; ids ``(E,)`` int64 global ids of the local cells;
    centroids ``(E, dim)``.

    The local cells of ``mesh`` are checked against the arithmetic numbering (a mesh not
    made by ``box_mesh(n, ...)`` raises ``ValueError`` on every rank).
    """

    def __init__(self, mesh: Mesh, n: Union[int, Sequence[int]]):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a slasolve.fem.Mesh, got {type(mesh).__name__}")
        comm = mesh.comm
        dim, cell = mesh.dim, mesh.cell_type
        shape = (int(n),) * dim if isinstance(n, (int, np.integer)) else tuple(int(v) for v in n)
        self.comm, self.dim, self.cell = comm, dim, cell
        self.shape = shape
        self.cells_per_box = CELLS_PER_BOX[cell]
        E = mesh.n_local_cells
        start = comm.exscan(E) if comm.Get_size() > 1 else 0
        start = int(start or 0)
        self.cell_range = (start, start + E)
        self.n_global = int(np.prod(shape)) * self.cells_per_box if len(shape) == dim else -1
        # domain from the node coordinates (one small Allreduce each)
        xc = mesh.node_coords.detach().cpu().numpy().astype(np.float64)
        lo = xc.min(0) if xc.size else np.full(dim, np.inf)
        hi = xc.max(0) if xc.size else np.full(dim, -np.inf)
        if comm.Get_size() > 1:
            lo, hi = np.ascontiguousarray(lo, dtype=np.float64), np.ascontiguousarray(hi, dtype=np.float64)
            comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
            comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
        self.lower, self.upper = lo, hi
        err = None
        if len(shape) != dim:
            err = ValueError(f"n must have {dim} entries for a {dim}-D mesh, got {shape}")
        elif mesh.n_global_cells != self.n_global:
            err = ValueError(f"mesh has {mesh.n_global_cells} cells, but box_mesh(n={shape}, "
                             f"cell={cell!r}) has {self.n_global}")
        check_collective(comm, err)
        self.h = (hi - lo) / np.asarray(shape, dtype=np.float64)
        ids = torch.arange(start, start + E, dtype=torch.int64)
        self.ids = ids
        box, self.sub = ids // self.cells_per_box, ids % self.cells_per_box
        self.box_index = self._unravel(box)                                   # (E, dim)
        # check against the mesh's connectivity
        nn = np.asarray(shape) + 1
        strides = torch.as_tensor(np.concatenate([[1], np.cumprod(nn[:-1])]), dtype=torch.int64)
        base = (self.box_index * strides).sum(1)
        bits = np.arange(2 ** dim)
        corner = torch.as_tensor(sum(((bits >> d) & 1) * strides[d].item() for d in range(dim)))
        pat = torch.as_tensor(_pattern(cell))
        expect = base[:, None] + corner[pat[self.sub]]
        ok = expect.shape == mesh.cells.shape and bool((expect == mesh.cells.cpu()).all())
        check_collective(comm, None if ok else ValueError(
            f"the local cells are not those of box_mesh(n={shape}, cell={cell!r}) with this "
            "communicator (BoxCells needs a box_mesh)"))
        self._sub_centroid = torch.as_tensor(self._pattern_centroids(), dtype=torch.float64)
        self.centroids = self.centroid_of(self.box_index, self.sub)

    def _unravel(self, box: torch.Tensor) -> torch.Tensor:
        out, rem = [], box.clone()
        for s in self.shape:
            out.append(rem % s)
            rem = rem // s
        return torch.stack(out, 1)

    def _pattern_centroids(self) -> np.ndarray:
        pat = _pattern(self.cell)                                             # (cpb, nv) bit codes
        verts = np.stack([(pat >> d) & 1 for d in range(self.dim)], -1)      # (cpb, nv, dim)
        return verts.mean(1)

    def centroid_of(self, box_index: torch.Tensor, sub: torch.Tensor) -> torch.Tensor:
        """Local. Centroids ``(..., dim)`` of the cells with box indices ``(..., dim)`` and sub-cells."""
        h = torch.as_tensor(self.h)
        lo = torch.as_tensor(self.lower)
        return lo + h * (box_index.to(torch.float64) + self._sub_centroid[sub])

    def neighbours(self, radius: float) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Local. Every pair (local cell e, global cell f) with ``|c_e - c_f| < radius``
        (including ``f = e``): ``(row, col, dist)``, rows local (0-based), columns global
        ids, sorted by row then column."""
        dim, cpb = self.dim, self.cells_per_box
        reach = [int(math.ceil(radius / float(self.h[d]))) + 1 for d in range(dim)]
        offs = np.stack(np.meshgrid(*[np.arange(-r, r + 1) for r in reach[::-1]], indexing="ij")[::-1],
                        -1).reshape(-1, dim)                                  # last axis slowest
        offs = torch.as_tensor(offs, dtype=torch.int64)
        K = offs.shape[0]
        E = self.ids.shape[0]
        nb = self.box_index[:, None, None, :] + offs[None, :, None, :]         # (E, K, 1, dim)
        nb = nb.expand(E, K, cpb, dim)
        sub = torch.arange(cpb).expand(E, K, cpb)
        shp = torch.as_tensor(self.shape)
        valid = ((nb >= 0) & (nb < shp)).all(-1)
        c = self.centroid_of(nb, sub)
        d = torch.linalg.vector_norm(c - self.centroids[:, None, None, :], dim=-1)
        keep = valid & (d < radius)
        strides = torch.as_tensor(np.concatenate([[1], np.cumprod(self.shape[:-1])]), dtype=torch.int64)
        col = (nb * strides).sum(-1) * cpb + sub
        row = torch.arange(E)[:, None, None].expand(E, K, cpb)
        row, col, d = row[keep], col[keep], d[keep]
        order = torch.argsort(row * self.n_global + col)
        return row[order], col[order], d[order]

    def matrix(self, row: torch.Tensor, col: torch.Tensor, values: torch.Tensor) -> DSparseTensor:
        """Collective. The ``(n_global, n_global)`` cell-to-cell row shard with these local entries."""
        E = self.ids.shape[0]
        indptr = torch.zeros(E + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.bincount(row, minlength=E), 0)
        return DSparseTensor.from_local_rows(indptr, col, values, (self.n_global, self.n_global), self.comm)


class DensityFilter:
    """Collective (constructor). Linear density filter over the cells of a box mesh.

    ``filt(x) = (H @ x) / Hs`` with ``H_ef = max(0, rmin - |c_e - c_f|)`` (centroid
    distance, physical units) and ``Hs = H @ 1``: exactly the density filter of the
    88-line topology optimisation code for unit elements. ``x``: ``(n_local_cells,)``
    (this rank's cells, global order); the result is differentiable in ``x`` (the
    backward applies ``H^T`` by reverse halo exchange). Attributes: ``H`` (DSparseTensor
    over global cell ids), ``Hs`` ``(n_local_cells,)``, ``cells`` (:class:`BoxCells`).
    """

    def __init__(self, mesh: Mesh, n: Union[int, Sequence[int]], rmin: float, dtype=None):
        err = None
        if not (isinstance(rmin, (int, float)) and not isinstance(rmin, bool) and rmin > 0):
            err = ValueError(f"rmin must be a positive number, got {rmin!r}")
        check_collective(mesh.comm, err)
        self.cells = BoxCells(mesh, n)
        self.rmin = float(rmin)
        dtype = mesh.node_coords.dtype if dtype is None else dtype
        row, col, d = self.cells.neighbours(self.rmin)
        w = (self.rmin - d).to(dtype)
        self.H = self.cells.matrix(row, col, w)
        self.Hs = self.H @ torch.ones(self.H.n_local, dtype=dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Collective. Filtered densities on the local cells."""
        return (self.H @ x) / self.Hs


def cell_laplacian(mesh: Mesh, n: Union[int, Sequence[int]], radius: Optional[float] = None,
                   dtype=None) -> DSparseTensor:
    """Collective. Graph Laplacian ``L = D - W`` over the cells of a box mesh, ``W_ef = 1`` for
    ``0 < |c_e - c_f| < radius``. Default radius: ``0.8 * min(h)``, which for triangles joins the
    cells sharing an edge and for quads / hexahedra the face neighbours. ``theta @ (L @ theta)``
    (summed over ranks) equals ``sum over neighbour pairs (theta_e - theta_f)^2``."""
    cells = BoxCells(mesh, n)
    r = 0.8 * float(cells.h.min()) if radius is None else float(radius)
    if cells.cell == "quad" or cells.cell == "hexahedron":
        r = max(r, 1.01 * float(cells.h.min())) if radius is None else r
    row, col, d = cells.neighbours(r)
    dtype = mesh.node_coords.dtype if dtype is None else dtype
    is_self = col == cells.ids[row]
    w = torch.where(is_self, torch.zeros((), dtype=dtype), -torch.ones((), dtype=dtype))
    deg = torch.bincount(row[~is_self], minlength=cells.ids.shape[0]).to(dtype)
    w = torch.where(is_self, deg[row], w)
    return cells.matrix(row, col, w)
