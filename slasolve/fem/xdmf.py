"""XDMF + HDF5 mesh and field I/O in parallel: every rank reads and writes only its share.

File layout (what :func:`write_xdmf` writes; ParaView and DOLFINx open it):

* ``<stem>.h5``: ``/Mesh/topology`` ``(n_cells, nv)`` int64 node ids, ``/Mesh/geometry``
  ``(n_nodes, dim)`` float64, ``/Mesh/cell_tags`` ``(n_cells,)`` int32 (when the mesh has
  cell tags), ``/Mesh/facet_topology`` + ``/Mesh/facet_values`` (facet tags),
  ``/PointData/<name>`` and ``/CellData/<name>`` (fields without a time),
  ``/Function/<name>/<k>`` (the ``k``-th time step of a time series),
  ``/Matrix/<name>/{row,col,value}`` (assembled matrices: triplets in the file's node
  numbering, see :func:`read_matrix`), and
  ``/Partition/cell_offsets``, ``/Partition/node_offsets`` (the writer's layout, so that a
  reload on as many ranks rebuilds the same partition and numbering);
* ``<stem>.xdmf``: the XDMF 3 index: a ``Uniform`` grid ``mesh`` (``Topology``,
  ``Geometry``, ``Attribute``\\ s), a grid ``facet_tags`` (its own ``Topology``, the mesh's
  ``Geometry`` by ``xi:include``) and a ``Temporal`` collection ``time_series`` whose grids
  include the mesh's ``Topology`` and ``Geometry`` and carry one ``Time`` each.

Rank ``r`` writes the rows of its owned nodes (``owned_range``: the file's node ids are
the mesh's global ids) and of its cells (rank after rank), so the write needs no
communication but offsets. With h5py built with MPI (Debian's ``python3-h5py-mpi``)
under more than one rank, rank 0 creates the datasets (allocated), then every rank writes
its rows through MPI-IO (independent writes: a rank failing there leaves no one waiting in
a collective HDF5 call); with a
serial h5py (pip's wheel) the ranks write their rows in turn (same file, one rank at a
time; no rank holds more than its share). Without h5py, every function raises
``ImportError`` on every rank.

Reading (:func:`read_xdmf_mesh`, used by :func:`slasolve.fem.read_mesh` for ``.xdmf``)
opens the HDF5 file read-only on every rank with plain h5py and reads one contiguous
slice of cells and of points per rank, then partitions and redistributes in parallel
(:mod:`slasolve.fem.distribute`).
"""
from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple, Union

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective, get_comm, settings_digest
from .._hashing import mix64
from .cells import CELL_DIM, CELL_FACETS, CELL_VERTICES
from .mesh import Mesh, _balanced_split, _np, _meshio_arrays, _mixed_cell_options, register_mesh_reader

if TYPE_CHECKING:
    from ..dsparse import DSparseTensor

__all__ = ["write_xdmf", "read_xdmf_mesh", "read_point_data", "read_cell_data", "read_matrix", "xdmf_steps",
           "convert_mesh"]

_XDMF_CELL = {"triangle": "Triangle", "quad": "Quadrilateral", "tetra": "Tetrahedron", "hexahedron": "Hexahedron"}
_XDMF_FACET = {"triangle": "PolyLine", "quad": "PolyLine", "tetra": "Triangle", "hexahedron": "Quadrilateral"}
_FROM_XDMF = {"triangle": "triangle", "quadrilateral": "quad", "tetrahedron": "tetra", "hexahedron": "hexahedron"}
_FACET_XDMF = {"polyline": 2, "triangle": 3, "quadrilateral": 4}
_REGISTRY = "slasolve_xdmf"
_XI = "http://www.w3.org/2001/XInclude"


def _h5py():
    try:
        import h5py
    except ImportError as e:
        raise ImportError("XDMF/HDF5 mesh I/O needs h5py: Debian's python3-h5py-mpi (parallel writes "
                          f"through MPI-IO) or `pip install h5py` (serial HDF5: ranks write in turn) ({e})") from None
    return h5py


def _h5_path(path: str) -> str:
    stem = path[:-len(".xdmf")] if path.endswith(".xdmf") else os.path.splitext(path)[0]
    return stem + ".h5"


# --------------------------------------------------------------------------- writing
class _Plan:
    """The datasets one collective write creates: every rank lists the same names, global
    shapes and dtypes, each with its own rows ``[start, start + len(data))``."""

    def __init__(self):
        self.items: List[Tuple[str, tuple, np.dtype, int, np.ndarray]] = []

    def add(self, name: str, global_shape, data: np.ndarray, start: int):
        data = np.ascontiguousarray(data)
        self.items.append((name, tuple(int(s) for s in global_shape), data.dtype, int(start), data))

    def signature(self):
        return [(n, s, str(d)) for n, s, d, _, _ in self.items]


