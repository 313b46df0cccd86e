"""Mixed cell types as collapsed (degenerate) Q1 cells.

Local, NumPy only. A mesh that mixes cell types of one dimension (triangles and quads from
gmsh's recombination; tetrahedra with pyramids, wedges and hexahedra from boundary-layer or
hex-dominant meshing) becomes a mesh of quadrilaterals or hexahedra, some with repeated
vertices, on which Q1 is assembled as it is (the alternative to
:mod:`slasolve.fem.simplex_split`, which makes P1 on simplices of everything):

* triangle ``(a, b, c)`` -> quad ``(a, b, c, c)``;
* tetrahedron ``(a, b, c, d)`` -> hexahedron ``(a, b, c, c, d, d, d, d)``;
* pyramid (VTK: base ``a, b, c, d``, apex ``e``) -> ``(a, b, c, d, e, e, e, e)``;
* wedge (VTK: triangle ``a, b, c``, then ``d, e, f`` with ``d`` over ``a``) ->
  ``(a, b, c, c, d, e, f, f)``.

Each keeps the orientation of its cell (vertex 0's edges to vertices 1, 3 and 4 of the
hexahedron are the cell's own edges), so :func:`~slasolve.fem.cells.signed_measure` and the
reorientation treat them like any quad / hexahedron. Why this is right (the merged vertices'
shape functions sum to one; on a triangle / tetrahedron the local space is exactly P1, on
faces P1 or bilinear: conforming) is in docs/decisions.md; degenerate facets and padded
triangle facets are handled by :func:`~slasolve.fem.cells.canonical_facets`.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

from .cells import check_cell_blocks

__all__ = ["COLLAPSE_TYPES", "collapse_cells", "collapse_facets"]

# cell type -> (Q1 type it becomes, the cell's local vertex at each of that type's vertices)
COLLAPSE_TYPES = {
    "triangle": ("quad", [0, 1, 2, 2]),
    "quad": ("quad", [0, 1, 2, 3]),
    "tetra": ("hexahedron", [0, 1, 2, 2, 3, 3, 3, 3]),
    "pyramid": ("hexahedron", [0, 1, 2, 3, 4, 4, 4, 4]),
    "wedge": ("hexahedron", [0, 1, 2, 2, 3, 4, 5, 5]),
    "hexahedron": ("hexahedron", [0, 1, 2, 3, 4, 5, 6, 7]),
}
# facet blocks (tags) of the collapsed meshes: lines stay, triangles padded like a tetrahedron's face
_FACET_PAD = {"line": [0, 1], "triangle": [0, 1, 2, 2], "quad": [0, 1, 2, 3]}


def collapse_cells(blocks: Sequence[Tuple[str, np.ndarray]], n_points: int) -> Tuple[str, np.ndarray]:
    """Local. Cell blocks of one dimension as one block of (collapsed) quads or hexahedra.

    Parameters
    ----------
    blocks : sequence of (str, ndarray)
        ``(meshio cell type, (n, k) int vertex indices)``, all of one dimension: triangles and
        quads, or tetrahedra, pyramids, wedges and hexahedra (VTK vertex order, as meshio
        gives them).
    n_points : int
        Number of points the indices refer to.

    Returns
    -------
    cell : str
        ``"quad"`` or ``"hexahedron"``.
    cells : ndarray
        ``(m, 4)`` or ``(m, 8)`` int64 cells, in block order (one per input cell: the tags
        carry over as they are).

    Raises
    ------
    ValueError
        For an unsupported cell type, blocks of different dimensions, a block of the wrong
        shape or dtype, or indices outside ``0..n_points - 1``.
    """
    cell = check_cell_blocks(blocks, {t: v[0] for t, v in COLLAPSE_TYPES.items()}, n_points, "collapse", "Q1 cells")
    return cell, np.concatenate([np.asarray(c, dtype=np.int64)[:, COLLAPSE_TYPES[k][1]] for k, c in blocks])


def collapse_facets(blocks: Sequence[Tuple[str, np.ndarray]]) -> np.ndarray:
    """Local. Facet blocks (lines; or triangles and quads) -> ``(m, 2)`` or ``(m, 4)`` facets of
    the collapsed cells, one per input facet in block order (triangles as ``(a, b, c, c)``)."""
    return np.concatenate([np.asarray(f, dtype=np.int64)[:, _FACET_PAD[k]] for k, f in blocks])
