"""Distributed meshes. Run serially and under mpirun -n 2 / 4 with --with-mpi."""
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

from slasolve.fem import (Mesh, boundary_nodes, box_mesh, element_volume, read_mesh, stiffness,
                          write_mesh)

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
CASES = [("triangle", (5, 7), (-1.0, 0.0), (2.0, 0.5)),
         ("quad", (3, 9), None, None),
         ("tetra", (2, 3, 4), (0.0, 0.0, -1.0), (1.0, 2.0, 3.0)),
         ("hexahedron", (3, 2, 5), None, (2.0, 1.0, 1.0))]


def canonical(cells):
    """Orientation-free key of every cell: its sorted vertex ids, as a set of tuples."""
    return {tuple(c) for c in np.sort(np.asarray(cells), axis=1).tolist()}


def check_layout(mesh: Mesh):
    comm = mesh.comm
    ranges = comm.allgather(mesh.owned_range)
    assert ranges[0][0] == 0 and ranges[-1][1] == mesh.n_global_nodes
    assert all(ranges[r][1] == ranges[r + 1][0] for r in range(len(ranges) - 1))
    assert all(s <= e for s, e in ranges)
    ids = mesh.node_ids
    assert ids.dtype == torch.int64 and mesh.cells.dtype == torch.int64
    assert bool((ids[1:] > ids[:-1]).all())  # sorted, unique
    assert mesh.node_coords.shape == (ids.shape[0], mesh.dim)
    # node_ids = owned  U  touched; ghosts = touched - owned
    s, e = mesh.owned_range
    touched = torch.unique(mesh.cells)
    expected = torch.unique(torch.cat([torch.arange(s, e), touched]))
    assert torch.equal(ids, expected)
    ghosts = mesh.ghost_node_ids()
    assert torch.equal(ghosts, touched[(touched < s) | (touched >= e)])
    assert mesh.owned_node_coords().shape == (e - s, mesh.dim)
    # every global cell exactly once: counts and an order-free checksum
    n_cells = comm.allreduce(mesh.n_local_cells)
    assert n_cells == mesh.n_global_cells
    key = np.sort(mesh.cells.numpy(), axis=1).astype(np.float64)
    w = np.arange(1, key.shape[1] + 1) * 1.000123
    checks = np.array([np.sum(key @ w), np.sum((key @ w) ** 2)])
    total = np.zeros(2)
    comm.Allreduce(checks, total, op=MPI.SUM)
    all_cells = comm.allgather(mesh.cells.numpy())
    cat = np.concatenate(all_cells)
    assert len(canonical(cat)) == cat.shape[0] == mesh.n_global_cells
    return total, cat


@pytest.mark.parametrize("cell,n,lower,upper", CASES)
def test_box_mesh_layout(cell, n, lower, upper):
    mesh = box_mesh(n, lower, upper, cell=cell, comm=COMM)
    total, cat = check_layout(mesh)
    serial = box_mesh(n, lower, upper, cell=cell, comm=MPI.COMM_SELF)
    assert serial.n_global_cells == mesh.n_global_cells and serial.n_global_nodes == mesh.n_global_nodes
    assert canonical(cat) == canonical(serial.cells.numpy())
    key = np.sort(serial.cells.numpy(), axis=1).astype(np.float64)
    w = np.arange(1, key.shape[1] + 1) * 1.000123
    np.testing.assert_allclose(total, [np.sum(key @ w), np.sum((key @ w) ** 2)], rtol=1e-12)
    # coordinates of every local node (owned or ghost) agree with the serial mesh
    np.testing.assert_array_equal(mesh.node_coords.numpy(), serial.node_coords.numpy()[mesh.node_ids.numpy()])
    # total volume and positive orientation (element_volume raises otherwise)
    vol = element_volume(mesh.local_cell_coords(), cell)
    assert bool((vol > 0).all())
    lo = np.zeros(mesh.dim) if lower is None else np.array(lower)
    hi = np.ones(mesh.dim) if upper is None else np.array(upper)
    assert COMM.allreduce(float(vol.sum())) == pytest.approx(np.prod(hi - lo), rel=1e-12)
    stiffness(mesh.local_cell_coords(), 1.0, cell)  # no inverted cells


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
def test_box_mesh_conforming(cell):
    """Every interior facet is shared by exactly two cells (conforming triangulation)."""
    mesh = box_mesh(3, cell=cell, comm=MPI.COMM_SELF)
    cells = mesh.cells.numpy()
    k = mesh.dim
    import itertools
    facets = np.concatenate([cells[:, list(f)] for f in itertools.combinations(range(k + 1), k)])
    _, counts = np.unique(np.sort(facets, 1), axis=0, return_counts=True)
    assert counts.max() == 2
    n_boundary_facets = 2 * k * 3 ** (k - 1) * (2 if k == 3 else 1)
    assert np.sum(counts == 1) == n_boundary_facets