def _execute(comm: MPI.Comm, h5file: str, mode: str, plan: _Plan, attrs: Dict[str, str],
             target: Optional[str] = None) -> None:
    """Collective. Create the plan's datasets in ``h5file`` (replacing ones of the same name)
    and write every rank's rows; raise ``OSError`` naming ``target`` (default ``h5file``: the
    file the user asked for, when ``h5file`` is a temporary) on every rank on any failure."""
    h5py = _h5py()
    label = f"{target or h5file!r}" + ("" if target in (None, h5file) else f" (through {h5file!r})")
    size, rank = comm.Get_size(), comm.Get_rank()

    def create(f, early=False):
        for name, shape, dtype, _, _ in plan.items:
            if name in f:
                del f[name]
            if early:
                dcpl = h5py.h5p.create(h5py.h5p.DATASET_CREATE)
                dcpl.set_alloc_time(h5py.h5d.ALLOC_TIME_EARLY)
                dcpl.set_fill_time(h5py.h5d.FILL_TIME_NEVER)
                f.create_dataset(name, shape=shape, dtype=dtype, dcpl=dcpl)
            else:
                f.create_dataset(name, shape=shape, dtype=dtype)

    def fill(f):
        for name, _, _, start, data in plan.items:
            if data.shape[0]:
                f[name][start:start + data.shape[0]] = data

    def finish():
        # the attributes (write_xdmf's registry) last: a write failing before leaves the
        # file's registry naming only complete datasets
        err = None
        if rank == 0:
            try:
                with h5py.File(h5file, "r+") as f:
                    for k, v in attrs.items():
                        f.attrs[k] = v
            except Exception as e:  # noqa: BLE001
                err = OSError(f"cannot write {label}: {type(e).__name__}: {e}")
        check_collective(comm, err)

    err = None
    if size > 1 and _mpi_hdf5(h5py):
        # Rank 0 creates every dataset (allocated, so nothing changes the file's metadata
        # afterwards), then all ranks open the file through MPI-IO and write raw rows only.
        # HDF5 metadata operations are collective: a rank leaving them midway (an error in
        # one create_dataset) would leave the others waiting in the closing H5Fclose.
        if rank == 0:
            try:
                with h5py.File(h5file, mode) as f:
                    create(f, early=True)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = OSError(f"cannot write {label}: {type(e).__name__}: {e}")
        check_collective(comm, err)
        try:
            with h5py.File(h5file, "r+", driver="mpio", comm=comm) as f:
                try:
                    fill(f)     # independent writes: a rank failing here leaves no one waiting
                except Exception as e:  # noqa: BLE001
                    err = OSError(f"cannot write {label}: {type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001
            err = err or OSError(f"cannot write {label}: {type(e).__name__}: {e}")
        check_collective(comm, err)
        finish()
        return
    # serial HDF5: rank 0 creates the datasets, then the ranks write their rows in turn
    if rank == 0:
        try:
            with h5py.File(h5file, mode) as f:
                create(f)
                if size == 1:
                    fill(f)
                    for k, v in attrs.items():
                        f.attrs[k] = v
        except Exception as e:  # noqa: BLE001
            err = OSError(f"cannot write {label}: {type(e).__name__}: {e}")
    check_collective(comm, err)
    if size == 1:
        return
    for r in range(size):
        if r == rank and err is None:
            try:
                with h5py.File(h5file, "r+") as f:
                    fill(f)
            except Exception as e:  # noqa: BLE001
                err = OSError(f"cannot write {label}: {type(e).__name__}: {e}")
        comm.Barrier()
    check_collective(comm, err)
    finish()


def _mpi_hdf5(h5py) -> bool:
    """Local. Whether h5py can write one file collectively (built with MPI)."""
    return bool(h5py.get_config().mpi)


def _data_item(h5name: str, dset: str, shape, dtype) -> str:
    kind = "Int" if np.issubdtype(np.dtype(dtype), np.integer) else "Float"
    dims = " ".join(str(int(s)) for s in shape)
    return (f'<DataItem Dimensions="{dims}" NumberType="{kind}" Precision="{np.dtype(dtype).itemsize}" '
            f'Format="HDF">{h5name}:{dset}</DataItem>')


def _attribute(name: str, center: str, h5name: str, dset: str, shape, dtype) -> str:
    from xml.sax.saxutils import quoteattr

    ncomp = int(np.prod(shape[1:])) if len(shape) > 1 else 1
    kind = {1: "Scalar", 2: "Vector", 3: "Vector", 9: "Tensor"}.get(ncomp, "Matrix")
    return (f'<Attribute Name={quoteattr(name)} AttributeType="{kind}" Center="{center}">'
            f'{_data_item(h5name, dset, shape, dtype)}</Attribute>')


def _xdmf_text(reg: dict, h5name: str) -> str:
    """Local. The XDMF index for the registry ``reg`` kept in the HDF5 file."""
    from xml.sax.saxutils import escape, quoteattr

    h5 = escape(h5name)
    ct, nc, nn, dim = reg["cell_type"], reg["n_cells"], reg["n_nodes"], reg["dim"]
    nv = CELL_VERTICES[ct]
    topo = (f'<Topology TopologyType="{_XDMF_CELL[ct]}" NumberOfElements="{nc}" NodesPerElement="{nv}">'
            f'{_data_item(h5, "/Mesh/topology", (nc, nv), np.int64)}</Topology>')
    geom = (f'<Geometry GeometryType="{"XY" if dim == 2 else "XYZ"}">'
            f'{_data_item(h5, "/Mesh/geometry", (nn, dim), np.float64)}</Geometry>')
    out = ['<?xml version="1.0"?>', '<!DOCTYPE Xdmf SYSTEM "Xdmf.dtd" []>',
           f'<Xdmf Version="3.0" xmlns:xi="{_XI}">', "  <Domain>", '    <Grid Name="mesh" GridType="Uniform">',
           "      " + topo, "      " + geom]
    if reg.get("cell_tags"):
        out.append("      " + _attribute("cell_tags", "Cell", h5, "/Mesh/cell_tags", (nc,), np.int32))
    for center, group, key in (("Node", "/PointData", "point_data"), ("Cell", "/CellData", "cell_data")):
        n = nn if center == "Node" else nc
        for name, (tail, dt) in sorted(reg.get(key, {}).items()):
            out.append("      " + _attribute(name, center, h5, f"{group}/{name}", (n, *tail), dt))
    out.append("    </Grid>")
    k = reg.get("n_facet_tags")
    if k is not None:
        ft = _XDMF_FACET[ct]
        nfv = len(CELL_FACETS[ct][0])
        out += ['    <Grid Name="facet_tags" GridType="Uniform">',
                "      <xi:include xpointer=\"xpointer(/Xdmf/Domain/Grid[@Name='mesh']/Geometry)\"/>",
                f'      <Topology TopologyType="{ft}" NumberOfElements="{k}" NodesPerElement="{nfv}">'
                f'{_data_item(h5, "/Mesh/facet_topology", (k, nfv), np.int64)}</Topology>',
                "      " + _attribute("facet_tags", "Cell", h5, "/Mesh/facet_values", (k,), np.int32),
                "    </Grid>"]
    steps = reg.get("steps", [])
    if steps:
        out.append('    <Grid Name="time_series" GridType="Collection" CollectionType="Temporal">')
        for i, st in enumerate(steps):
            out += [f'      <Grid Name="step_{i}" GridType="Uniform">',
                    "        <xi:include xpointer=\"xpointer(/Xdmf/Domain/Grid[@Name='mesh']/"
                    "*[self::Topology or self::Geometry])\"/>",
                    f'        <Time Value={quoteattr(repr(float(st["time"])))}/>']
            for center, key in (("Node", "point"), ("Cell", "cell")):
                n = nn if center == "Node" else nc
                for name, (tail, dt) in sorted(st[key].items()):
                    out.append("        " + _attribute(name, center, h5, f"/Function/{name}/{i}", (n, *tail), dt))
            out.append("      </Grid>")
        out.append("    </Grid>")
    out += ["  </Domain>", "</Xdmf>", ""]
    return "\n".join(out)


def _field_arrays(mesh: Mesh, data, kind: str) -> Dict[str, np.ndarray]:
    """Local. Owned rows of point data / the rows of cell data, validated."""
    out = {}
    n_loc, n_own, n_cells = mesh.node_ids.shape[0], mesh.n_owned, mesh.n_local_cells
    om = mesh.owned_mask().numpy()
    for name, v in (data or {}).items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"{kind} names must be non-empty strings without '/', got {name!r}")
        a = _np(v)
        if kind == "point_data":
            if a.ndim == 0 or a.shape[0] not in (n_loc, n_own):
                raise ValueError(f"point_data[{name!r}] must have first dimension {n_own} (owned nodes) or "
                                 f"{n_loc} (local nodes), got shape {a.shape}")
            if a.shape[0] == n_loc and n_loc != n_own:
                a = a[om]
        elif a.ndim == 0 or a.shape[0] != n_cells:
            raise ValueError(f"cell_data[{name!r}] must have first dimension {n_cells}, got shape {a.shape}")
        out[name] = np.ascontiguousarray(a)
    return out


def _numbering_digest(comm: Optional[MPI.Comm], cell_ids: np.ndarray, cells: np.ndarray) -> int:
    """Collective (local with ``comm=None``). An order-free 64-bit digest of the cells' file
    ids and vertex sets: equal for two numberings of one mesh only if they number its cells
    and nodes alike (min, max, sum and sum of squares of each cell's vertex ids, hashed with
    the cell id; the per-cell hashes summed modulo 2**64)."""
    u = np.uint64

    mix = mix64
    c = np.asarray(cells, np.int64).astype(u)
    h = mix(np.asarray(cell_ids, np.int64).astype(u) + u(0x9E3779B97F4A7C15))
    for col in (c.min(axis=1), c.max(axis=1), c.sum(axis=1), (c * c).sum(axis=1)):
        h = mix(h ^ col)
    local = int(h.sum(dtype=u)) if h.size else 0
    return sum(comm.allgather(local) if comm is not None else [local]) % 2 ** 64


