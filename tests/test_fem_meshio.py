"""Parallel mesh I/O: XDMF + HDF5 write / sliced read, parallel partition and redistribution,
gmsh physical groups as tags, restart on any rank count, bad input.

Run serially and under mpirun -n 2 / 4 with --with-mpi (restarts N -> M for every N, M up to
the run's size use sub-communicators, so the -n 4 run covers N, M in {1, 2, 3, 4}).
"""
import os
import shutil

import numpy as np
import pytest
import scipy.sparse as sp
import torch
from mpi4py import MPI

h5py = pytest.importorskip("h5py")
meshio = pytest.importorskip("meshio")

import slasolve  # noqa: E402
from slasolve.fem import (Assembler, box_mesh, element_volume, mass, partition_quality,  # noqa: E402
                          read_cell_data, read_matrix, read_mesh, read_point_data, stiffness, write_xdmf,
                          xdmf_steps)
from slasolve.fem.xdmf import convert_mesh  # noqa: E402

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data")
FIXTURES = {2: os.path.join(DATA, "bracket2d.msh"), 3: os.path.join(DATA, "bracket3d.msh")}
PARTITIONERS = [pytest.param("ptscotch", marks=pytest.mark.petsc), "metis", "block"]


def converted(d, dim):
    out = os.path.join(d, f"bracket{dim}d.xdmf")
    convert_mesh(FIXTURES[dim], out, comm=COMM)
    return out


def file_arrays(dim):
    """The fixture as meshio reads it: cells, cell tags, {(sorted facet vertices): tag}."""
    m = meshio.read(FIXTURES[dim])
    ct, ft = ("triangle", "line") if dim == 2 else ("tetra", "triangle")
    tags = m.cell_data["gmsh:physical"]
    cells = np.concatenate([b.data for b in m.cells if b.type == ct])
    ctags = np.concatenate([t for b, t in zip(m.cells, tags) if b.type == ct])
    facets = {tuple(sorted(f)): int(v) for b, t in zip(m.cells, tags) if b.type == ft
              for f, v in zip(b.data.tolist(), t.tolist())}
    return m.points, cells, ctags, facets


def check_layout(mesh):
    """Contiguous ownership, node_ids = owned + touched (sorted), every cell exactly once."""
    comm = mesh.comm
    ranges = comm.allgather(mesh.owned_range)
    assert ranges[0][0] == 0 and ranges[-1][1] == mesh.n_global_nodes
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(len(ranges) - 1))
    s, e = mesh.owned_range
    expected = torch.unique(torch.cat([torch.arange(s, e), mesh.cells.reshape(-1)]))
    assert torch.equal(mesh.node_ids, expected)
    assert comm.allreduce(mesh.n_local_cells) == mesh.n_global_cells
    ids = np.concatenate(comm.allgather(mesh.original_cell_ids.numpy()))
    assert np.array_equal(np.sort(ids), np.arange(mesh.n_global_cells))
    assert bool((element_volume(mesh.local_cell_coords(), mesh.cell_type) > 0).all())


def gathered_by_file_id(mesh, values, ids=None):
    """Owned values of every rank, put in file order through mesh.original_ids."""
    comm = mesh.comm
    ids = mesh.original_ids.numpy()[mesh.owned_mask().numpy()] if ids is None else ids
    all_ids = np.concatenate(comm.allgather(ids))
    all_v = np.concatenate(comm.allgather(np.asarray(values)))
    out = np.full((int(all_ids.max()) + 1,) + all_v.shape[1:], np.nan)
    out[all_ids] = all_v
    return out


# --------------------------------------------------------------------------- write / reload
@pytest.mark.parametrize("cell,n", [("triangle", (3, 4)), ("quad", (2, 4)), ("tetra", (2, 2, 4)),
                                    ("hexahedron", (2, 3, 4))])
def test_reload_on_same_ranks_keeps_partition(shared_dir, cell, n):
    """Write, reload, write the reloaded mesh, ...: the same cells on the same ranks, the same
    numbering and bit-identical fields, cycle after cycle; time steps read back by index."""
    mesh = box_mesh(n, cell=cell, comm=COMM)
    u = mesh.owned_node_coords().sum(1) ** 2 / 3.0
    kappa = 1.0 + torch.arange(mesh.n_local_cells, dtype=torch.float64) / 7.0 + COMM.rank
    path = os.path.join(shared_dir, f"ck_{cell}.xdmf")
    current = mesh
    for cycle in range(3):
        write_xdmf(path, current, point_data={"u": u}, cell_data={"kappa": kappa})
        write_xdmf(path, current, point_data={"u": u + 1.0}, time=0.25, append=True)
        write_xdmf(path, current, point_data={"u": u + 2.0}, cell_data={"kappa": -kappa}, time=0.5, append=True)
        back = read_mesh(path, comm=COMM)
        assert torch.equal(back.cells, mesh.cells) and torch.equal(back.node_ids, mesh.node_ids)
        assert back.owned_range == mesh.owned_range and torch.equal(back.node_coords, mesh.node_coords)
        assert back.n_global_nodes == mesh.n_global_nodes and back.n_global_cells == mesh.n_global_cells
        assert torch.equal(back.boundary_mask, mesh.boundary_mask)
        assert torch.equal(read_point_data(path, back, "u"), u)
        assert torch.equal(read_cell_data(path, back, "kappa"), kappa)
        assert torch.equal(read_point_data(path, back, "u", step=0), u + 1.0)
        assert torch.equal(read_point_data(path, back, "u", step=-1), u + 2.0)
        assert torch.equal(read_cell_data(path, back, "kappa", step=1), -kappa)
        current = back
    assert xdmf_steps(path) == [0.25, 0.5]
    if COMM.rank == 0:     # the index names only files that exist, no temporaries left
        assert sorted(os.listdir(shared_dir)) == [f"ck_{cell}.h5", f"ck_{cell}.xdmf"]


