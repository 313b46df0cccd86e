"""Conforming subdivision of quadrilaterals, hexahedra, wedges and pyramids into simplices.

Local, NumPy only. A mesh that mixes cell types of one dimension (triangles and quads from
gmsh's recombination; tetrahedra with wedges, pyramids and hexahedra from boundary-layer or
hex-dominant meshing) becomes a mesh of one simplex type, on which P1 is defined.

Conformity comes from the vertex-index rule (Dompierre, Labbé, Vallet and Camarero, "How to
subdivide pyramids, prisms and hexahedra into tetrahedra", 1999): every quadrilateral face is
cut along the diagonal through its vertex of smallest point index. The two cells sharing a
face see the same indices, so they cut it alike, whatever rank or block they come from.
Pyramids and wedges then split into 2 and 3 tetrahedra without new points. A hexahedron is
split into 12 tetrahedra around a new point at its vertex average (each face's two triangles
joined to it): the Steiner point makes every combination of face diagonals splittable, which
the 5- and 6-tetrahedra subdivisions are not.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np

from .cells import check_cell_blocks

__all__ = ["SPLIT_TYPES", "split_cells", "split_facets"]

# cell type -> (simplex type it splits into, topological dimension)
SPLIT_TYPES = {"triangle": "triangle", "quad": "triangle", "tetra": "tetra", "hexahedron": "tetra",
               "wedge": "tetra", "pyramid": "tetra"}

_HEX_FACES = np.array([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 5, 4], [1, 2, 6, 5], [2, 3, 7, 6], [3, 0, 4, 7]])
# wedge (VTK order: triangle 0 1 2, triangle 3 4 5, vertex i + 3 opposite i) relabelled so that
# vertex k comes first and the other labels keep the wedge's structure
_WEDGE_FROM = np.array([[0, 1, 2, 3, 4, 5], [1, 2, 0, 4, 5, 3], [2, 0, 1, 5, 3, 4],
                        [3, 4, 5, 0, 1, 2], [4, 5, 3, 1, 2, 0], [5, 3, 4, 2, 0, 1]])


def _split_quads(quads: np.ndarray) -> np.ndarray:
    """Local. ``(n, 4)`` quadrilaterals (vertices in cyclic order) -> ``(n, 2, 3)`` triangles, cut
    along the diagonal through each one's smallest vertex index."""
    first = np.argmin(quads, axis=1)
    rolled = np.take_along_axis(quads, (first[:, None] + np.arange(4)) % 4, axis=1)
    return np.stack([rolled[:, [0, 1, 2]], rolled[:, [0, 2, 3]]], axis=1)


def _split_pyramids(pyr: np.ndarray) -> np.ndarray:
    """Local. ``(n, 5)`` pyramids (base 0-3 cyclic, apex 4) -> ``(n, 2, 4)`` tetrahedra."""
    base = _split_quads(pyr[:, :4])
    apex = np.broadcast_to(pyr[:, None, 4:5], (pyr.shape[0], 2, 1))
    return np.concatenate([base, apex], axis=2)


def _split_wedges(wedges: np.ndarray) -> np.ndarray:
    """Local. ``(n, 6)`` wedges -> ``(n, 3, 4)`` tetrahedra: with the smallest vertex relabelled
    0, the tetrahedron (0, 3, 4, 5) cuts off the far triangle and leaves a pyramid with apex 0
    over the face (1, 2, 5, 4); the two faces through 0 are cut through 0 either way."""
    w = np.take_along_axis(wedges, _WEDGE_FROM[np.argmin(wedges, axis=1)], axis=1)
    first = w[:, [0, 3, 4, 5]]
    pyramid = np.concatenate([w[:, [1, 2, 5, 4]], w[:, :1]], axis=1)
    return np.concatenate([first[:, None, :], _split_pyramids(pyramid)], axis=1)