def _file_numbering(mesh: Mesh, reg: dict, h5file: str, c0: int) -> str:
    """Collective. How ``mesh`` numbers the nodes and cells of the file set ``reg``:
    ``"global"`` (its global ids and its cells rank after rank: the mesh it was written
    from, or one read back on as many ranks) or ``"original"`` (``original_ids`` /
    ``original_cell_ids``: a mesh read from it on another layout). ``ValueError`` on every
    rank when neither is the file's numbering."""
    comm = mesh.comm
    cells = mesh.cells.numpy()
    has_orig = mesh.original_ids is not None and mesh.original_cell_ids is not None
    want = reg.get("digest")
    if want is None:     # a file set written before digests: only a mesh numbered as written
        same = (not has_orig) or (bool(np.array_equal(_np(mesh.original_ids), mesh.node_ids.numpy())) and bool(
            np.array_equal(_np(mesh.original_cell_ids), c0 + np.arange(cells.shape[0]))))
        if comm.allreduce(int(same), op=MPI.MIN) if comm.Get_size() > 1 else same:
            return "global"
    elif _numbering_digest(comm, c0 + np.arange(cells.shape[0], dtype=np.int64), cells) == want:
        return "global"
    elif comm.allreduce(int(has_orig), op=MPI.MIN) if comm.Get_size() > 1 else has_orig:
        local = _np(mesh.original_ids)[mesh.local_cells().numpy()]
        if _numbering_digest(comm, _np(mesh.original_cell_ids), local) == want:
            return "original"
    check_collective(comm, ValueError(
        f"append: {h5file!r} numbers its mesh differently from this mesh (append from the mesh it was written "
        f"from, or from one read from it with slasolve.fem.read_mesh)"))
    return ""


def _to_file_rows(comm: MPI.Comm, rows: np.ndarray, file_ids: np.ndarray, n: int) -> Tuple[np.ndarray, int]:
    """Collective. ``(rows in file order, start)``: this rank's slice of the balanced split of
    ``n`` file rows, from every rank's ``rows`` at ``file_ids`` (together a permutation)."""
    from .distribute import _Exchange

    split = _balanced_split(n, comm.Get_size()).astype(np.int64)
    dest = np.searchsorted(split, file_ids, side="right") - 1
    ids = _Exchange(comm, np.asarray(file_ids, np.int64), dest).recv
    vals = _Exchange(comm, np.ascontiguousarray(rows), dest).recv
    out = np.empty_like(vals)
    out[ids - split[comm.Get_rank()]] = vals
    return out, int(split[comm.Get_rank()])


def _plan_matrices(comm: MPI.Comm, plan: "_Plan", mdata: Dict[str, tuple], group, mesh: Mesh,
                   to_file: Optional[np.ndarray]) -> None:
    """Collective. Add the matrices' triplets to ``plan`` under ``group(name)``, rank after
    rank; with ``to_file`` (the file id of each owned node, in id order), their node ids
    mapped to the file's (a column may be a node that no local cell touches: its file id
    comes from its owner)."""
    from .distribute import fetch_rows

    rank = comm.Get_rank()
    n_off = np.concatenate([[0], np.cumsum(comm.allgather(mesh.n_owned))]).astype(np.int64)
    for name, (shape, (rows, cols, vals)) in sorted(mdata.items()):
        if to_file is not None:
            rows, cols = to_file[rows - n_off[rank]], fetch_rows(comm, n_off, to_file, cols)
        nz_off = np.concatenate([[0], np.cumsum(comm.allgather(rows.shape[0]))]).astype(np.int64)
        nnz, z0 = int(nz_off[-1]), int(nz_off[rank])
        plan.add(f"{group(name)}/row", (nnz,), rows, z0)
        plan.add(f"{group(name)}/col", (nnz,), cols, z0)
        plan.add(f"{group(name)}/value", (nnz, *vals.shape[1:]), vals, z0)


