"""Reference cells: what each supported cell type is made of.

Local tables, no MPI and no torch: dimensions and vertex counts, facets (local vertex
indices), the permutation that reverses a cell's orientation, the signed measure, the
dimensions of meshio's cell types, and the subdivision of a box into cells that
:func:`~slasolve.fem.box_mesh` uses.
"""
from __future__ import annotations

import numpy as np

__all__ = ["CELL_TYPES", "CELL_DIM", "CELL_VERTICES", "CELL_FACETS", "CELL_EDGES", "ORIENTATION_FLIP",
           "MESHIO_DIM", "MIXED_VERTICES", "check_cell_blocks", "signed_measure", "facet_keys", "canonical_facets",
           "KUHN_TETS",
           "QUAD_BITS", "HEX_BITS", "TRI_BITS", "CELLS_PER_BOX"]

CELL_TYPES = ("triangle", "quad", "tetra", "hexahedron")
CELL_DIM = {"triangle": 2, "quad": 2, "tetra": 3, "hexahedron": 3}
CELL_VERTICES = {"triangle": 3, "quad": 4, "tetra": 4, "hexahedron": 8}

MESHIO_DIM = {"vertex": 0, "line": 1, "line3": 1, "triangle": 2, "triangle6": 2, "quad": 2,
               "quad8": 2, "quad9": 2, "polygon": 2, "tetra": 3, "tetra10": 3, "hexahedron": 3,
               "hexahedron20": 3, "hexahedron27": 3, "wedge": 3, "wedge15": 3, "pyramid": 3,
               "pyramid13": 3, "polyhedron": 3}
# facets (for boundary detection) of each supported cell, in local vertex indices
CELL_FACETS = {
    "triangle": [[0, 1], [1, 2], [2, 0]],
    "quad": [[0, 1], [1, 2], [2, 3], [3, 0]],
    "tetra": [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]],
    "hexahedron": [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 5, 4], [1, 2, 6, 5], [2, 3, 7, 6], [3, 0, 4, 7]],
}
# edges of the Q1 cells (local vertex pairs): where a collapsed cell merges vertices
CELL_EDGES = {
    "quad": [[0, 1], [1, 2], [2, 3], [3, 0]],
    "hexahedron": [[0, 1], [1, 2], [2, 3], [3, 0], [4, 5], [5, 6], [6, 7], [7, 4],
                   [0, 4], [1, 5], [2, 6], [3, 7]],
}
# reverses the orientation of a cell
ORIENTATION_FLIP = {"triangle": [0, 2, 1], "quad": [0, 3, 2, 1], "tetra": [0, 2, 1, 3],
         "hexahedron": [0, 3, 2, 1, 4, 7, 6, 5]}


def signed_measure(points: np.ndarray, cells: np.ndarray, cell: str) -> np.ndarray:
    """Local. Sign-carrying size of each cell (determinant at vertex 0 along its edges)."""
    x0 = points[cells[:, 0]]
    if cell in ("triangle", "tetra"):
        J = np.stack([points[cells[:, k]] - x0 for k in range(1, CELL_DIM[cell] + 1)], axis=-1)
    elif cell == "quad":
        J = np.stack([points[cells[:, 1]] - x0, points[cells[:, 3]] - x0], axis=-1)
    else:
        J = np.stack([points[cells[:, 1]] - x0, points[cells[:, 3]] - x0, points[cells[:, 4]] - x0], axis=-1)
    return np.linalg.det(J)


# vertex counts of the first-order meshio cell types a mixed-cell file may hold (VTK order)
MIXED_VERTICES = {"triangle": 3, "quad": 4, "tetra": 4, "hexahedron": 8, "wedge": 6, "pyramid": 5}


