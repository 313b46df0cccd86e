"""Conforming meshes of mixed cell types (triangles + quads; hexahedra + wedges + pyramids +
tetrahedra) written with meshio, and the boundary of their cells: shared by the tests of
``simplices=True`` (tests/test_fem_mixed_cells.py) and ``collapse=True``
(tests/test_fem_collapsed_cells.py)."""
import numpy as np
from mpi4py import MPI

COMM = MPI.COMM_WORLD
TAGS = {"quad": 1, "triangle": 2, "hexahedron": 1, "wedge": 2, "pyramid": 3, "tetra": 4}
BOTTOM = 7
FACES = {"triangle": [[0, 1], [1, 2], [2, 0]], "quad": [[0, 1], [1, 2], [2, 3], [3, 0]],
         "tetra": [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]],
         "hexahedron": [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 5, 4], [1, 2, 6, 5], [2, 3, 7, 6], [3, 0, 4, 7]],
         "wedge": [[0, 1, 2], [3, 4, 5], [0, 1, 4, 3], [1, 2, 5, 4], [2, 0, 3, 5]],
         "pyramid": [[0, 1, 2, 3], [0, 1, 4], [1, 2, 4], [2, 3, 4], [3, 0, 4]]}
CAP = 0.3
# reverses a cell's orientation (VTK vertex order)
REVERSE = {"triangle": [0, 2, 1], "quad": [0, 3, 2, 1], "tetra": [0, 2, 1, 3], "hexahedron": [0, 3, 2, 1, 4, 7, 6, 5],
           "wedge": [0, 2, 1, 3, 5, 4], "pyramid": [0, 3, 2, 1, 4]}


def mixed_mesh(dim, n=4, layers=3, seed=0, cap=CAP, flip=False, lines=False):
    """A conforming mixed mesh of the unit square / cube, points numbered at random.

    2-D: quads for x < 1/2, each other square cut into two triangles along a random diagonal.
    3-D: that mesh extruded in ``layers`` layers (quads -> hexahedra, triangles -> wedges),
    capped by a pyramid over each top quad and a tetrahedron over each top triangle (apex
    ``cap`` above the face's centre). ``flip``: every other cell of each block listed with
    the reverse orientation. ``lines``: in 2-D, the edges on y = 0 as bottom facets. Returns (points, [(type, cells)], volume, bottom facets)."""
    rng = np.random.default_rng(seed)
    g = np.arange((n + 1) ** 2).reshape(n + 1, n + 1)            # g[j, i]: point (i/n, j/n)
    xy = np.stack(np.meshgrid(np.linspace(0, 1, n + 1), np.linspace(0, 1, n + 1)), -1).reshape(-1, 2)
    quads, tris = [], []
    for j in range(n):
        for i in range(n):
            q = [g[j, i], g[j, i + 1], g[j + 1, i + 1], g[j + 1, i]]
            if i < n // 2:
                quads.append(q)
            elif rng.random() < 0.5:
                tris += [[q[0], q[1], q[2]], [q[0], q[2], q[3]]]
            else:
                tris += [[q[0], q[1], q[3]], [q[1], q[2], q[3]]]
    quads, tris = np.array(quads), np.array(tris)
    if dim == 2:
        pts, blocks, volume, bottom = xy, [("quad", quads), ("triangle", tris)], 1.0, []
        if lines:
            bottom = [("line", np.c_[g[0, :-1], g[0, 1:]])]
    else:
        m = xy.shape[0]
        pts = np.concatenate([np.c_[xy, np.full(m, k / layers)] for k in range(layers + 1)])
        hexes = np.concatenate([np.c_[quads + k * m, quads + (k + 1) * m] for k in range(layers)])
        wedges = np.concatenate([np.c_[tris + k * m, tris + (k + 1) * m] for k in range(layers)])
        top = layers * m
        cq = pts[quads + top].mean(1) + [0, 0, cap]
        ct = pts[tris + top].mean(1) + [0, 0, cap]
        apex_q = len(pts) + np.arange(len(quads))
        apex_t = len(pts) + len(quads) + np.arange(len(tris))
        pts = np.concatenate([pts, cq, ct])
        pyramids = np.c_[quads + top, apex_q]
        tets = np.c_[tris + top, apex_t]
        blocks = [("hexahedron", hexes), ("wedge", wedges), ("pyramid", pyramids), ("tetra", tets)]
        volume = 1.0 + cap / 3.0                                  # the caps: area x height / 3
        bottom = [("quad", quads), ("triangle", tris)]
    if flip:
        blocks = [(t, np.where(np.arange(len(c))[:, None] % 2 == 1, c[:, REVERSE[t]], c)) for t, c in blocks]
    perm = rng.permutation(len(pts))                              # old -> new point index
    inv = np.argsort(perm)
    return (pts[inv], [(t, perm[c]) for t, c in blocks], volume, [(t, perm[c]) for t, c in bottom])


def write_msh(path, dim, **kw):
    """Collective. :func:`mixed_mesh` written by rank 0 as a gmsh 2.2 file, every cell's type's
    ``TAGS`` entry as its physical group, the bottom facets (3-D) tagged ``BOTTOM``."""
    import meshio

    pts, blocks, volume, bottom = mixed_mesh(dim, **kw)
    if COMM.rank == 0:
        cells = blocks + bottom
        phys = [np.full(len(c), TAGS[t]) for t, c in blocks] + [np.full(len(c), BOTTOM) for _, c in bottom]
        xyz = np.c_[pts, np.zeros(len(pts))] if dim == 2 else pts
        meshio.write(path, meshio.Mesh(xyz, cells, cell_data={"gmsh:physical": phys, "gmsh:geometrical": phys}),
                     file_format="gmsh22", binary=False)
    COMM.Barrier()
    return pts, blocks, volume, bottom


def file_boundary_points(blocks):
    """Point indices on the boundary of the file's cells: faces (as point sets) met once."""
    keys = np.concatenate([np.sort(np.pad(c[:, f], ((0, 0), (0, 4 - len(f))), constant_values=-1), axis=1)
                           for t, c in blocks for f in FACES[t]])
    uniq, count = np.unique(keys, axis=0, return_counts=True)
    once = uniq[count == 1]
    return np.unique(once[once >= 0])