def write_xdmf(path: Union[str, os.PathLike], mesh: Mesh,
               point_data: Optional[Dict[str, Union[torch.Tensor, np.ndarray]]] = None,
               cell_data: Optional[Dict[str, Union[torch.Tensor, np.ndarray]]] = None,
               time: Optional[float] = None, append: bool = False,
               matrices: Optional[Dict[str, "DSparseTensor"]] = None) -> str:
    """Collective. Write the distributed mesh and fields as XDMF + HDF5, every rank its share.

    Parameters
    ----------
    path : the ``.xdmf`` index; the data go to the ``.h5`` file of the same stem.
    mesh : the distributed mesh.
    point_data : name -> values on the owned nodes (``(mesh.n_owned, ...)``) or on all
        local nodes (``(len(mesh.node_ids), ...)``; the owned rows are written).
    cell_data : name -> ``(mesh.n_local_cells, ...)`` values of the local cells.
    time : ``None`` writes the fields with the mesh (``/PointData``, ``/CellData``); a
        number adds them as the next step of the time series (``/Function/<name>/<k>``).
    append : ``False`` (default) writes a new file set (mesh, tags, layout and fields);
        ``True`` adds a time step (``time`` required) to a file set written by
        :func:`write_xdmf` for the same mesh: the mesh it was written from, or one read
        from it by :func:`slasolve.fem.read_mesh` on any number of ranks (the rows then go
        to the file's numbering through ``original_ids`` / ``original_cell_ids``; which
        numbering applies is told by a digest of the cells saved in the file).
    matrices : name -> a node-by-node :class:`~slasolve.DSparseTensor` assembled on
        ``mesh`` (``global_shape`` ``(n_nodes, n_nodes)`` or ``(n_nodes, n_nodes, bs, bs)``,
        owned block rows = ``mesh.owned_range``, e.g. from
        :meth:`slasolve.fem.Assembler.assemble_matrix`), saved as ``(row, col, value)``
        triplets in the file's node numbering (``/Matrix/<name>/{row,col,value}`` with a
        new file set, ``/Matrix/<name>/<k>/...`` with the ``k``-th time step when
        ``append``; every rank its owned rows); :func:`read_matrix` loads one on any
        number of ranks.

    Returns
    -------
    str
        The path of the ``.xdmf`` index (on every rank).

    Notes
    -----
    The file's node ids are the mesh's global ids, its cells the ranks' cells rank after
    rank; :func:`slasolve.fem.read_mesh` on as many ranks rebuilds the same mesh (same
    cells on the same ranks, same numbering); on another number of ranks it partitions
    anew, and :func:`read_point_data` / :func:`read_cell_data` map saved fields onto it.

    A new file set is written under temporary names next to the targets and renamed
    (the ``.h5`` first, then the index) only after every rank has written its part, so
    a failure raises on every rank and leaves existing files as they were. ``append``
    writes new datasets into the existing ``.h5`` and updates its registry and the index
    only after every rank has written its rows: a failure leaves both naming the previous
    steps only (the datasets of the failed step are replaced by the next append). Bad arguments, or arguments that
    differ between ranks, raise on every rank.
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    comm = mesh.comm
    size, rank = comm.Get_size(), comm.Get_rank()
    path = os.path.abspath(os.fspath(path))
    h5file = _h5_path(path)
    err, pdata, cdata, mdata = None, {}, {}, {}
    try:
        _h5py()
        if append and time is None:
            raise ValueError("append=True adds a time step: give its time")
        if time is not None and not np.isfinite(float(time)):
            raise ValueError(f"time must be finite, got {time!r}")
        pdata = _field_arrays(mesh, point_data, "point_data")
        cdata = _field_arrays(mesh, cell_data, "cell_data")
        mdata = _matrix_triplets(mesh, matrices)
    except (ValueError, TypeError, ImportError) as e:
        err = e
    tails = {"point": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in pdata.items()},
             "cell": {k: [list(v.shape[1:]), str(v.dtype)] for k, v in cdata.items()}}
    mtails = {k: [list(shape), str(t[2].dtype)] for k, (shape, t) in mdata.items()} if err is None else None
    check_collective(comm, err, agree={"path": path, "time": None if time is None else float(time),
                                       "append": bool(append), "fields": tails if err is None else None,
                                       "matrices": mtails})
    cell_off = np.concatenate([[0], np.cumsum(comm.allgather(mesh.n_local_cells))]).astype(np.int64)
    node_off = np.concatenate([[0], np.cumsum(comm.allgather(mesh.n_owned))]).astype(np.int64)
    nc, nn, c0, (s, e) = int(cell_off[-1]), mesh.n_global_nodes, int(cell_off[rank]), mesh.owned_range
    plan = _Plan()

    def add_fields(prefix_point, prefix_cell):
        for name, a in sorted(pdata.items()):
            plan.add(prefix_point(name), (nn, *a.shape[1:]), a, s)
        for name, a in sorted(cdata.items()):
            plan.add(prefix_cell(name), (nc, *a.shape[1:]), a, c0)

    if append:
        reg, err = None, None
        if rank == 0:
            try:
                with _h5py().File(h5file, "r") as f:
                    reg = json.loads(f.attrs[_REGISTRY])
                if (reg["n_cells"], reg["n_nodes"], reg["cell_type"]) != (nc, nn, mesh.cell_type):
                    raise ValueError(f"append: {h5file!r} holds another mesh ({reg['n_cells']} {reg['cell_type']} "
                                     f"cells, {reg['n_nodes']} nodes; this one {nc} {mesh.cell_type}, {nn})")
            except (OSError, KeyError) as e:
                err = ValueError(f"append: {h5file!r} is not a file set written by write_xdmf ({e})")
            except ValueError as e:
                err = e
        check_collective(comm, err)
        reg = comm.bcast(reg, root=0)
        k = len(reg["steps"])
        if _file_numbering(mesh, reg, h5file, c0) == "global":
            add_fields(lambda nm: f"/Function/{nm}/{k}", lambda nm: f"/Function/{nm}/{k}")
            to_file = None
        else:   # a mesh read from this file on another layout: rows go to the file's numbering
            own_ids = _np(mesh.original_ids)[mesh.owned_mask().numpy()]
            for name, a in sorted(pdata.items()):
                plan.add(f"/Function/{name}/{k}", (nn, *a.shape[1:]), *_to_file_rows(comm, a, own_ids, nn))
            for name, a in sorted(cdata.items()):
                plan.add(f"/Function/{name}/{k}", (nc, *a.shape[1:]),
                         *_to_file_rows(comm, a, _np(mesh.original_cell_ids), nc))
            to_file = own_ids
        step = {"time": float(time), "point": tails["point"], "cell": tails["cell"]}
        if mdata:
            _plan_matrices(comm, plan, mdata, lambda nm: f"/Matrix/{nm}/{k}", mesh, to_file)
            step["matrices"] = mtails
        reg["steps"].append(step)
        _execute(comm, h5file, "r+", plan, {_REGISTRY: json.dumps(reg)})
        _replace_index(comm, path, _xdmf_text(reg, os.path.basename(h5file)) if rank == 0 else None)
        return path

    om = mesh.owned_mask().numpy()
    plan.add("/Mesh/topology", (nc, CELL_VERTICES[mesh.cell_type]), mesh.cells.numpy().astype(np.int64), c0)
    plan.add("/Mesh/geometry", (nn, mesh.dim), mesh.node_coords.detach().cpu().numpy().astype(np.float64)[om], s)
    plan.add("/Partition/cell_offsets", (size + 1,), cell_off if rank == 0 else cell_off[:0], 0)
    plan.add("/Partition/node_offsets", (size + 1,), node_off if rank == 0 else node_off[:0], 0)
    has_ct = comm.allreduce(int(mesh.cell_tags is not None), op=MPI.MIN) if size > 1 else int(
        mesh.cell_tags is not None)
    if has_ct:
        plan.add("/Mesh/cell_tags", (nc,), mesh.cell_tags.numpy().astype(np.int32), c0)
    has_ft = comm.allreduce(int(mesh.facet_tags is not None), op=MPI.MIN) if size > 1 else int(
        mesh.facet_tags is not None)
    n_ft = None
    if has_ft:
        ft = mesh.facet_tags
        lf = np.asarray(CELL_FACETS[mesh.cell_type])[ft.local_facet.numpy()]          # (k, nfv) vertex positions
        verts = np.take_along_axis(mesh.cells.numpy()[ft.cells.numpy()], lf, axis=1)
        f_off = np.concatenate([[0], np.cumsum(comm.allgather(len(ft)))]).astype(np.int64)
        n_ft = int(f_off[-1])
        plan.add("/Mesh/facet_topology", (n_ft, verts.shape[1]), verts.astype(np.int64), int(f_off[rank]))
        plan.add("/Mesh/facet_values", (n_ft,), ft.values.numpy().astype(np.int32), int(f_off[rank]))
    reg = {"cell_type": mesh.cell_type, "dim": mesh.dim, "n_cells": nc, "n_nodes": nn, "cell_tags": bool(has_ct),
           "n_facet_tags": n_ft, "point_data": {}, "cell_data": {}, "steps": [], "matrices": mtails}
    reg["digest"] = _numbering_digest(comm, c0 + np.arange(mesh.n_local_cells, dtype=np.int64), mesh.cells.numpy())
    _plan_matrices(comm, plan, mdata, lambda nm: f"/Matrix/{nm}", mesh, None)
    if time is None:
        add_fields(lambda nm: f"/PointData/{nm}", lambda nm: f"/CellData/{nm}")
        reg["point_data"], reg["cell_data"] = tails["point"], tails["cell"]
    else:
        add_fields(lambda nm: f"/Function/{nm}/0", lambda nm: f"/Function/{nm}/0")
        reg["steps"].append({"time": float(time), "point": tails["point"], "cell": tails["cell"]})

    # a new file set: write into a temporary folder next to the targets, then rename
    import shutil
    import tempfile

    tmpdir, err = None, None
    if rank == 0:
        try:
            tmpdir = tempfile.mkdtemp(prefix=".slasolve-xdmf-", dir=os.path.dirname(path))
        except OSError as e:
            err = OSError(f"write_xdmf: cannot write next to {path!r}: {e}")
    check_collective(comm, err)
    tmpdir = comm.bcast(tmpdir, root=0)
    try:
        tmp_h5 = os.path.join(tmpdir, os.path.basename(h5file))
        _execute(comm, tmp_h5, "w", plan, {_REGISTRY: json.dumps(reg)}, target=h5file)
        err = None
        if rank == 0:
            try:
                with open(os.path.join(tmpdir, "index.xdmf"), "w") as fh:
                    fh.write(_xdmf_text(reg, os.path.basename(h5file)))
                os.replace(tmp_h5, h5file)
                os.replace(os.path.join(tmpdir, "index.xdmf"), path)
            except OSError as e:
                err = OSError(f"write_xdmf: cannot move {path!r} into place: {e}")
        check_collective(comm, err)
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(tmpdir, ignore_errors=True)
    return path


def _replace_index(comm: MPI.Comm, path: str, text: Optional[str]) -> None:
    """Collective. Rank 0 writes ``text`` to ``path`` through a temporary file and a rename."""
    err = None
    if comm.Get_rank() == 0:
        tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.tmp-{os.getpid()}")
        try:
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, path)
        except OSError as e:
            err = OSError(f"write_xdmf: cannot write {path!r}: {e}")
            if os.path.exists(tmp):
                os.remove(tmp)
    check_collective(comm, err)


# --------------------------------------------------------------------------- reading the index
class SerialOnlyXdmf(ValueError):
    """An XDMF file the parallel reader does not take (a ``Mixed`` topology, or data stored
    inline as XML, as meshio writes for several cell blocks); meshio reads it on rank 0."""


def parallel_readable(path) -> bool:
    """Local. False when ``path`` is an XDMF index of a kind only meshio reads (see
    :class:`SerialOnlyXdmf`); True otherwise (including unreadable files: the parallel
    reader reports those)."""
    try:
        _Index(os.fspath(path))
    except SerialOnlyXdmf:
        return False
    except (OSError, ValueError):
        return True
    return True


class _Index:
    """Local. What an XDMF index says: the mesh grid, facet-tag grid, attributes, steps."""

    def __init__(self, path: str):
        self.path = path
        self.folder = os.path.dirname(os.path.abspath(path))
        with open(path, "rb") as fh:
            self.raw = fh.read()
        try:
            root = ET.fromstring(self.raw)
        except ET.ParseError as e:
            raise ValueError(f"{path!r} is not an XDMF file (XML: {e}), or it is truncated") from None
        domain = root.find("Domain")
        if root.tag != "Xdmf" or domain is None:
            raise ValueError(f"{path!r} is not an XDMF file (no Xdmf/Domain)")
        grids = [g for g in domain.findall("Grid") if g.get("GridType", "Uniform") == "Uniform"]
        kinds = [((g.find("Topology").get("TopologyType") or g.find("Topology").get("Type") or "").lower()
                  if g.find("Topology") is not None else "") for g in grids]
        volume = [(g, _FROM_XDMF[k]) for g, k in zip(grids, kinds) if k in _FROM_XDMF]
        if not volume and "mixed" in kinds:
            raise SerialOnlyXdmf(f"{path!r}: a Mixed topology (several cell blocks)")
        if not volume:
            raise ValueError(f"{path!r}: no grid of a supported cell type (triangle, quadrilateral, tetrahedron, "
                             f"hexahedron); found topologies {sorted(set(kinds) - {''})}")
        tdim = max(CELL_DIM[ct] for _, ct in volume)
        top = [(g, ct) for g, ct in volume if CELL_DIM[ct] == tdim]
        if len({ct for _, ct in top}) > 1:
            raise ValueError(f"{path!r} mixes {tdim}-D cell types "
                             f"{sorted({(g.get('Name') or '?') + ': ' + ct for g, ct in top})}: a Mesh holds one "
                             f"cell type; write one file (or one grid) per type")
        # the mesh: the first top-dimensional grid with a Geometry of its own; grids of the same
        # cell type that include another's Geometry (DOLFINx's write_meshtags) carry cell tags
        own = [(g, ct) for g, ct in top if g.find("Geometry") is not None]
        self.mesh_grid, self.cell_type = own[0] if own else top[0]
        self.topology = self._item(self.mesh_grid.find("Topology"))
        geo = self.mesh_grid.find("Geometry")
        gtype = (geo.get("GeometryType") or geo.get("Type") or "XYZ") if geo is not None else None
        if geo is None or gtype not in ("XY", "XYZ"):
            raise ValueError(f"{path!r}: the mesh grid needs a Geometry of type XY or XYZ, got {gtype}")
        self.geometry = self._item(geo)
        self.facet_tags, self.cell_tag_grid = None, None
        nfv = len(CELL_FACETS[self.cell_type][0])
        for g, k in zip(grids, kinds):
            t = g.find("Topology")
            a = g.find("Attribute")
            if g is self.mesh_grid or t is None or a is None or (a.get("Center") or "Node") != "Cell":
                continue
            if _FACET_XDMF.get(k) == nfv and self.facet_tags is None:
                self.facet_tags = (self._item(t), self._item(a))
            elif _FROM_XDMF.get(k) == self.cell_type and g.find("Geometry") is None and self.cell_tag_grid is None:
                self.cell_tag_grid = (self._item(t), self._item(a))
        self.cell_tags = None
        for a in self.mesh_grid.findall("Attribute"):
            if a.get("Center") == "Cell" and a.get("Name") in ("cell_tags", "gmsh:physical", "cell_markers"):
                self.cell_tags = self._item(a)
                break

    def _item(self, element) -> Tuple[str, str]:
        """(h5 file, dataset) of the element's HDF DataItem."""
        item = element.find("DataItem")
        if item is not None and (item.get("Format") or "XML") == "XML":
            raise SerialOnlyXdmf(f"{self.path!r}: data stored inline (XML)")
        if item is None or (item.get("Format") or "XML") != "HDF" or not (item.text or "").strip():
            raise ValueError(f"{self.path!r}: {element.tag} {element.get('Name', '')} is not stored in HDF5 "
                             f"(only Format=\"HDF\" data items are read in parallel)".replace("  ", " "))
        fname, _, dset = item.text.strip().partition(":")
        if not dset:
            raise ValueError(f"{self.path!r}: bad HDF5 reference {item.text.strip()!r}")
        return (fname if os.path.isabs(fname) else os.path.join(self.folder, fname)), dset

    def field(self, name: str, center: str, step: Optional[int]) -> Tuple[str, str]:
        """(h5 file, dataset) of attribute ``name`` (``center`` Node / Cell): without ``step``,
        the mesh grid's; else step ``step`` (negative: from the end) of the time series."""
        root = ET.fromstring(self.raw)
        if step is None:
            grids = [self.mesh_grid]
        else:
            coll = [g for g in root.find("Domain").findall("Grid") if g.get("CollectionType") == "Temporal"]
            steps = [g for c in coll for g in c.findall("Grid")]
            if not -len(steps) <= step < len(steps):
                raise ValueError(f"{self.path!r}: step {step} out of range: the file has {len(steps)} time step(s)")
            grids = [steps[step]]
        for g in grids:
            for a in g.findall("Attribute"):
                if a.get("Name") == name:
                    if (a.get("Center") or "Node") != center:
                        raise ValueError(f"{self.path!r}: field {name!r} is a {a.get('Center')} field, "
                                         f"not {center}")
                    return self._item(a)
        raise ValueError(f"{self.path!r}: no {center} field {name!r} " + (
            "on the mesh (give step=... for a time series)" if step is None else f"in time step {step}"))