def test_serial_hdf5_writes_in_turn(shared_dir, monkeypatch):
    """With a serial h5py (pip's wheel) the ranks write their rows in turn: the same file."""
    from slasolve.fem import xdmf as xdmf_mod

    mesh = box_mesh((3, 2, 2 * COMM.size), cell="tetra", comm=COMM)
    u = torch.stack([mesh.owned_node_coords()[:, 0], -mesh.owned_node_coords()[:, 2]], 1)
    paths = []
    for serial in (False, True):
        if serial:
            monkeypatch.setattr(xdmf_mod, "_mpi_hdf5", lambda h5py: False)
        paths.append(write_xdmf(os.path.join(shared_dir, f"s{int(serial)}.xdmf"), mesh, point_data={"u": u}))
        write_xdmf(paths[-1], mesh, cell_data={"r": torch.full((mesh.n_local_cells,), COMM.rank)}, time=1.0,
                   append=True)
    COMM.Barrier()
    if COMM.rank == 0:
        with h5py.File(paths[0][:-5] + ".h5", "r") as a, h5py.File(paths[1][:-5] + ".h5", "r") as b:
            for name in ("/Mesh/topology", "/Mesh/geometry", "/PointData/u", "/Function/r/0",
                         "/Partition/node_offsets"):
                assert np.array_equal(a[name][:], b[name][:]), name
    back = read_mesh(paths[1], comm=COMM)
    assert torch.equal(back.cells, mesh.cells) and torch.equal(read_point_data(paths[1], back, "u"), u)


# --------------------------------------------------------------------------- gmsh tags
@pytest.mark.parametrize("partition", PARTITIONERS)
@pytest.mark.parametrize("dim", [2, 3])
def test_gmsh_tags_independent_of_ranks(shared_dir, dim, partition):
    """A gmsh .msh v4.1 with physical groups: after conversion and a parallel read, every file
    cell once with its tag, every tagged facet once with its tag, whatever the rank count."""
    path = converted(shared_dir, dim)
    mesh = read_mesh(path, comm=COMM, partition=partition)
    check_layout(mesh)
    points, cells, ctags, facets = file_arrays(dim)
    ids = mesh.original_cell_ids.numpy()
    # the cells and their tags, through the file's numbering
    file_cells = mesh.original_ids.numpy()[mesh.local_cells().numpy()]
    assert np.array_equal(np.sort(file_cells, 1), np.sort(cells[ids], 1))
    assert np.array_equal(mesh.cell_tags.numpy(), ctags[ids])
    np.testing.assert_array_equal(mesh.node_coords.numpy(), points[mesh.original_ids.numpy(), :dim])
    # the facet tags: (sorted file vertices, value), gathered
    from slasolve.fem.cells import CELL_FACETS

    ft = mesh.facet_tags
    lf = np.asarray(CELL_FACETS[mesh.cell_type])[ft.local_facet.numpy()]
    verts = np.take_along_axis(file_cells[ft.cells.numpy()], lf, axis=1)
    mine = [(tuple(sorted(v)), int(t)) for v, t in zip(verts.tolist(), ft.values.tolist())]
    everyone = [x for part in COMM.allgather(mine) for x in part]
    assert len(everyone) == len(facets) and dict(everyone) == facets
    # boundary flags: the nodes of the tagged (boundary) facets are boundary nodes
    tagged_nodes = np.unique(verts)
    orig = mesh.original_ids.numpy()                 # not sorted: ordered by the mesh's ids
    by_file = np.argsort(orig)
    local = by_file[np.searchsorted(orig[by_file], tagged_nodes)]
    assert bool(mesh.boundary_mask[torch.from_numpy(local)].all())


def tags_by_vertex_set(mesh, dim=None):
    """Every rank's cells and tagged facets gathered as {sorted file vertex ids: tag}."""
    from slasolve.fem.cells import CELL_FACETS

    file_cells = mesh.original_ids.numpy()[mesh.local_cells().numpy()]
    cells = [(tuple(sorted(c)), int(t)) for c, t in zip(file_cells.tolist(), mesh.cell_tags.tolist())]
    ft = mesh.facet_tags
    lf = np.asarray(CELL_FACETS[mesh.cell_type])[ft.local_facet.numpy()]
    verts = np.take_along_axis(file_cells[ft.cells.numpy()], lf, axis=1)
    facets = [(tuple(sorted(v)), int(t)) for v, t in zip(verts.tolist(), ft.values.tolist())]
    cells = [x for part in mesh.comm.allgather(cells) for x in part]
    facets = [x for part in mesh.comm.allgather(facets) for x in part]
    assert len(dict(cells)) == len(cells) == mesh.n_global_cells and len(dict(facets)) == len(facets)
    return dict(cells), dict(facets)


@pytest.mark.parametrize("dim", [2, 3])
def test_msh_and_xdmf_read_facet_blocks_as_tags(shared_dir, dim):
    """One volume cell type plus facet blocks (gmsh physical groups): read_mesh on the .msh
    (meshio on rank 0) and on its XDMF conversion (parallel) both give every cell its tag and
    every tagged facet its tag, as meshio reads them from the file."""
    _, cells, ctags, facets = file_arrays(dim)
    expect = {tuple(sorted(c)): int(t) for c, t in zip(cells.tolist(), ctags.tolist())}
    for path in (FIXTURES[dim], converted(shared_dir, dim)):
        mesh = read_mesh(path, comm=COMM)
        got_cells, got_facets = tags_by_vertex_set(mesh)
        assert got_cells == expect and got_facets == facets, path
        assert mesh.comm.allreduce(len(mesh.facet_tags)) == len(facets)


def mixed_meshes(d):
    """Rank 0 writes two-type volume meshes: (path, types) for .msh, meshio XDMF (a Mixed
    topology) and a DOLFINx-like XDMF with one grid per type sharing the Geometry."""
    out = []
    pts2 = np.array([[0, 0], [1, 0], [1, 1], [0, 1], [2, 0], [2, 1]], float)
    tri, quad = np.array([[0, 1, 2], [0, 2, 3]]), np.array([[1, 4, 5, 2]])
    pts3 = np.array([[x, y, z] for z in (0, 1) for y in (0, 1) for x in (0, 1, 2)], float)
    hexa = np.array([[0, 1, 4, 3, 6, 7, 10, 9]])
    tet = np.array([[1, 2, 5, 8], [1, 4, 5, 8]])
    for dim, pts, blocks in ((2, pts2, [("triangle", tri), ("quad", quad)]),
                             (3, pts3, [("tetra", tet), ("hexahedron", hexa)])):
        types = [t for t, _ in blocks]
        xyz = np.c_[pts, np.zeros(len(pts))] if dim == 2 else pts
        phys = [np.full(len(c), i + 1) for i, (_, c) in enumerate(blocks)]
        msh, mix, two = (os.path.join(d, f"mixed{dim}{s}") for s in (".msh", "_meshio.xdmf", "_grids.xdmf"))
        if COMM.rank == 0:
            meshio.write(msh, meshio.Mesh(xyz, blocks, cell_data={"gmsh:physical": phys, "gmsh:geometrical": phys}),
                         file_format="gmsh22", binary=False)
            meshio.write(mix, meshio.Mesh(pts, blocks))
            h5 = two[:-5] + ".h5"
            with h5py.File(h5, "w") as f:
                f["geometry"] = pts
                for t, c in blocks:
                    f[t] = c.astype(np.int64)
            names = {"triangle": "Triangle", "quad": "Quadrilateral", "tetra": "Tetrahedron",
                     "hexahedron": "Hexahedron"}
            grids = []
            for i, (t, c) in enumerate(blocks):
                geo = (f'<Geometry GeometryType="{"XY" if dim == 2 else "XYZ"}"><DataItem Dimensions="{len(pts)} '
                       f'{dim}" Format="HDF">{os.path.basename(h5)}:/geometry</DataItem></Geometry>' if i == 0 else
                       "<xi:include xpointer=\"xpointer(/Xdmf/Domain/Grid/Geometry)\"/>")
                grids.append(f'<Grid Name="{t}s" GridType="Uniform">{geo}<Topology TopologyType="{names[t]}" '
                             f'NumberOfElements="{len(c)}"><DataItem Dimensions="{c.shape[0]} {c.shape[1]}" '
                             f'Format="HDF">{os.path.basename(h5)}:/{t}</DataItem></Topology></Grid>')
            with open(two, "w") as fh:
                fh.write('<?xml version="1.0"?><Xdmf Version="3.0" xmlns:xi="http://www.w3.org/2001/XInclude">'
                         f'<Domain>{"".join(grids)}</Domain></Xdmf>')
        out += [(msh, types), (mix, types), (two, types)]
    COMM.Barrier()
    return out


