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
from mixed_meshes import BOTTOM, FACES, TAGS, file_boundary_points, mixed_mesh, write_msh  # noqa: E402

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
PIECES = {"triangle": 1, "quad": 2, "tetra": 1, "hexahedron": 12, "wedge": 3, "pyramid": 2}


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