def _split_hexahedra(hexes: np.ndarray, centre: np.ndarray) -> np.ndarray:
    """Local. ``(n, 8)`` hexahedra (VTK order) and the index of each one's centre point ->
    ``(n, 12, 4)`` tetrahedra: each face's two triangles joined to the centre."""
    n = hexes.shape[0]
    faces = hexes[:, _HEX_FACES].reshape(-1, 4)                  # (6 n, 4)
    tris = _split_quads(faces).reshape(n, 12, 3)
    return np.concatenate([tris, np.broadcast_to(centre[:, None, None], (n, 12, 1))], axis=2)


def split_cells(blocks: Sequence[Tuple[str, np.ndarray]], points: np.ndarray
                ) -> Tuple[str, np.ndarray, np.ndarray, np.ndarray]:
    """Local. Split cell blocks of one dimension into simplices that fit together.

    Parameters
    ----------
    blocks : sequence of (str, ndarray)
        ``(meshio cell type, (n, k) int vertex indices)``, all of one dimension: triangles and
        quads, or tetrahedra, hexahedra, wedges and pyramids (VTK vertex order, as meshio
        gives them).
    points : ndarray
        ``(n_points, gdim)`` coordinates the indices refer to.

    Returns
    -------
    simplex : str
        ``"triangle"`` or ``"tetra"``.
    cells : ndarray
        ``(m, dim + 1)`` int64 simplices, in block order, each cell's simplices together.
    points : ndarray
        ``points`` with one point appended per hexahedron (its vertex average), in block order.
    parent : ndarray
        ``(m,)`` int64 index of each simplex's cell in the concatenated blocks (for its tags).

    Raises
    ------
    ValueError
        For an unsupported cell type, blocks of different dimensions, a block of the wrong shape
        or dtype, or indices outside ``points``.
    """
    simplex = check_cell_blocks(blocks, SPLIT_TYPES, points.shape[0], "split", "simplices")
    out: List[np.ndarray] = []
    parents: List[np.ndarray] = []
    new_points: List[np.ndarray] = []
    offset, n_points = 0, points.shape[0]
    for kind, cells in blocks:
        cells = np.asarray(cells, dtype=np.int64)
        n = cells.shape[0]
        if kind in ("triangle", "tetra"):
            pieces = cells[:, None, :]
        elif kind == "quad":
            pieces = _split_quads(cells)
        elif kind == "pyramid":
            pieces = _split_pyramids(cells)
        elif kind == "wedge":
            pieces = _split_wedges(cells)
        else:
            centre = n_points + np.arange(n, dtype=np.int64)
            new_points.append(points[cells].mean(axis=1))
            n_points += n
            pieces = _split_hexahedra(cells, centre)
        out.append(pieces.reshape(-1, pieces.shape[-1]))
        parents.append(np.repeat(np.arange(offset, offset + n, dtype=np.int64), pieces.shape[1]))
        offset += n
    if new_points:
        points = np.concatenate([points] + new_points, axis=0)
    return simplex, np.concatenate(out), points, np.concatenate(parents)


def split_facets(blocks: Sequence[Tuple[str, np.ndarray]]) -> Tuple[np.ndarray, np.ndarray]:
    """Local. Facet blocks (lines; or triangles and quads) -> ``(facets, parent)``: the facets
    of the simplices :func:`split_cells` makes on them (quads cut by the same rule) and the index
    of each one's facet in the concatenated blocks."""
    out, parents, offset = [], [], 0
    for kind, facets in blocks:
        facets = np.asarray(facets, dtype=np.int64)
        pieces = _split_quads(facets) if kind == "quad" else facets[:, None, :]
        out.append(pieces.reshape(-1, pieces.shape[-1]))
        parents.append(np.repeat(np.arange(offset, offset + facets.shape[0], dtype=np.int64), pieces.shape[1]))
        offset += facets.shape[0]
    return np.concatenate(out), np.concatenate(parents)