def test_mixed_volume_cell_types_raise_naming_file_and_types(shared_dir):
    """Triangles + quads, tetrahedra + hexahedra: read_mesh (gmsh .msh, meshio's Mixed XDMF,
    one XDMF grid per type) and convert_mesh raise ValueError on every rank naming the file
    and both types; convert_mesh writes nothing."""
    for path, types in mixed_meshes(shared_dir):
        pattern = rf"{os.path.basename(path)}.*mixes {2 if 'triangle' in types else 3}-D cell types.*" + \
            ".*".join(sorted(types))
        with pytest.raises(ValueError, match=pattern):
            read_mesh(path, comm=COMM)
        if path.endswith(".msh"):
            out = path[:-4] + "_converted.xdmf"
            with pytest.raises(ValueError, match=pattern):
                convert_mesh(path, out, comm=COMM)
            assert not os.path.exists(out) and not os.path.exists(out[:-5] + ".h5")


# --------------------------------------------------------------------------- DOLFINx tags
DOLFINX_FIXTURE = os.path.join(DATA, "dolfinx_tags.xdmf")


def test_dolfinx_meshtags_grids_fixture(shared_dir):
    """tests/data/dolfinx_tags.xdmf (DOLFINx 0.5's write_mesh + write_meshtags: cell and facet
    tags each a Grid of its own including the mesh's Geometry; tests/data/make_dolfinx_tags.py):
    the cell tags (a sparse set: -1 on untagged cells) and facet tags are those DOLFINx was given,
    checked by midpoints; a tag naming a cell the mesh does not have raises on every rank."""
    mesh = read_mesh(DOLFINX_FIXTURE, comm=COMM)
    check_layout(mesh)
    mid = mesh.local_cell_coords().mean(1).numpy()
    expect = np.where(mid[:, 0] < 0.5, 1 + (mid[:, 1] > 0.5), -1)
    assert np.array_equal(mesh.cell_tags.numpy(), expect)
    assert COMM.allreduce(int((expect > 0).sum())) == 24
    from slasolve.fem.cells import CELL_FACETS

    ft = mesh.facet_tags
    x = mesh.local_cell_coords().numpy()[ft.cells.numpy()]                      # (k, 4, 3)
    lf = np.asarray(CELL_FACETS["tetra"])[ft.local_facet.numpy()]
    fx = np.take_along_axis(x, lf[:, :, None], axis=1)                          # (k, 3, 3)
    on_left, on_top = (fx[:, :, 0] == 0).all(1), (fx[:, :, 2] == 1).all(1)
    assert np.array_equal(ft.values.numpy(), np.where(on_left, 7, np.where(on_top, 9, -1)))
    assert COMM.allreduce(len(ft)) == 16
    bad = os.path.join(shared_dir, "bad_tags.xdmf")
    if COMM.rank == 0:
        shutil.copy(DOLFINX_FIXTURE[:-5] + ".h5", bad[:-5] + ".h5")
        open(bad, "w").write(open(DOLFINX_FIXTURE).read().replace("dolfinx_tags.h5", "bad_tags.h5"))
        with h5py.File(bad[:-5] + ".h5", "r+") as f:
            f["/MeshTags/materials/topology"][0] = [0, 1, 2, 26]
    COMM.Barrier()
    with pytest.raises(ValueError, match=r"bad_tags\.xdmf.*1 cell tag\(s\) name cells that the mesh does not have"):
        read_mesh(bad, comm=COMM)


@pytest.mark.parametrize("cell", ["triangle", "quadrilateral", "tetrahedron"])
def test_dolfinx_written_meshtags(shared_dir, cell):
    """DOLFINx 0.5 writes a mesh and its cell and facet meshtags on this run's ranks; read_mesh
    reads both tag grids: tags by cell / facet midpoint as given to DOLFINx."""
    dm = pytest.importorskip("dolfinx.mesh")
    dio = pytest.importorskip("dolfinx.io")
    kind = {"triangle": dm.CellType.triangle, "quadrilateral": dm.CellType.quadrilateral,
            "tetrahedron": dm.CellType.tetrahedron}[cell]
    if cell == "tetrahedron":
        m = dm.create_unit_cube(COMM, 3, 3, 3, cell_type=kind)
    else:
        m = dm.create_unit_square(COMM, 3, 4, cell_type=kind)
    tdim = m.topology.dim
    m.topology.create_connectivity(tdim - 1, tdim)
    ncl = m.topology.index_map(tdim).size_local
    cells = np.arange(ncl, dtype=np.int32)
    mid = dm.compute_midpoints(m, tdim, cells)
    ct = dm.meshtags(m, tdim, cells, (1 + (mid[:, 0] > 0.5) + 2 * (mid[:, 1] > 0.5)).astype(np.int32))
    facets = dm.locate_entities_boundary(m, tdim - 1, lambda x: np.isclose(x[0], 0.0) | np.isclose(x[1], 1.0))
    fmid = dm.compute_midpoints(m, tdim - 1, facets)
    ft = dm.meshtags(m, tdim - 1, facets, np.where(np.isclose(fmid[:, 0], 0.0), 5, 6).astype(np.int32))
    ct.name, ft.name = "materials", "boundaries"
    path = os.path.join(shared_dir, f"dolfinx_{cell}.xdmf")
    with dio.XDMFFile(COMM, path, "w") as f:
        f.write_mesh(m)
        f.write_meshtags(ct)
        f.write_meshtags(ft)
    mesh = read_mesh(path, comm=COMM)
    check_layout(mesh)
    x = mesh.local_cell_coords().numpy()
    mid = x.mean(1)
    assert np.array_equal(mesh.cell_tags.numpy(), 1 + (mid[:, 0] > 0.5) + 2 * (mid[:, 1] > 0.5))
    from slasolve.fem.cells import CELL_FACETS

    tags = mesh.facet_tags
    lf = np.asarray(CELL_FACETS[mesh.cell_type])[tags.local_facet.numpy()]
    fx = np.take_along_axis(x[tags.cells.numpy()], lf[:, :, None], axis=1)
    assert np.array_equal(tags.values.numpy(), np.where((fx[:, :, 0] == 0).all(1), 5, 6))
    assert bool(((fx[:, :, 0] == 0) | (fx[:, :, 1] == 1)).all())          # DOLFINx's vertex predicate
    assert COMM.allreduce(len(tags)) == COMM.allreduce(len(facets))