def test_box_mesh_slab_is_local():
    """Each rank holds only its slab: no global-size arrays."""
    n = (4, 4, 4 * COMM.size)
    mesh = box_mesh(n, cell="hexahedron", comm=COMM)
    layer = 5 * 5
    assert mesh.node_ids.shape[0] == 5 * layer  # 4 own cell layers + 1 node layer
    assert mesh.n_local_cells == 4 * 16
    s, e = mesh.owned_range
    assert e - s == (4 + (COMM.rank == COMM.size - 1)) * layer


def test_box_mesh_balanced_split():
    n_last = 2 * COMM.size + 1  # not divisible (except size 1): first ranks get one more layer
    mesh = box_mesh((2, n_last), cell="quad", comm=COMM)
    layers = COMM.allgather(mesh.n_local_cells // 2)
    expected = [n_last // COMM.size + (r < n_last % COMM.size) for r in range(COMM.size)]
    assert layers == expected


def test_box_mesh_too_few_layers():
    if COMM.size == 1:
        with pytest.raises(ValueError, match="n"):
            box_mesh((3, 0), cell="quad", comm=COMM)
        return
    with pytest.raises(ValueError, match="cannot be split"):
        box_mesh((5, COMM.size - 1), cell="quad", comm=COMM)


def test_box_mesh_bad_args():
    with pytest.raises(ValueError, match="cell"):
        box_mesh(4, cell="prism", comm=COMM)
    with pytest.raises(ValueError, match="lower"):
        box_mesh(4, lower=(1, 1), upper=(0, 0), cell="quad", comm=COMM)
    with pytest.raises(ValueError, match="n must have 3"):
        box_mesh((4, 4), cell="tetra", comm=COMM)


def test_boundary_nodes():
    n = (4, 2 * COMM.size + 2)
    mesh = box_mesh(n, cell="triangle", comm=COMM)
    b = boundary_nodes(mesh)
    s, e = mesh.owned_range
    assert bool(((b >= s) & (b < e)).all())
    allb = np.concatenate(COMM.allgather(b.numpy()))
    serial = box_mesh(n, cell="triangle", comm=MPI.COMM_SELF)
    x = serial.node_coords.numpy()
    on = np.isclose(x, 0).any(1) | np.isclose(x, 1).any(1)
    np.testing.assert_array_equal(np.sort(allb), np.nonzero(on)[0])
    left = boundary_nodes(mesh, where=lambda c: c[:, 0] < 1e-12)
    assert COMM.allreduce(int(left.shape[0])) == n[1] + 1


def write_test_mesh(path):
    """A small 2-D meshio mesh in 3-D points, shuffled, with an unused point and
    some clockwise triangles (read_mesh must fix all of that)."""
    import meshio

    serial = box_mesh((4, 5), upper=(2.0, 1.0), cell="triangle", comm=MPI.COMM_SELF)
    rng = np.random.default_rng(0)
    n = serial.n_global_nodes
    order = rng.permutation(n)  # file index -> serial id
    where = np.empty(n, dtype=np.int64)
    where[order] = np.arange(n)
    pts = np.zeros((n + 1, 3))
    pts[:n, :2] = serial.node_coords.numpy()[order]
    pts[n] = [9.0, 9.0, 0.0]  # unused point
    cells = where[serial.cells.numpy()]
    cells[::3] = cells[::3][:, [0, 2, 1]]  # clockwise
    meshio.write(path, meshio.Mesh(pts, [("line", cells[:4, :2]), ("triangle", cells)]))
    return pts, cells


@pytest.mark.parametrize("method", ["metis", "block", "rcb"])
def test_read_mesh_round_trip(shared_dir, method):
    d = shared_dir
    path = os.path.join(d, f"square_{method}.vtu")
    data = write_test_mesh(path) if COMM.rank == 0 else None
    pts, cells = COMM.bcast(data, root=0)
    COMM.Barrier()
    mesh = read_mesh(path, comm=COMM, partition=method)
    assert mesh.cell_type == "triangle" and mesh.dim == 2
    assert mesh.n_global_nodes == pts.shape[0] - 1 and mesh.n_global_cells == cells.shape[0]
    check_layout(mesh)
    # coordinates and cells match the file (through original_ids)
    np.testing.assert_array_equal(mesh.node_coords.numpy(), pts[mesh.original_ids.numpy(), :2])
    orig = mesh.original_ids.numpy()[mesh.local_cells().numpy()]
    all_orig = np.concatenate(COMM.allgather(orig))
    assert canonical(all_orig) == canonical(cells)
    vol = element_volume(mesh.local_cell_coords())  # raises if any cell is still clockwise
    assert COMM.allreduce(float(vol.sum())) == pytest.approx(2.0, rel=1e-12)
    b = boundary_nodes(mesh)
    bx = pts[np.concatenate(COMM.allgather(mesh.original_ids.numpy()[np.searchsorted(mesh.node_ids.numpy(),
                                                                                    b.numpy())]))]
    on = np.isclose(bx[:, 0], 0) | np.isclose(bx[:, 0], 2) | np.isclose(bx[:, 1], 0) | np.isclose(bx[:, 1], 1)
    assert on.all() and len(bx) == 2 * (4 + 5)


def test_read_mesh_missing_file(shared_dir):
    d = shared_dir
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_mesh(os.path.join(d, "does_not_exist.vtu"), comm=COMM)


def test_read_mesh_malformed_file(shared_dir):
    d = shared_dir
    path = os.path.join(d, "garbage.vtu")
    if COMM.rank == 0:
        with open(path, "w") as fh:
            fh.write("this is not a mesh <VTKFile")
    COMM.Barrier()
    with pytest.raises(ValueError, match="cannot read"):
        read_mesh(path, comm=COMM)


def test_write_mesh_pieces_and_gather(shared_dir):
    import meshio

    d = shared_dir
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    u = mesh.owned_node_coords()[:, 0] * 2 + 1  # owned-size point data
    kappa = torch.full((mesh.n_local_cells,), float(COMM.rank))
    index = write_mesh(os.path.join(d, "out.pvtu"), mesh, point_data={"u": u}, cell_data={"kappa": kappa})
    assert index.endswith("out.pvtu") and os.path.exists(index)
    piece = meshio.read(os.path.join(d, f"out_{COMM.rank:04d}.vtu"))
    np.testing.assert_array_equal(piece.point_data["global_id"], mesh.node_ids.numpy())
    np.testing.assert_allclose(piece.point_data["u"], mesh.node_coords[:, 0].numpy() * 2 + 1)  # ghosts too
    np.testing.assert_array_equal(piece.cells_dict["quad"], mesh.local_cells().numpy())
    if COMM.rank == 0:
        text = open(index).read()
        assert text.count("<Piece ") == COMM.size and 'Name="u"' in text and 'Name="kappa"' in text
    out = write_mesh(os.path.join(d, "all.vtu"), mesh, point_data={"u": u}, gather=True)
    if COMM.rank == 0:
        m = meshio.read(out)
        assert m.points.shape[0] == mesh.n_global_nodes
        assert m.cells_dict["quad"].shape[0] == mesh.n_global_cells
        np.testing.assert_allclose(m.point_data["u"], m.points[:, 0] * 2 + 1)
    with pytest.raises(ValueError, match="point_data"):
        write_mesh(os.path.join(d, "bad.pvtu"), mesh, point_data={"u": torch.zeros(1000)})


def _snapshot(d):
    """{name: bytes} of every file in d (hidden temporaries included)."""
    out = {}
    for name in sorted(os.listdir(d)):
        p = os.path.join(d, name)
        out[name] = open(p, "rb").read() if os.path.isfile(p) else None
    return out


@pytest.mark.parametrize("gather", [False, True])
def test_write_mesh_failure_on_one_rank_changes_nothing(shared_dir, monkeypatch, gather):
    """A write that fails on one rank (the last; rank 0 for gather=True, which writes
    alone) raises on every rank and leaves the previous files byte for byte, with no
    temporaries behind."""
    import meshio

    d = os.path.join(shared_dir, f"atomic_{int(gather)}")
    if COMM.rank == 0:
        os.makedirs(d)
    COMM.Barrier()
    mesh = box_mesh((3, 2 * COMM.size), cell="quad", comm=COMM)
    u = mesh.owned_node_coords()[:, 0]
    target = os.path.join(d, "out.vtu" if gather else "out.pvtu")
    write_mesh(target, mesh, point_data={"u": u}, gather=gather)
    COMM.Barrier()
    before = _snapshot(d)
    assert len(before) == (1 if gather else COMM.size + 1)
    bad = 0 if gather else COMM.size - 1
    if COMM.rank == bad:
        def full_disk(filename, *args, **kwargs):   # writes part of the file, then fails
            with open(filename, "wb") as fh:
                fh.write(b"<VTKFile partial")
            raise OSError(28, "No space left on device (simulated)")
        monkeypatch.setattr(meshio, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        write_mesh(target, mesh, point_data={"u": u + 1}, gather=gather)
    COMM.Barrier()
    assert _snapshot(d) == before
    monkeypatch.undo()
    write_mesh(target, mesh, point_data={"u": u + 1}, gather=gather)   # and the next write works
    COMM.Barrier()
    assert _snapshot(d).keys() == before.keys()


@pytest.mark.parametrize("name, content", [
    ("garbage.vtu", b"this is not a mesh <VTKFile"),
    ("garbage.msh", b"$MeshFormat\n2.2 0 8\n$EndMeshFormat\n$Nodes\n25\n1 0 0"),
    ("empty.vtu", b""),
    ("truncated.vtu", None),
    ("truncated.vtk", None),
])
def test_read_mesh_bad_file_names_file_and_problem(shared_dir, name, content):
    """Garbage, empty and truncated files: a ValueError naming the file and saying what is
    wrong, on every rank (meshio itself prints and raises SystemExit)."""
    import meshio

    path = os.path.join(shared_dir, name)
    if COMM.rank == 0:
        if content is None:
            serial = box_mesh((4, 5), cell="triangle", comm=MPI.COMM_SELF)
            pts = np.zeros((serial.n_global_nodes, 3))
            pts[:, :2] = serial.node_coords.numpy()
            meshio.write(path, meshio.Mesh(pts, [("triangle", serial.cells.numpy())]))
            data = open(path, "rb").read()
            with open(path, "wb") as fh:
                fh.write(data[:len(data) // 2])
        else:
            with open(path, "wb") as fh:
                fh.write(content)
    COMM.Barrier()
    with pytest.raises(ValueError) as info:
        read_mesh(path, comm=COMM)
    msg = str(info.value)
    assert name in msg and "SystemExit" not in msg
    assert ("the file is empty" if content == b"" else "not a valid mesh file, or truncated") in msg