def xdmf_steps(path: Union[str, os.PathLike]) -> List[float]:
    """Local. The times of the time steps in an XDMF index, in file order."""
    root = ET.parse(os.fspath(path)).getroot()
    out = []
    for c in root.find("Domain").findall("Grid"):
        if c.get("CollectionType") == "Temporal":
            for g in c.findall("Grid"):
                t = g.find("Time")
                out.append(float(t.get("Value")) if t is not None else float("nan"))
    return out


def _open_index(comm: MPI.Comm, path) -> _Index:
    """Collective. The index on every rank, the same file on every rank, or one error everywhere."""
    err, idx = None, None
    try:
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"read_mesh: no such file: {path!r}")
        idx = _Index(path)
    except (OSError, ValueError) as e:
        err = e if isinstance(e, (FileNotFoundError, ValueError)) else ValueError(f"read_mesh: {path!r}: {e}")
    check_collective(comm, err)
    try:
        check_collective(comm, None, agree={"the XDMF file's content digest": settings_digest(idx.raw)})
    except ValueError as e:
        raise ValueError(f"read_mesh({os.fspath(path)!r}): a different file on some rank: {e}") from None
    return idx


def _read_rows(comm: MPI.Comm, ref: Tuple[str, str], what: str, n_expect: Optional[int] = None,
               rows: Optional[Tuple[int, int]] = None):
    """Collective. ``(global shape, this rank's rows)`` of an HDF5 dataset: rows ``rows``, or
    the balanced contiguous slice; the same dataset shape on every rank, or a ``ValueError``
    naming the file on every rank."""
    h5py = _h5py()
    fname, dset = ref
    err, shape, data = None, None, None
    try:
        if not os.path.exists(fname):
            raise FileNotFoundError(f"{what}: the HDF5 file {fname!r} named by the XDMF index does not exist")
        try:
            f = h5py.File(fname, "r")
        except OSError as e:
            raise ValueError(f"{what}: cannot open {fname!r} (not HDF5, or truncated): {e}") from None
        with f:
            if dset not in f:
                raise ValueError(f"{what}: {fname!r} has no dataset {dset!r}")
            d = f[dset]
            shape = tuple(int(s) for s in d.shape)
            if not shape or (n_expect is not None and shape[0] != n_expect):
                raise ValueError(f"{what}: {fname}:{dset} has shape {shape}, expected {n_expect} rows")
            if rows is None:
                split = _balanced_split(shape[0], comm.Get_size())
                rows = (int(split[comm.Get_rank()]), int(split[comm.Get_rank() + 1]))
            try:
                data = d[rows[0]:rows[1]]
            except Exception as e:  # noqa: BLE001 - h5py raises OSError/KeyError on truncated data
                raise ValueError(f"{what}: cannot read {fname}:{dset} rows {rows} (truncated file?): "
                                 f"{type(e).__name__}: {e}") from None
    except (OSError, ValueError) as e:
        err = e
    check_collective(comm, err)
    check_collective(comm, None, agree={f"shape of {fname}:{dset} (a different file on some rank?)": shape})
    return shape, data, rows