@pytest.mark.petsc
def test_partition_quality_against_metis_and_a_serial_count(shared_dir):
    """PT-Scotch's edge cut on the 3-D bracket against serial METIS (reported; a loose bound
    on meshes this small), and partition_quality against a count on the gathered dual graph."""
    path = converted(shared_dir, 3)
    q = {}
    for method in ("ptscotch", "metis"):
        mesh = read_mesh(path, comm=COMM, partition=method)
        q[method] = partition_quality(mesh)
        # reference: the dual graph of the gathered cells (scipy), cut by the ranks
        cells = np.concatenate(COMM.allgather(mesh.cells.numpy()))
        part = np.repeat(np.arange(COMM.size), COMM.allgather(mesh.n_local_cells))
        faces = np.sort(cells[:, [[0, 1, 2], [0, 1, 3], [0, 2, 3], [1, 2, 3]]], axis=2).reshape(-1, 3)
        owner = np.repeat(np.arange(cells.shape[0]), 4)
        _, inv, cnt = np.unique(faces, axis=0, return_inverse=True, return_counts=True)
        inv = inv.reshape(-1)
        inc = sp.csr_matrix((np.ones(owner.size), (owner, inv)))
        dual = (inc @ inc.T).tocoo()
        off = dual.row != dual.col
        cut = int(np.sum(part[dual.row[off]] != part[dual.col[off]])) // 2
        assert q[method].edge_cut == cut
        assert q[method].part_sizes.tolist() == list(COMM.allgather(mesh.n_local_cells))
        assert np.sum(cnt == 2) == int(off.sum()) // 2
    if COMM.size > 1:
        assert q["ptscotch"].edge_cut <= 2 * q["metis"].edge_cut, (q["ptscotch"].summary(), q["metis"].summary())
        assert q["ptscotch"].load_imbalance <= 1.1


# --------------------------------------------------------------------------- solutions
def reaction_diffusion(mesh, kappa=1.0):
    """(K(kappa) + M) u = 1 (no boundary conditions: SPD), solved directly."""
    V = Assembler(mesh)
    A = system_matrix(mesh, V, kappa)
    b = V.load(1.0)
    return V, A, slasolve.spsolve(A, b)


def system_matrix(mesh, V, kappa):
    x = mesh.local_cell_coords()
    if not isinstance(kappa, float):
        kappa = kappa.reshape(-1, 1, 1)
    return V.assemble_matrix(stiffness(x, 1.0, mesh.cell_type) * kappa + mass(x, 1.0, mesh.cell_type))


@pytest.mark.petsc   # spsolve on more than one rank needs MUMPS
def test_solution_independent_of_ranks_and_reader(shared_dir):
    """The same discrete solution (to rounding) on the 2-D bracket whatever the rank count
    and reader (XDMF in parallel with each partitioner, the .msh through meshio on rank 0)."""
    path = converted(shared_dir, 2)
    ref = None
    if COMM.rank == 0:
        serial = read_mesh(path, comm=MPI.COMM_SELF, partition="block")
        V, A, _ = reaction_diffusion(serial)
        x = sp.linalg.spsolve(A.local.to_scipy("csc"), V.load(1.0).numpy())
        ref = np.full(serial.original_ids.numpy().max() + 1, np.nan)
        ref[serial.original_ids.numpy()] = x
    ref = COMM.bcast(ref, root=0)
    methods = ["metis", "block", "ptscotch"]
    for reader in [("xdmf", m) for m in methods] + [("msh", "metis")]:
        mesh = read_mesh(path if reader[0] == "xdmf" else FIXTURES[2], comm=COMM, partition=reader[1])
        _, _, u = reaction_diffusion(mesh)
        got = gathered_by_file_id(mesh, u.numpy())
        used = ~np.isnan(ref)
        assert np.array_equal(~np.isnan(got[:ref.size]), used)
        assert np.abs(got[used] - ref[used]).max() <= 1e-12 * np.abs(ref[used]).max(), reader


# --------------------------------------------------------------------------- restart N -> M
@pytest.mark.petsc   # spsolve on more than one rank needs MUMPS
def test_restart_on_any_rank_count(shared_dir):
    """Save a mesh, a solution and per-cell parameters on N ranks, load them on M ranks, for
    every N, M up to this run's size: the loaded fields are the saved ones bit for bit, and
    continuing (one implicit step) gives the result of continuing without a restart."""
    path = converted(shared_dir, 2)
    size = COMM.size
    saved = {}
    for n in range(1, size + 1):
        sub = COMM.Split(0 if COMM.rank < n else MPI.UNDEFINED, COMM.rank)
        if sub != MPI.COMM_NULL:
            mesh = read_mesh(path, comm=sub)
            kappa = 1.0 + mesh.cell_tags.to(torch.float64) + mesh.local_cell_coords().mean(1)[:, 0]
            V, A, u = reaction_diffusion(mesh, kappa)
            step = slasolve.spsolve(A, V.mass(1.0) @ u)         # continuing without a restart
            ck = os.path.join(shared_dir, f"restart_{n}.xdmf")
            owned_file_ids = mesh.original_ids[mesh.owned_mask()]
            write_xdmf(ck, mesh, point_data={"u": u, "source_id": owned_file_ids}, cell_data={"kappa": kappa})
            saved[n] = (gathered_by_file_id(mesh, u.numpy()), gathered_by_file_id(mesh, step.numpy()))
            sub.Free()
    saved = COMM.bcast(saved, root=0)
    for n in range(1, size + 1):
        ck = os.path.join(shared_dir, f"restart_{n}.xdmf")
        for m in range(1, size + 1):
            sub = COMM.Split(0 if COMM.rank < m else MPI.UNDEFINED, COMM.rank)
            if sub == MPI.COMM_NULL:
                continue
            mesh = read_mesh(ck, comm=sub)
            u = read_point_data(ck, mesh, "u")
            src = read_point_data(ck, mesh, "source_id").numpy()
            kappa = read_cell_data(ck, mesh, "kappa")
            V = Assembler(mesh)
            A = system_matrix(mesh, V, kappa)
            step = slasolve.spsolve(A, V.mass(1.0) @ u)
            u_ref, step_ref = saved[n]
            got_u = np.concatenate(sub.allgather(u.numpy()))
            all_src = np.concatenate(sub.allgather(src))
            assert np.array_equal(got_u, u_ref[all_src])                   # bit for bit
            got = np.concatenate(sub.allgather(step.numpy()))
            scale = np.abs(step_ref[all_src]).max()
            assert np.abs(got - step_ref[all_src]).max() <= 1e-13 * scale, (n, m)
            if m == n:   # reloaded on as many ranks: the very same partition and numbering
                assert np.array_equal(mesh.original_ids.numpy(), mesh.node_ids.numpy())
            sub.Free()


