"""Meshes that mix cell types (triangles + quads; hexahedra + wedges + pyramids + tetrahedra),
read with ``simplices=True``: every cell split into simplices that fit together.

The references are independent of the split: the boundary of the file's own cells (faces
counted on the polyhedra as gmsh made them), the exact volume, the cells' physical groups, and
P1's exactness for a linear solution (a split that leaves a gap or an overlap breaks all three).
Run serially and under mpirun -n 2 / 3 / 4 with --with-mpi.
"""
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

meshio = pytest.importorskip("meshio")

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, boundary_nodes, read_mesh  # noqa: E402
from slasolve.fem.simplex_split import split_cells  # noqa: E402
from slasolve.fem.xdmf import convert_mesh  # noqa: E402

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
PIECES = {"triangle": 1, "quad": 2, "tetra": 1, "hexahedron": 12, "wedge": 3, "pyramid": 2}
TAGS = {"quad": 1, "triangle": 2, "hexahedron": 1, "wedge": 2, "pyramid": 3, "tetra": 4}
BOTTOM = 7
FACES = {"triangle": [[0, 1], [1, 2], [2, 0]], "quad": [[0, 1], [1, 2], [2, 3], [3, 0]],
         "tetra": [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]],
         "hexahedron": [[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 5, 4], [1, 2, 6, 5], [2, 3, 7, 6], [3, 0, 4, 7]],
         "wedge": [[0, 1, 2], [3, 4, 5], [0, 1, 4, 3], [1, 2, 5, 4], [2, 0, 3, 5]],
         "pyramid": [[0, 1, 2, 3], [0, 1, 4], [1, 2, 4], [2, 3, 4], [3, 0, 4]]}
CAP = 0.3


def mixed_mesh(dim, n=4, layers=3, seed=0):
    """A conforming mixed mesh of the unit square / cube, points numbered at random.

    2-D: quads for x < 1/2, each other square cut into two triangles along a random diagonal.
    3-D: that mesh extruded in ``layers`` layers (quads -> hexahedra, triangles -> wedges),
    capped by a pyramid over each top quad and a tetrahedron over each top triangle (apex
    ``CAP`` above the face's centre). Returns (points, [(type, cells)], volume, bottom facets)."""
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
    else:
        m = xy.shape[0]
        pts = np.concatenate([np.c_[xy, np.full(m, k / layers)] for k in range(layers + 1)])
        hexes = np.concatenate([np.c_[quads + k * m, quads + (k + 1) * m] for k in range(layers)])
        wedges = np.concatenate([np.c_[tris + k * m, tris + (k + 1) * m] for k in range(layers)])
        top = layers * m
        cq = pts[quads + top].mean(1) + [0, 0, CAP]
        ct = pts[tris + top].mean(1) + [0, 0, CAP]
        apex_q = len(pts) + np.arange(len(quads))
        apex_t = len(pts) + len(quads) + np.arange(len(tris))
        pts = np.concatenate([pts, cq, ct])
        pyramids = np.c_[quads + top, apex_q]
        tets = np.c_[tris + top, apex_t]
        blocks = [("hexahedron", hexes), ("wedge", wedges), ("pyramid", pyramids), ("tetra", tets)]
        volume = 1.0 + CAP / 3.0                                  # the caps: area x height / 3
        bottom = [("quad", quads), ("triangle", tris)]
    perm = rng.permutation(len(pts))                              # old -> new point index
    inv = np.argsort(perm)
    return (pts[inv], [(t, perm[c]) for t, c in blocks], volume, [(t, perm[c]) for t, c in bottom])


def write_msh(path, dim, **kw):
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