def check_cell_blocks(blocks, target: dict, n_points: int, verb: str, into: str) -> str:
    """Local. The one cell type ``target`` (meshio type -> new type) makes of every block of
    ``blocks`` (``(meshio type, (n, k) int vertex indices)``), after checking them: every type in
    ``target`` ("cannot {verb} cells of type [...] into {into}" otherwise), all becoming one type,
    integer ``(n, k)`` arrays of the type's vertex count, indices in ``0..n_points - 1``; each
    problem a ``ValueError``. The shared checks of the simplex split and the collapse."""
    kinds = {t for t, _ in blocks}
    unknown = sorted(kinds - set(target))
    if unknown:
        raise ValueError(f"cannot {verb} cells of type {unknown} into {into}; supported: {sorted(target)}")
    targets = {target[t] for t in kinds}
    if len(targets) != 1:
        raise ValueError(f"cell types {sorted(kinds)} are not all of one dimension")
    for kind, cells in blocks:
        cells = np.asarray(cells)
        nv = MIXED_VERTICES[kind]
        if cells.ndim != 2 or cells.shape[1] != nv or not np.issubdtype(cells.dtype, np.integer):
            raise ValueError(f"{kind} cells must be an integer array of shape (n, {nv}), got "
                             f"{cells.dtype} {cells.shape}")
        if cells.size and (cells.min() < 0 or cells.max() >= n_points):
            raise ValueError(f"{kind} cells refer to points outside 0..{n_points - 1}")
    return targets.pop()


def canonical_facets(vertices: np.ndarray) -> "tuple[np.ndarray, np.ndarray]":
    """Local. ``(keys, valid)`` of facets given by their vertex ids ``(..., nfv)``.

    ``keys``: the sorted distinct vertex ids, padded to ``nfv`` with the largest (a facet of
    a collapsed Q1 cell stores a triangle as ``(a, b, c, c)`` or ``(a, a, b, c)``, whichever
    vertex its cell repeats: both get the key ``(a, b, c, c)``, as does a triangle facet
    written padded). Without repeated ids this is the plain sort. ``valid``: the facet has
    ``nfv`` distinct vertices, or at least 3 when ``nfv == 4``; a collapsed cell's other
    facets (a point in 2-D; a point or an edge in 3-D) are no facets."""
    keys = np.sort(np.asarray(vertices, dtype=np.int64), axis=-1)
    nfv = keys.shape[-1]
    dup = keys[..., 1:] == keys[..., :-1]
    n_distinct = nfv - dup.sum(-1)
    valid = n_distinct >= (3 if nfv == 4 else nfv)
    if dup.any():
        big = np.iinfo(np.int64).max
        top = keys[..., -1:]
        keys = np.sort(np.where(np.concatenate([np.zeros_like(dup[..., :1]), dup], -1), big, keys), axis=-1)
        keys = np.where(keys == big, top, keys)
    return keys, valid


def facet_keys(cells: np.ndarray, cell: str) -> "tuple[np.ndarray, np.ndarray]":
    """Local. :func:`canonical_facets` of every facet of every cell: ``(n, nf, nfv)`` keys and
    ``(n, nf)`` validity (false only for the degenerate facets of collapsed Q1 cells)."""
    return canonical_facets(np.asarray(cells)[:, np.asarray(CELL_FACETS[cell])])


def _kuhn_tets() -> np.ndarray:
    """The 6 Kuhn (Freudenthal) tetrahedra of the unit cube, as cube-vertex bit patterns,
    each positively oriented. Vertex (a,b,c) is coded a + 2b + 4c."""
    import itertools

    tets = []
    for p in itertools.permutations(range(3)):
        v = np.zeros(3, dtype=np.int64)
        path = [v.copy()]
        for ax in p:
            v[ax] = 1
            path.append(v.copy())
        P = np.array(path, dtype=np.float64)
        if np.linalg.det((P[1:] - P[0]).T) < 0:
            path[2], path[3] = path[3], path[2]
        tets.append([int(q[0] + 2 * q[1] + 4 * q[2]) for q in path])
    return np.array(tets, dtype=np.int64)


KUHN_TETS = _kuhn_tets()
# cube / square vertices (bit patterns a + 2b (+ 4c)) in VTK order
QUAD_BITS = np.array([0, 1, 3, 2])
HEX_BITS = np.array([0, 1, 3, 2, 4, 5, 7, 6])
TRI_BITS = np.array([[0, 1, 3], [0, 3, 2]])  # both counter-clockwise, diagonal 0-3
CELLS_PER_BOX = {"triangle": 2, "quad": 1, "tetra": 6, "hexahedron": 1}