def block_matrix(mesh, kappa):
    """A 2x2-block (BSR) matrix assembled on the mesh: kron(K(kappa) + M, B), B SPD."""
    x = mesh.local_cell_coords()
    Ke = stiffness(x, 1.0, mesh.cell_type) * kappa.reshape(-1, 1, 1) + mass(x, 1.0, mesh.cell_type)
    B = torch.tensor([[2.0, 0.5], [0.5, 1.0]], dtype=torch.float64)
    return Assembler(mesh, block_size=2).assemble_matrix(torch.stack([torch.kron(k, B) for k in Ke]))


def file_id_map(mesh):
    """{global id: file point id} of every node (the test's meshes are small)."""
    own = mesh.owned_mask().numpy()
    g = np.concatenate(mesh.comm.allgather(mesh.node_ids.numpy()[own]))
    f = np.concatenate(mesh.comm.allgather(mesh.original_ids.numpy()[own]))
    out = np.empty(g.size, dtype=np.int64)
    out[g] = f
    return out


def triplets(A, to_file=None):
    """Every rank's (row, col, values) of A gathered, in file ids when to_file is given, sorted."""
    indptr, cols, vals = (t.detach().numpy() for t in A.local_rows_csr())
    s = A.spec.offsets[0][A.comm.rank]
    rows = s + np.repeat(np.arange(indptr.size - 1), np.diff(indptr))
    rows, cols = np.concatenate(A.comm.allgather(rows)), np.concatenate(A.comm.allgather(cols))
    vals = np.concatenate(A.comm.allgather(vals))
    if to_file is not None:
        rows, cols = to_file[rows], to_file[cols]
    order = np.lexsort((cols, rows))
    return rows[order], cols[order], vals[order]


@pytest.mark.petsc   # spsolve on more than one rank needs MUMPS
def test_restart_matrix_on_any_rank_count(shared_dir):
    """DSparseTensors assembled on N ranks (a scalar matrix and a 2x2-block one), saved with
    the mesh and loaded on M ranks, for every N, M up to this run's size: the loaded values are
    the saved ones bit for bit, the pattern and layout are those of the matrix reassembled on
    the reloaded mesh (values equal to rounding; bit for bit when M == N), and a solve with the
    loaded matrix gives the solution of the run that saved it."""
    path = converted(shared_dir, 2)
    size = COMM.size
    saved = {}
    for n in range(1, size + 1):
        sub = COMM.Split(0 if COMM.rank < n else MPI.UNDEFINED, COMM.rank)
        if sub != MPI.COMM_NULL:
            mesh = read_mesh(path, comm=sub)
            kappa = 1.0 + mesh.cell_tags.to(torch.float64) + mesh.local_cell_coords().mean(1)[:, 0]
            V = Assembler(mesh)
            A, B = system_matrix(mesh, V, kappa), block_matrix(mesh, kappa)
            x = slasolve.spsolve(A, V.load(1.0))
            ck = os.path.join(shared_dir, f"matrix_{n}.xdmf")
            write_xdmf(ck, mesh, cell_data={"kappa": kappa}, matrices={"A": A, "B": B})
            # the file's node ids are this mesh's global ids
            saved[n] = (triplets(A), triplets(B), gathered_by_file_id(mesh, x.numpy(), mesh.owned_range[0]
                                                                      + np.arange(mesh.n_owned)))
            sub.Free()
    saved = COMM.bcast(saved, root=0)
    for n in range(1, size + 1):
        ck = os.path.join(shared_dir, f"matrix_{n}.xdmf")
        for m in range(1, size + 1):
            sub = COMM.Split(0 if COMM.rank < m else MPI.UNDEFINED, COMM.rank)
            if sub == MPI.COMM_NULL:
                continue
            mesh = read_mesh(ck, comm=sub)
            A, B = read_matrix(ck, mesh, "A"), read_matrix(ck, mesh, "B")
            kappa = read_cell_data(ck, mesh, "kappa")
            V = Assembler(mesh)
            A_re, B_re = system_matrix(mesh, V, kappa), block_matrix(mesh, kappa)
            to_file = file_id_map(mesh)
            for loaded, again, ref in ((A, A_re, saved[n][0]), (B, B_re, saved[n][1])):
                got = triplets(loaded, to_file)
                for a, b in zip(got, ref):
                    assert np.array_equal(a, b), (n, m)                              # bit for bit
                assert loaded.global_shape == again.global_shape
                assert loaded.spec.offsets == again.spec.offsets
                assert torch.equal(loaded.local.indptr, again.local.indptr)        # the same pattern
                assert torch.equal(loaded.local.indices, again.local.indices)
                dv = (loaded.local.values - again.local.values).abs().max()
                assert float(dv) <= 1e-14 * float(again.local.values.abs().max()), (n, m)
                if m == n:
                    assert torch.equal(loaded.local.values, again.local.values)
            b = V.load(1.0)
            x, x_re = slasolve.spsolve(A, b), slasolve.spsolve(A_re, b)
            scale = float(np.abs(saved[n][2][~np.isnan(saved[n][2])]).max())
            ids = mesh.original_ids.numpy()[mesh.owned_mask().numpy()]
            assert float((x - x_re).abs().max()) <= 1e-13 * scale
            assert np.abs(x.numpy() - saved[n][2][ids]).max() <= 1e-13 * scale, (n, m)
            sub.Free()


