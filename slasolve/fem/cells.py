"""Reference cells: what each supported cell type is made of.

Local tables, no MPI and no torch: dimensions and vertex counts, facets (local vertex
indices), the permutation that reverses a cell's orientation, the signed measure, the
dimensions of meshio's cell types, and the subdivision of a box into cells that
:func:`~slasolve.fem.box_mesh` uses.
"""
from __future__ import annotations

import numpy as np

__all__ = ["CELL_TYPES", "CELL_DIM", "CELL_VERTICES", "CELL_FACETS", "ORIENTATION_FLIP", "MESHIO_DIM",
           "signed_measure", "KUHN_TETS", "QUAD_BITS", "HEX_BITS", "TRI_BITS", "CELLS_PER_BOX"]

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