def linear_solve(mesh):
    """P1 solution of -laplace u = 0 with u = 1 + x + 2y (+ 3z) on the boundary: exact for P1."""
    V = Assembler(mesh)
    coef = torch.tensor([1.0, 2.0, 3.0][:mesh.dim], dtype=torch.float64)
    bd = boundary_nodes(mesh)
    xb = mesh.node_coords[torch.searchsorted(mesh.node_ids, bd)]
    bc = DirichletBC(V, bd, 1.0 + xb @ coef)
    K, f = bc.apply(V.stiffness(1.0), V.load(0.0))
    u = slasolve.solve(K, f, "cg", rtol=1e-13, maxiter=10000)
    exact = 1.0 + mesh.owned_node_coords() @ coef
    return V, u, exact


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("route", ["read", "convert"])
def test_mixed_mesh_splits_into_conforming_simplices(shared_dir, dim, route):
    """read_mesh(simplices=True) of a .msh, or convert_mesh(simplices=True) then the parallel
    XDMF read: the boundary is the file's boundary, the volume exact, every cell's tag kept on
    its pieces, the bottom's facet tags on its split faces, and a linear solution exact."""
    path = os.path.join(shared_dir, f"mixed{dim}.msh")
    pts, blocks, volume, bottom = write_msh(path, dim)
    if route == "convert":
        path = convert_mesh(path, os.path.join(shared_dir, f"mixed{dim}.xdmf"), comm=COMM, simplices=True)
        mesh = read_mesh(path, comm=COMM)
    else:
        mesh = read_mesh(path, comm=COMM, simplices=True)
    assert mesh.cell_type == ("triangle" if dim == 2 else "tetra")
    assert mesh.n_global_cells == sum(PIECES[t] * len(c) for t, c in blocks)
    n_hex = sum(len(c) for t, c in blocks if t == "hexahedron")
    assert mesh.n_global_nodes == len(pts) + n_hex
    # boundary nodes, by the file's point index (hexahedron centres are interior)
    own = mesh.owned_mask().numpy()
    orig = mesh.original_ids.numpy()
    on_boundary = np.isin(mesh.node_ids.numpy(), boundary_nodes(mesh).numpy())
    got = np.sort(np.concatenate(COMM.allgather(orig[own & on_boundary])))
    assert np.array_equal(got, file_boundary_points(blocks))
    # the hexahedra's centres sit at their vertex averages, after the file's points
    centres = np.concatenate(COMM.allgather(mesh.node_coords.numpy()[own & (orig >= len(pts))]))
    want = np.concatenate([pts[c].mean(1) for t, c in blocks if t == "hexahedron"] or [np.zeros((0, dim))])
    assert len(centres) == len(want)
    if len(want):
        assert np.allclose(np.sort(centres, axis=0), np.sort(want, axis=0), rtol=0, atol=1e-14)
    # volume, tags, the linear solution
    V, u, exact = linear_solve(mesh)
    total = COMM.allreduce(float(V.load(1.0).sum()))
    assert abs(total - volume) <= 1e-12 * volume
    tags = np.concatenate(COMM.allgather(mesh.cell_tags.numpy()))
    for t, c in blocks:
        assert np.count_nonzero(tags == TAGS[t]) == PIECES[t] * len(c), t
    n_bottom = COMM.allreduce(int((mesh.facet_tags.values == BOTTOM).sum()) if mesh.facet_tags is not None else 0)
    assert n_bottom == sum(PIECES[t] * len(c) for t, c in bottom)
    assert COMM.allreduce(float(torch.max(torch.abs(u - exact))), op=MPI.MAX) <= 1e-9, \
        "P1 must reproduce a linear solution"


def test_split_conforms_on_random_numberings():
    """Local: for many random point numberings of one mixed 3-D mesh, the simplices' faces met
    once are exactly the split faces of the file's boundary (no gap or overlap inside), and
    every simplex has positive volume."""
    if COMM.rank:
        return
    for seed in range(6):
        pts, blocks, volume, _ = mixed_mesh(3, n=2, layers=2, seed=seed)
        kind, cells, points, parent = split_cells(blocks, pts)
        d = np.stack([points[cells[:, k]] - points[cells[:, 0]] for k in (1, 2, 3)], -1)
        vol = np.abs(np.linalg.det(d)) / 6
        assert vol.min() > 1e-6 and abs(vol.sum() - volume) <= 1e-12
        faces = np.sort(cells[:, FACES["tetra"]].reshape(-1, 3), axis=1)
        uniq, count = np.unique(faces, axis=0, return_counts=True)
        assert count.max() == 2
        assert np.array_equal(np.unique(uniq[count == 1]), file_boundary_points(blocks))


def test_unsplittable_and_unmixed_errors(shared_dir):
    """Without simplices=True a mixed file raises naming the option; a quad XDMF read in
    parallel with simplices=True raises pointing to convert_mesh; both on every rank."""
    path = os.path.join(shared_dir, "mixed2.msh")
    write_msh(path, 2)
    with pytest.raises(ValueError, match=r"mixed2\.msh.*mixes 2-D cell types.*simplices=True"):
        read_mesh(path, comm=COMM)
    from slasolve.fem import box_mesh, write_xdmf

    quads = os.path.join(shared_dir, "quads.xdmf")
    write_xdmf(quads, box_mesh((2, 2 * COMM.size), cell="quad", comm=COMM))
    with pytest.raises(ValueError, match=r"quads\.xdmf.*quad cells.*convert_mesh"):
        read_mesh(quads, comm=COMM, simplices=True)
    with pytest.raises(TypeError, match="simplices must be a bool"):
        read_mesh(path, comm=COMM, simplices="yes")


def test_split_cells_rejects_bad_blocks():
    """Local: wrong vertex counts, non-integer indices, indices outside the points, mixed
    dimensions and unknown types raise ValueError naming the problem."""
    pts = np.zeros((6, 3))
    bad = [([("wedge", np.zeros((1, 5), dtype=np.int64))], "shape"),
           ([("pyramid", np.zeros((1, 5)))], "integer"),
           ([("tetra", np.array([[0, 1, 2, 6]]))], "outside"),
           ([("tetra", np.array([[0, 1, 2, 3]])), ("quad", np.array([[0, 1, 2, 3]]))], "one dimension"),
           ([("polyhedron", np.array([[0, 1, 2, 3]]))], "cannot split")]
    for blocks, match in bad:
        with pytest.raises(ValueError, match=match):
            split_cells(blocks, pts)