def point_field(mesh, shift):
    """An analytic field at the owned nodes (elementwise: the same bits from the same coordinates)."""
    x = mesh.owned_node_coords()
    return x[:, 0] ** 2 + 3.0 * x[:, 1] + shift


def cell_field(mesh, shift):
    """An analytic per-cell field independent of the vertex order within a cell."""
    x = mesh.local_cell_coords()
    return x[:, :, 0].max(1).values + 10.0 * x[:, :, 1].min(1).values + shift


def on_ranks(n, fn):
    """fn(sub) on the first n ranks of COMM; its results on every rank of COMM (from rank 0)."""
    sub = COMM.Split(0 if COMM.rank < n else MPI.UNDEFINED, COMM.rank)
    out = None
    if sub != MPI.COMM_NULL:
        out = fn(sub)
        sub.Free()
    return COMM.bcast(out, root=0)


def test_matrices_appended_to_a_time_series_restart_on_any_rank_count(shared_dir):
    """A time series written on N ranks (mesh, two steps), continued on M ranks from a read_mesh
    of it (its own partition and numbering when M != N): a step with fields and matrices
    appended, for N -> M in (P, 1), (1, P), (P, P) and (2, P - 1) at P ranks. Read on this
    run's ranks, every step equals the analytic fields by coordinates (bit for bit), the
    appended matrices equal the ones the M ranks assembled (triplets in the file's ids, bit
    for bit) and the ones reassembled on the reloaded mesh (to rounding)."""
    path = converted(shared_dir, 2)
    size = COMM.size
    pairs = sorted({(size, 1), (1, size), (size, size)} | ({(2, size - 1)} if size > 2 else set()))
    for n, m in pairs:
        ck = os.path.join(shared_dir, f"series_{n}_{m}.xdmf")

        def first_run(sub):
            mesh = read_mesh(path, comm=sub)
            write_xdmf(ck, mesh, point_data={"u": point_field(mesh, 0.0)}, time=0.0)
            write_xdmf(ck, mesh, point_data={"u": point_field(mesh, 1.0)}, cell_data={"k": cell_field(mesh, 1.0)},
                       time=0.5, append=True)

        def restart(sub):
            mesh = read_mesh(ck, comm=sub)
            assert torch.equal(read_point_data(ck, mesh, "u", step=-1), point_field(mesh, 1.0))
            kappa = read_cell_data(ck, mesh, "k", step=-1)
            assert torch.equal(kappa, cell_field(mesh, 1.0))
            V = Assembler(mesh)
            A, B = system_matrix(mesh, V, kappa), block_matrix(mesh, kappa)
            write_xdmf(ck, mesh, point_data={"u": point_field(mesh, 2.0)}, cell_data={"k": cell_field(mesh, 2.0)},
                       time=1.0, append=True, matrices={"A": A, "B": B})
            to_file = file_id_map(mesh)
            return triplets(A, to_file), triplets(B, to_file)

        on_ranks(n, first_run)
        saved = on_ranks(m, restart)
        mesh = read_mesh(ck, comm=COMM)
        assert xdmf_steps(ck) == [0.0, 0.5, 1.0]
        for step, shift in ((0, 0.0), (1, 1.0), (2, 2.0)):
            assert torch.equal(read_point_data(ck, mesh, "u", step=step), point_field(mesh, shift)), (n, m)
        for step, shift in ((1, 1.0), (-1, 2.0)):
            assert torch.equal(read_cell_data(ck, mesh, "k", step=step), cell_field(mesh, shift)), (n, m)
        A, B = read_matrix(ck, mesh, "A", step=-1), read_matrix(ck, mesh, "B", step=2)
        to_file = file_id_map(mesh)
        V = Assembler(mesh)
        kappa = cell_field(mesh, 1.0)
        for loaded, again, ref in ((A, system_matrix(mesh, V, kappa), saved[0]),
                                   (B, block_matrix(mesh, kappa), saved[1])):
            for a, b in zip(triplets(loaded, to_file), ref):
                assert np.array_equal(a, b), (n, m)
            assert torch.equal(loaded.local.indptr, again.local.indptr)
            assert torch.equal(loaded.local.indices, again.local.indices)
            dv = (loaded.local.values - again.local.values).abs().max()
            assert float(dv) <= 1e-14 * float(again.local.values.abs().max()), (n, m)
        with pytest.raises(ValueError, match=r"no such matrix in step 1 \(saved: \['A \(step 2\)', 'B \(step 2\)'\]"):
            read_matrix(ck, mesh, "A", step=1)
        with pytest.raises(ValueError, match="no such matrix"):
            read_matrix(ck, mesh, "A")


def test_append_to_another_numbering_raises(shared_dir):
    """Appending from a mesh that is neither the file's mesh nor read from it (a mesh read from
    another file of the same mesh, numbered differently) raises on every rank, writes nothing."""
    a = os.path.join(shared_dir, "a.xdmf")
    b = os.path.join(shared_dir, "b.xdmf")
    box = box_mesh((3, 2 * COMM.size), cell="triangle", comm=COMM)
    write_xdmf(a, box, point_data={"u": point_field(box, 0.0)})
    other = read_mesh(a, comm=COMM, partition="block")
    # b: the same cells, nodes numbered backwards
    if COMM.rank == 0:
        with h5py.File(a[:-5] + ".h5", "r") as f:
            cells, pts = f["/Mesh/topology"][:], f["/Mesh/geometry"][:]
        n = pts.shape[0]
        meshio.write(b[:-5] + ".msh", meshio.Mesh(np.c_[pts[::-1], np.zeros(n)], [("triangle", n - 1 - cells)]),
                     file_format="gmsh22", binary=False)
    COMM.Barrier()
    convert_mesh(b[:-5] + ".msh", b, comm=COMM)
    mb = read_mesh(b, comm=COMM)
    write_xdmf(b, mb, time=0.0, point_data={"u": point_field(mb, 0.0)})
    before = open(b).read()
    with pytest.raises(ValueError, match=r"append: .*b\.h5.* numbers its mesh differently"):
        write_xdmf(b, other, point_data={"u": point_field(other, 1.0)}, time=1.0, append=True)
    assert open(b).read() == before and xdmf_steps(b) == [0.0]


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("mpiio", [True, False])
def test_failed_append_leaves_the_series(shared_dir, monkeypatch, mpiio):
    """An append (fields and a matrix) failing on one rank mid-write raises OSError on every
    rank and leaves the index and the registry naming the previous steps, their data readable;
    the next append succeeds."""
    d = os.path.join(shared_dir, f"append{int(mpiio)}")
    if COMM.rank == 0:
        os.makedirs(d)
    COMM.Barrier()
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    A = Assembler(mesh).assemble_matrix(mass(mesh.local_cell_coords(), 1.0, "quad"))
    target = os.path.join(d, "s.xdmf")
    write_xdmf(target, mesh, point_data={"u": point_field(mesh, 0.0)}, time=0.0)
    COMM.Barrier()
    before = open(target).read()
    if not mpiio:
        from slasolve.fem import xdmf as xdmf_mod
        monkeypatch.setattr(xdmf_mod, "_mpi_hdf5", lambda h5py: False)
    if COMM.rank == COMM.size - 1:
        def setitem(self, *args):
            raise OSError(5, "Input/output error (simulated)")
        monkeypatch.setattr(h5py.Dataset, "__setitem__", setitem)
    with pytest.raises(OSError, match=r"s\.h5.*Input/output error"):
        write_xdmf(target, mesh, point_data={"u": point_field(mesh, 1.0)}, time=1.0, append=True, matrices={"A": A})
    monkeypatch.undo()
    COMM.Barrier()
    assert open(target).read() == before
    back = read_mesh(target, comm=COMM)
    with pytest.raises(ValueError, match=r"step 1 out of range: the file has 1 time step"):
        read_matrix(target, back, "A", step=1)
    assert torch.equal(read_point_data(target, back, "u", step=-1), point_field(mesh, 0.0))
    write_xdmf(target, mesh, point_data={"u": point_field(mesh, 2.0)}, time=2.0, append=True, matrices={"A": A})
    assert xdmf_steps(target) == [0.0, 2.0]
    assert torch.equal(read_point_data(target, back, "u", step=1), point_field(mesh, 2.0))
    assert torch.equal(read_matrix(target, back, "A", step=1).local.values, A.local.values)