def read_xdmf_mesh(path: Union[str, os.PathLike], comm: Optional[MPI.Comm] = None, partition=None,
                   dtype: torch.dtype = torch.float64) -> Mesh:
    """Collective. Read an XDMF + HDF5 mesh in parallel slices, partition it and distribute it.

    Every rank reads the cells ``[c_r, c_{r+1})`` and points ``[p_r, p_{r+1})`` of the
    balanced split (and slices of the tags), so no rank holds more than about ``2/P`` of
    the file. ``partition``: ``None`` (default: the layout saved in the file when it was
    written by :func:`write_xdmf` on as many ranks, else ``"ptscotch"`` when petsc4py is
    available, else ``"metis"`` when pymetis is, else ``"block"``), ``"saved"`` (that
    layout; an error if the file has none for this number of ranks), ``"ptscotch"``,
    ``"metis"`` (dual graph gathered on rank 0: small meshes) or ``"block"`` (the file's cell
    order). See :func:`slasolve.fem.read_mesh` for the mesh returned.
    """
    from .distribute import PARALLEL_PARTITIONERS, distribute_cells

    comm = get_comm(comm)
    size, rank = comm.Get_size(), comm.Get_rank()
    err = None
    if partition is not None and partition not in PARALLEL_PARTITIONERS + ("saved",):
        err = ValueError(f"partition must be None, 'saved' or one of {PARALLEL_PARTITIONERS} for XDMF files, "
                         f"got {partition!r}")
    else:
        try:
            _h5py()
        except ImportError as e:
            err = e
    check_collective(comm, err, agree={"partition": partition, "dtype": str(dtype)})
    idx = _open_index(comm, path)
    what = f"read_mesh({os.fspath(path)!r})"
    ct = idx.cell_type
    nv, dim = CELL_VERTICES[ct], CELL_DIM[ct]
    # the saved layout, when usable
    layout = None
    if partition in (None, "saved"):
        layout = _saved_layout(comm, idx.topology[0])
        if layout is not None and layout[0].size != size + 1:
            layout = None
        if partition == "saved" and layout is None:
            check_collective(comm, ValueError(f"{what}: partition='saved', but the file has no layout saved "
                                              f"for {size} ranks"))
    cell_rows = None if layout is None else (int(layout[0][rank]), int(layout[0][rank + 1]))
    (n_cells, nv_file), cells, cell_rows = _read_rows(comm, idx.topology, what, rows=cell_rows)
    err = None
    if nv_file != nv:
        err = ValueError(f"{what}: {ct} cells need {nv} nodes each, the topology has {nv_file}")
    elif n_cells < size:
        err = ValueError(f"{what}: {n_cells} cells cannot be split over {size} ranks")
    check_collective(comm, err)
    (n_points, gdim), points, _ = _read_rows(comm, idx.geometry, what)
    err = None
    if gdim < dim:
        err = ValueError(f"{what}: {gdim}-D points for {dim}-D {ct} cells")
    check_collective(comm, err)
    if gdim > dim:   # a flat mesh stored with 3-D points: the extra coordinates must be constant
        extra = points[:, dim:]
        lo = np.array([extra.min() if extra.size else np.inf, -(extra.max() if extra.size else -np.inf)])
        comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
        check_collective(comm, None if lo[0] == -lo[1] else ValueError(
            f"{what}: {ct} cells embedded in {gdim}-D (not flat); only flat meshes are supported"))
        points = points[:, :dim]
    cell_tags = None
    if idx.cell_tags is not None:
        _, cell_tags, _ = _read_rows(comm, idx.cell_tags, what, n_expect=n_cells, rows=cell_rows)
        cell_tags = np.asarray(cell_tags).reshape(-1)
        check_collective(comm, None if np.issubdtype(cell_tags.dtype, np.integer) else ValueError(
            f"{what}: cell tags must be integers, got {cell_tags.dtype}"))
    if cell_tags is None and idx.cell_tag_grid is not None:     # DOLFINx: tags in a grid of their own, by vertex sets
        from .distribute import match_cell_tags

        (nct, nv_t), tcells, trows = _read_rows(comm, idx.cell_tag_grid[0], what)
        _, tvals, _ = _read_rows(comm, idx.cell_tag_grid[1], what, n_expect=nct, rows=trows)
        tvals = np.asarray(tvals).reshape(-1)
        err = None
        if nv_t != nv:
            err = ValueError(f"{what}: the cell tags' topology has {nv_t} nodes per cell, the mesh {nv}")
        elif tvals.shape[0] != tcells.shape[0] or not np.issubdtype(tvals.dtype, np.integer):
            err = ValueError(f"{what}: cell tags must be one integer per tagged cell, got {tvals.dtype} "
                             f"of shape {tvals.shape}")
        elif tcells.size and (tcells.min() < 0 or tcells.max() >= n_points):
            err = ValueError(f"{what}: cell tags refer to points outside 0..{n_points - 1}")
        check_collective(comm, err)
        cell_tags = match_cell_tags(comm, np.asarray(cells, np.int64), np.asarray(tcells, np.int64), tvals,
                                    n_points, what)
    facet_tags = None
    if idx.facet_tags is not None:
        (nft, nfv), fv, frows = _read_rows(comm, idx.facet_tags[0], what)
        _, fval, _ = _read_rows(comm, idx.facet_tags[1], what, n_expect=nft, rows=frows)
        facet_tags = (np.asarray(fv, np.int64), np.asarray(fval).reshape(-1))
        err = None
        if fv.size and (fv.min() < 0 or fv.max() >= n_points):
            err = ValueError(f"{what}: facet tags refer to points outside 0..{n_points - 1}")
        check_collective(comm, err)
    if layout is not None:
        parts = np.full(cells.shape[0], rank, dtype=np.int64)
        node_offsets = layout[1]
    else:
        parts, node_offsets = _default_partitioner() if partition is None else partition, None
    return distribute_cells(comm, ct, np.asarray(cells, np.int64), cell_rows[0], np.asarray(points, np.float64),
                            int(_balanced_split(n_points, size)[rank]), n_points=n_points, n_cells=n_cells,
                            cell_tags=cell_tags, facet_tags=facet_tags, partition=parts,
                            node_offsets=node_offsets, dtype=dtype, what=what)


def _default_partitioner() -> str:
    import importlib.util

    if importlib.util.find_spec("petsc4py") is not None:
        return "ptscotch"
    if importlib.util.find_spec("pymetis") is not None:
        return "metis"
    return "block"