def test_matrix_checkpoint_errors_on_every_rank(shared_dir):
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    V = Assembler(mesh)
    A = V.assemble_matrix(mass(mesh.local_cell_coords(), 1.0, "quad"))
    target = os.path.join(shared_dir, "m.xdmf")
    write_xdmf(target, mesh, matrices={"M": A})
    with pytest.raises(ValueError, match="mesh.original_ids is None"):
        read_matrix(target, mesh, "M")
    again = read_mesh(target, comm=COMM)
    with pytest.raises(ValueError, match=r"m\.xdmf.*no such matrix.*\['M'\]"):
        read_matrix(target, again, "K")
    other = box_mesh((4, 2 * COMM.size), cell="quad", comm=COMM)
    with pytest.raises(ValueError, match="node-by-node"):
        write_xdmf(os.path.join(shared_dir, "bad.xdmf"), other, matrices={"M": A})
    B = Assembler(other).assemble_matrix(mass(other.local_cell_coords(), 1.0, "quad"))
    with pytest.raises(ValueError, match=r"append: .*m\.h5.* holds another mesh"):
        write_xdmf(target, other, time=1.0, append=True, matrices={"M": B})
    with pytest.raises(ValueError, match=r"m\.xdmf.*step 0 out of range"):
        read_matrix(target, again, "M", step=0)
    assert not os.path.exists(os.path.join(shared_dir, "bad.xdmf"))
    assert torch.equal(read_matrix(target, again, "M").local.values, A.local.values)


@pytest.mark.timeout(120, method="thread")
@pytest.mark.parametrize("mpiio", [True, False])
@pytest.mark.parametrize("where", ["create-first", "create-last", "write-last", "write-first"])
def test_failure_mid_write_raises_on_every_rank(shared_dir, monkeypatch, where, mpiio):
    """One rank failing inside the HDF5 write (creating a dataset, or writing its rows through
    MPI-IO or, with a serial h5py, in turn) raises OSError naming the file on every rank (no
    rank left waiting in a collective HDF5 call) and leaves the previous file set as it was."""
    d = os.path.join(shared_dir, "midwrite")
    if COMM.rank == 0:
        os.makedirs(d)
    COMM.Barrier()
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    u = mesh.owned_node_coords()[:, 0]
    target = os.path.join(d, "out.xdmf")
    write_xdmf(target, mesh, point_data={"u": u})
    COMM.Barrier()
    before = {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}
    what, rank = where.split("-")
    if not mpiio:     # pip's serial h5py: the ranks write in turn
        from slasolve.fem import xdmf as xdmf_mod
        monkeypatch.setattr(xdmf_mod, "_mpi_hdf5", lambda h5py: False)
    if COMM.rank == (0 if rank == "first" else COMM.size - 1):
        if what == "create":
            real = h5py.Group.create_dataset
            calls = []

            def create_dataset(self, *args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise OSError(5, "Input/output error (simulated)")
                return real(self, *args, **kwargs)
            monkeypatch.setattr(h5py.Group, "create_dataset", create_dataset)
        else:
            def setitem(self, *args):
                raise OSError(5, "Input/output error (simulated)")
            monkeypatch.setattr(h5py.Dataset, "__setitem__", setitem)
    # on more than one rank only rank 0 creates datasets (MPI-IO and serial HDF5 alike)
    expect_failure = not (what == "create" and rank == "last" and COMM.size > 1)
    if expect_failure:
        with pytest.raises(OSError, match=r"out\.h5.*Input/output error"):
            write_xdmf(target, mesh, point_data={"u": u + 1}, cell_data={"c": torch.ones(mesh.n_local_cells)})
        COMM.Barrier()
        assert {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))} == before
    else:
        write_xdmf(target, mesh, point_data={"u": u + 1}, cell_data={"c": torch.ones(mesh.n_local_cells)})
        monkeypatch.undo()
        assert torch.equal(read_point_data(target, read_mesh(target, comm=COMM), "u"), u + 1)


# --------------------------------------------------------------------------- bad input
def test_bad_files_raise_on_every_rank_naming_the_file(shared_dir):
    d = shared_dir
    good = converted(d, 2)
    h5 = good[:-len(".xdmf")] + ".h5"
    if COMM.rank == 0:
        for name in ("trunc", "nogeo"):
            shutil.copy(good, os.path.join(d, f"{name}.xdmf"))
            text = open(good).read().replace("bracket2d.h5", f"{name}.h5")
            open(os.path.join(d, f"{name}.xdmf"), "w").write(text)
        data = open(h5, "rb").read()
        open(os.path.join(d, "trunc.h5"), "wb").write(data[:len(data) // 2])
        shutil.copy(h5, os.path.join(d, "nogeo.h5"))
        with h5py.File(os.path.join(d, "nogeo.h5"), "r+") as f:
            del f["/Mesh/geometry"]
        open(os.path.join(d, "broken.xdmf"), "w").write(open(good).read()[:200])
    COMM.Barrier()
    with pytest.raises(ValueError, match="trunc.h5"):
        read_mesh(os.path.join(d, "trunc.xdmf"), comm=COMM)
    with pytest.raises(ValueError, match="nogeo.h5.*no dataset '/Mesh/geometry'"):
        read_mesh(os.path.join(d, "nogeo.xdmf"), comm=COMM)
    with pytest.raises(ValueError, match="broken.xdmf.*truncated"):
        read_mesh(os.path.join(d, "broken.xdmf"), comm=COMM)
    with pytest.raises(FileNotFoundError, match="missing.xdmf"):
        read_mesh(os.path.join(d, "missing.xdmf"), comm=COMM)
    with pytest.raises(ValueError, match="no layout saved"):
        read_mesh(good, comm=COMM, partition="saved")
    if COMM.size > 1:   # a different file on some rank
        other = converted(d, 3)
        mine = good if COMM.rank == 0 else other
        with pytest.raises(ValueError, match=f"{os.path.basename(mine)}.*different file on some rank"):
            read_mesh(mine, comm=COMM)


def test_bad_meshes_raise_on_every_rank(shared_dir):
    """Unsupported elements and facet tags naming facets that no cell has."""
    d = shared_dir
    if COMM.rank == 0:
        pts = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [1, 1, 0], [.5, 0, 0], [.5, .5, 0], [0, .5, 0]], float)
        t6 = meshio.Mesh(pts, [("triangle6", np.array([[0, 1, 2, 4, 5, 6]]))])
        meshio.write(os.path.join(d, "p2.msh"), t6, file_format="gmsh22", binary=False)
        box = box_mesh((4, 4), cell="triangle", comm=MPI.COMM_SELF)     # 32 triangles
        xyz = np.c_[box.node_coords.numpy(), np.zeros(box.n_global_nodes)]
        edges = np.array([[0, 1], [0, box.n_global_nodes - 1]])            # a real edge, then no edge
        tags = [np.array([5, 6]), np.ones(box.n_global_cells, dtype=int)]
        bad = meshio.Mesh(xyz, [("line", edges), ("triangle", box.cells.numpy())],
                          cell_data={"gmsh:physical": tags, "gmsh:geometrical": tags})
        meshio.write(os.path.join(d, "ghost_facet.msh"), bad, file_format="gmsh22", binary=False)
    COMM.Barrier()
    with pytest.raises(ValueError, match=r"p2\.msh.*triangle6"):
        convert_mesh(os.path.join(d, "p2.msh"), os.path.join(d, "p2.xdmf"), comm=COMM)
    assert not os.path.exists(os.path.join(d, "p2.xdmf"))
    out = convert_mesh(os.path.join(d, "ghost_facet.msh"), os.path.join(d, "ghost_facet.xdmf"), comm=COMM)
    with pytest.raises(ValueError, match=r"ghost_facet\.xdmf.*facets that no cell has"):
        read_mesh(out, comm=COMM)


def test_failed_write_leaves_previous_files(shared_dir, monkeypatch):
    """A write that fails after the data (here: the index on rank 0) raises on every rank and
    leaves the previous file set byte for byte, with no temporaries."""
    from slasolve.fem import xdmf as xdmf_mod

    d = os.path.join(shared_dir, "atomic")
    if COMM.rank == 0:
        os.makedirs(d)
    COMM.Barrier()
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    u = mesh.owned_node_coords()[:, 0]
    target = os.path.join(d, "out.xdmf")
    write_xdmf(target, mesh, point_data={"u": u})
    COMM.Barrier()
    before = {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))}
    if COMM.rank == 0:
        def full_disk(*args, **kwargs):
            raise OSError(28, "No space left on device (simulated)")
        monkeypatch.setattr(xdmf_mod, "_xdmf_text", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_xdmf(target, mesh, point_data={"u": u + 1})
    COMM.Barrier()
    assert {n: open(os.path.join(d, n), "rb").read() for n in sorted(os.listdir(d))} == before
    with pytest.raises(ValueError, match="point_data"):
        write_xdmf(target, mesh, point_data={"u": torch.zeros(1000 + COMM.rank)})


# --------------------------------------------------------------------------- the example
def test_example_fem_solve_on_a_gmsh_mesh(shared_dir, capsys):
    """examples/fem_solve.py --mesh on the gmsh bracket (a .msh converted once, then the
    XDMF): clamped and loaded faces from the physical groups; the displacement written as
    XDMF and read back on this run's ranks equals the solution the example printed."""
    from example_loader import load_example
    ex = load_example("fem_solve")
    msh = os.path.join(shared_dir, "bracket3d.msh")
    if COMM.rank == 0:
        shutil.copy(FIXTURES[3], msh)
    COMM.Barrier()
    out = os.path.join(shared_dir, "u.xdmf")
    assert ex.main(["--mesh", msh, "--problem", "elasticity", "--output", out], comm=COMM) == 0
    printed = capsys.readouterr().out
    if COMM.rank == 0:
        assert "764 tetra cells, 843 dofs" in printed and "loaded facets (tag 2)" in printed
    mesh = read_mesh(out, comm=COMM)
    u = read_point_data(out, mesh, "u")
    assert u.shape == (mesh.n_owned, 3)
    umax = COMM.allreduce(float(u.abs().max()), op=MPI.MAX)
    if COMM.rank == 0:
        assert f"max |u| {umax:.6e}" in printed


def test_meshio_xdmf_files(shared_dir):
    """meshio's XDMF: one block (read in parallel, gmsh:physical as cell tags); several blocks
    (a Mixed topology: read with meshio on rank 0, as before)."""
    box = box_mesh((4, 2 * COMM.size), cell="triangle", comm=MPI.COMM_SELF)
    x = box.node_coords.numpy()
    tags = np.arange(box.n_global_cells) % 3
    one, mixed = os.path.join(shared_dir, "one.xdmf"), os.path.join(shared_dir, "mixed.xdmf")
    if COMM.rank == 0:
        meshio.write(one, meshio.Mesh(x, [("triangle", box.cells.numpy())], cell_data={"gmsh:physical": [tags]}))
        meshio.write(mixed, meshio.Mesh(x, [("line", np.array([[0, 1]])), ("triangle", box.cells.numpy())]))
    COMM.Barrier()
    mesh = read_mesh(one, comm=COMM)
    check_layout(mesh)
    assert np.array_equal(mesh.cell_tags.numpy(), tags[mesh.original_cell_ids.numpy()])
    mesh = read_mesh(mixed, comm=COMM)
    assert mesh.n_global_cells == box.n_global_cells and mesh.original_cell_ids is None