def _saved_layout(comm: MPI.Comm, h5file: str):
    """Collective. ``(cell_offsets, node_offsets)`` saved by :func:`write_xdmf`, or None."""
    out = None
    if comm.Get_rank() == 0:
        try:
            with _h5py().File(h5file, "r") as f:
                if "/Partition/cell_offsets" in f and "/Partition/node_offsets" in f:
                    out = (np.asarray(f["/Partition/cell_offsets"][:], np.int64),
                           np.asarray(f["/Partition/node_offsets"][:], np.int64))
        except (OSError, KeyError):
            out = None    # the reads below report an unreadable file
    return comm.bcast(out, root=0) if comm.Get_size() > 1 else out


# --------------------------------------------------------------------------- fields
def _read_field(path, mesh: Mesh, name: str, center: str, step: Optional[int], ids: np.ndarray, n_expect: int):
    from .distribute import fetch_rows

    comm = mesh.comm
    idx = _open_index(comm, path)
    what = f"read {center.lower()} field {name!r} from {os.fspath(path)!r}"
    err = None
    try:
        ref = idx.field(name, center, step)
    except ValueError as e:
        err = e
    check_collective(comm, err)
    shape, rows, (r0, r1) = _read_rows(comm, ref, what, n_expect=n_expect)
    offsets = np.concatenate([[0], np.cumsum(comm.allgather(r1 - r0))]).astype(np.int64)
    return torch.from_numpy(fetch_rows(comm, offsets, np.asarray(rows), ids))


def read_point_data(path: Union[str, os.PathLike], mesh: Mesh, name: str, step: Optional[int] = None) -> torch.Tensor:
    """Collective. A point field saved in an XDMF file, on ``mesh``'s owned nodes.

    ``mesh`` must have been read from the same file (by :func:`slasolve.fem.read_mesh`, on
    any number of ranks): its ``original_ids`` name the file's points. ``step``: ``None``
    for a field written with the mesh, else the index of a time step (``-1``: the last).
    Returns ``(mesh.n_owned, ...)`` values, in the mesh's numbering; each rank reads one
    slice of the dataset and the values travel to the owners (one exchange).
    """
    ids = _mesh_ids(mesh, "original_ids")
    ids = ids[mesh.owned_mask().numpy()]
    return _read_field(path, mesh, name, "Node", step, ids, None)


def read_cell_data(path: Union[str, os.PathLike], mesh: Mesh, name: str, step: Optional[int] = None) -> torch.Tensor:
    """Collective. A cell field saved in an XDMF file, on ``mesh``'s local cells
    (``(mesh.n_local_cells, ...)``); as :func:`read_point_data`."""
    ids = _mesh_ids(mesh, "original_cell_ids")
    return _read_field(path, mesh, name, "Cell", step, ids, mesh.n_global_cells)


def _mesh_ids(mesh: Mesh, attr: str) -> np.ndarray:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh, got {type(mesh).__name__}")
    ids = getattr(mesh, attr)
    err = None if ids is not None else ValueError(
        f"mesh.{attr} is None: read the mesh from the XDMF file first (slasolve.fem.read_mesh)")
    check_collective(mesh.comm, err)
    return ids.numpy()


# --------------------------------------------------------------------------- matrices
def _matrix_triplets(mesh: Mesh, matrices) -> Dict[str, tuple]:
    """Local. name -> (global shape, (rows, cols, values)) of the owned rows of each matrix,
    validated against the mesh (node-by-node, owned block rows = the owned nodes)."""
    from ..dsparse import DSparseTensor

    out = {}
    nn, (s, e) = mesh.n_global_nodes, mesh.owned_range
    for name, A in (matrices or {}).items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ValueError(f"matrix names must be non-empty strings without '/', got {name!r}")
        if not isinstance(A, DSparseTensor) or not A.is_row_shard:
            raise TypeError(f"matrices[{name!r}] must be a row-sharded DSparseTensor, got {type(A).__name__}")
        if A.comm.Get_size() != mesh.comm.Get_size():
            raise ValueError(f"matrices[{name!r}] lives on {A.comm.Get_size()} ranks, the mesh on "
                             f"{mesh.comm.Get_size()}")
        shape, bshape = tuple(A.global_shape), tuple(A.block_shape)
        if shape[:2] != (nn, nn) or (bshape and (len(bshape) != 2 or bshape[0] != bshape[1])):
            raise ValueError(f"matrices[{name!r}] must be node-by-node ({nn}, {nn}[, bs, bs]) on this mesh, "
                             f"got global_shape {shape}")
        offs = A.spec.offsets[0]
        rank = mesh.comm.Get_rank()
        if (int(offs[rank]), int(offs[rank + 1])) != (s, e):
            raise ValueError(f"matrices[{name!r}] owns block rows [{offs[rank]}, {offs[rank + 1]}), the mesh "
                             f"owns nodes [{s}, {e}): assemble it on this mesh")
        indptr, cols, vals = (t.detach().cpu() for t in A.local_rows_csr())
        rows = s + np.repeat(np.arange(e - s, dtype=np.int64), np.diff(indptr.numpy()))
        out[name] = (shape, (rows, cols.numpy().astype(np.int64), np.ascontiguousarray(vals.numpy())))
    return out


def _registry(comm: MPI.Comm, h5file: str, what: str) -> dict:
    """Collective. The registry :func:`write_xdmf` keeps in ``h5file``, on every rank."""
    reg, err = None, None
    if comm.Get_rank() == 0:
        try:
            with _h5py().File(h5file, "r") as f:
                reg = json.loads(f.attrs[_REGISTRY])
        except (OSError, KeyError, ValueError) as e:
            err = ValueError(f"{what}: {h5file!r} is not a file set written by write_xdmf ({e})")
    check_collective(comm, err)
    return comm.bcast(reg, root=0) if comm.Get_size() > 1 else reg


def read_matrix(path: Union[str, os.PathLike], mesh: Mesh, name: str, step: Optional[int] = None) -> "DSparseTensor":
    """Collective. A matrix saved by ``write_xdmf(..., matrices={name: A})``, on ``mesh``.

    ``mesh`` must have been read from the same file (by :func:`slasolve.fem.read_mesh`, on
    any number of ranks). ``step``: ``None`` for a matrix written with the mesh (a new file
    set), else the index of the time step it was appended with (``-1``: the last), as in
    :func:`read_point_data`. Returns a row-sharded :class:`~slasolve.DSparseTensor` whose block
    rows and columns are ``mesh``'s global node ids, each rank owning the rows of its owned
    nodes (the layout :meth:`slasolve.fem.Assembler.assemble_matrix` gives on ``mesh``),
    with the saved values bit for bit.

    Each rank reads one contiguous slice of the triplets; the file's node ids are mapped to
    the mesh's through a directory distributed in slices (``original_ids`` of the owned
    nodes sent to the slice that holds them), and every triplet travels to the owner of its
    row: three exchanges, no rank holds a global-size array.
    """
    from ..dsparse import DSparseTensor
    from .distribute import _Exchange, fetch_rows

    ids = _mesh_ids(mesh, "original_ids")
    comm = mesh.comm
    size, rank = comm.Get_size(), comm.Get_rank()
    idx = _open_index(comm, path)
    what = f"read matrix {name!r} from {os.fspath(path)!r}"
    h5file = idx.topology[0]
    reg = _registry(comm, h5file, what)
    steps = reg.get("steps") or []
    saved = [f"{m} (step {k})" for k, st in enumerate(steps) for m in sorted(st.get("matrices") or {})]
    saved = sorted(reg.get("matrices") or {}) + saved
    err, info, group = None, None, f"/Matrix/{name}"
    if step is not None and not (isinstance(step, (int, np.integer)) and -len(steps) <= step < len(steps)):
        err = ValueError(f"{what}: step {step!r} out of range: the file has {len(steps)} time step(s)")
    elif step is None:
        info = (reg.get("matrices") or {}).get(name)
    else:
        k = int(step) % len(steps)
        info, group = (steps[k].get("matrices") or {}).get(name), f"/Matrix/{name}/{k}"
    if err is not None:
        pass
    elif info is None:
        err = ValueError(f"{what}: no such matrix" + ("" if step is None else f" in step {step}")
                         + f" (saved: {saved})")
    elif reg["n_nodes"] != mesh.n_global_nodes or reg["n_cells"] != mesh.n_global_cells:
        err = ValueError(f"{what}: the file's mesh ({reg['n_cells']} cells, {reg['n_nodes']} nodes) is not "
                         f"this mesh ({mesh.n_global_cells}, {mesh.n_global_nodes})")
    check_collective(comm, err)
    shape = tuple(int(x) for x in info[0])
    (nnz,), rows, nz_rows = _read_rows(comm, (h5file, f"{group}/row"), what)
    _, cols, _ = _read_rows(comm, (h5file, f"{group}/col"), what, n_expect=nnz, rows=nz_rows)
    vshape, vals, _ = _read_rows(comm, (h5file, f"{group}/value"), what, n_expect=nnz, rows=nz_rows)
    nn = mesh.n_global_nodes
    err = None
    if vshape[1:] != shape[2:]:
        err = ValueError(f"{what}: values of shape {vshape}, expected blocks {shape[2:]}")
    elif (rows.size and (rows.min() < 0 or rows.max() >= nn)) or (cols.size and (cols.min() < 0 or
                                                                            cols.max() >= nn)):
        err = ValueError(f"{what}: node ids outside 0..{nn - 1}")
    check_collective(comm, err)
    # the directory: file node id -> this mesh's global id, in balanced slices
    d_off = _balanced_split(nn, size).astype(np.int64)
    own = mesh.owned_mask().numpy()
    pairs = np.stack([ids[own], mesh.node_ids.numpy()[own]], axis=1).astype(np.int64)
    ex = _Exchange(comm, pairs, np.searchsorted(d_off, pairs[:, 0], side="right") - 1)
    directory = np.empty(int(d_off[rank + 1] - d_off[rank]), dtype=np.int64)
    directory[ex.recv[:, 0] - d_off[rank]] = ex.recv[:, 1]
    new = fetch_rows(comm, d_off, directory, np.concatenate([rows, cols]).astype(np.int64))
    new_rows, new_cols = new[:rows.size], new[rows.size:]
    # every triplet to the owner of its row
    n_off = np.concatenate([[0], np.cumsum(comm.allgather(mesh.n_owned))]).astype(np.int64)
    dest = np.searchsorted(n_off, new_rows, side="right") - 1
    rc = _Exchange(comm, np.stack([new_rows, new_cols], axis=1), dest).recv
    v = _Exchange(comm, np.asarray(vals), dest).recv
    s, e = mesh.owned_range
    order = np.lexsort((rc[:, 1], rc[:, 0]))
    rc, v = rc[order], v[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rc[:, 0] - s, minlength=e - s))]).astype(np.int64)
    return DSparseTensor.from_local_rows(indptr, rc[:, 1].copy(), torch.from_numpy(np.ascontiguousarray(v)),
                                         shape, comm, block_shape=shape[2:])



# --------------------------------------------------------------------------- conversion
def convert_mesh(src: Union[str, os.PathLike], dst: Union[str, os.PathLike],
                 comm: Optional[MPI.Comm] = None, simplices: bool = False, collapse: bool = False) -> str:
    """Collective. Convert a mesh file (gmsh ``.msh`` v2/v4, VTK, ...) to XDMF + HDF5, once.

    Rank 0 reads ``src`` with meshio and writes ``dst`` (``.xdmf``) and its ``.h5``, which
    :func:`slasolve.fem.read_mesh` then reads in parallel slices on any number of ranks.
    The highest-dimensional cells (one of triangle, quad, tetra, hexahedron, in one or
    several blocks) are kept with their physical groups (``gmsh:physical``) as cell tags;
    the blocks of their facet type (lines in 2-D, triangles / quads in 3-D) that carry
    physical groups become facet tags. Other cell types of the top dimension (higher
    order, wedges, mixed volumes), or facet blocks of another type, raise ``ValueError``
    naming the file, on every rank. Returns ``dst``.

    Cells of mixed types (triangles and quads; tetrahedra, pyramids, wedges and hexahedra),
    as :func:`slasolve.fem.read_mesh` describes (the two options exclude each other):
    ``collapse=True`` writes every cell as a quad / hexahedron, the triangles, tetrahedra,
    pyramids and wedges as collapsed ones (repeated vertices; Q1 on every cell, exactly P1 on
    the triangles / tetrahedra), one per file cell with its tag, tagged triangle facets padded
    to ``(a, b, c, c)``; ``simplices=True`` splits every cell into triangles or tetrahedra
    that fit together, with their tags (P1). The file then holds one cell type, which every
    later read takes in parallel.

    Why a conversion and not a parallel ``.msh`` reader: a ``.msh`` file stores nodes and
    elements in per-entity blocks of varying sizes (ASCII lines of varying lengths), so a
    rank cannot seek to its share without parsing what precedes it; HDF5 datasets can be
    sliced directly. The conversion holds the mesh in rank 0's memory once, like gmsh
    that made it; every later read is parallel.
    """
    comm = get_comm(comm)
    src, dst = os.fspath(src), os.path.abspath(os.fspath(dst))
    err = None
    if not dst.endswith(".xdmf"):
        err = ValueError(f"convert_mesh: dst must name an .xdmf file, got {dst!r}")
    else:
        err = _mixed_cell_options("convert_mesh", simplices, collapse)
    check_collective(comm, err, agree={"src": src, "dst": dst, "simplices": simplices, "collapse": collapse})
    if comm.Get_rank() == 0:
        try:
            h5py = _h5py()
            if not os.path.exists(src):
                raise FileNotFoundError(f"convert_mesh: no such file: {src!r}")
            ct, cells, points, ctags, ftags = _meshio_arrays(src, "convert_mesh", simplices, collapse)
            dim = CELL_DIM[ct]
            if points.shape[1] > dim and np.all(points[:, dim:] == points[:1, dim:]):
                points = points[:, :dim]
            reg = {"cell_type": ct, "dim": points.shape[1], "n_cells": int(cells.shape[0]),
                   "n_nodes": int(points.shape[0]), "cell_tags": ctags is not None,
                   "n_facet_tags": None if ftags is None else int(ftags[0].shape[0]),
                   "point_data": {}, "cell_data": {}, "steps": [],
                   "digest": _numbering_digest(None, np.arange(cells.shape[0], dtype=np.int64), cells)}
            h5file = _h5_path(dst)
            tmp = os.path.join(os.path.dirname(dst), f".{os.path.basename(h5file)}.tmp-{os.getpid()}")
            try:
                with h5py.File(tmp, "w") as f:
                    f["/Mesh/topology"] = cells
                    f["/Mesh/geometry"] = points
                    if ctags is not None:
                        f["/Mesh/cell_tags"] = ctags
                    if ftags is not None:
                        f["/Mesh/facet_topology"] = ftags[0].astype(np.int64)
                        f["/Mesh/facet_values"] = ftags[1]
                    f.attrs[_REGISTRY] = json.dumps(reg)
                text = _xdmf_text(reg, os.path.basename(h5file))
                os.replace(tmp, h5file)
            finally:
                if os.path.exists(tmp):
                    os.remove(tmp)
            _replace_index(MPI.COMM_SELF, dst, text)
        except (OSError, ValueError, ImportError) as e:
            err = e
    check_collective(comm, err)
    return dst


register_mesh_reader((".xdmf", ".xmf"), read_xdmf_mesh, accepts=parallel_readable)
