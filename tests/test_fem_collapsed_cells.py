"""Meshes that mix cell types read with ``collapse=True``: Q1 on every cell, the triangles,
tetrahedra, pyramids and wedges as collapsed quads / hexahedra (repeated vertices).

References: native P1 assembly on the same simplices (a collapsed triangle / tetrahedron is
exactly P1, so every matrix and vector must equal P1's to rounding); the boundary of the file's
own cells (faces counted on the polyhedra); the exact volume; a linear solution (patch test)
and a bilinear / trilinear harmonic one on the quads / hexahedra, both in the discrete space;
the O(h^2) convergence of a smooth manufactured solution; and the same file read on one rank.
Run serially and under mpirun -n 2 / 3 / 4 with --with-mpi.
"""
import math
import os

import numpy as np
import pytest
import torch
from mpi4py import MPI

meshio = pytest.importorskip("meshio")

import slasolve  # noqa: E402
from slasolve.fem import (Assembler, DirichletBC, Mesh, NeoHookean, boundary_facets, box_mesh,  # noqa: E402
                          boundary_nodes, dual_graph, element_volume, neumann_load, read_mesh)
from slasolve.fem.cells import ORIENTATION_FLIP, facet_keys, signed_measure  # noqa: E402
from slasolve.fem.collapse import COLLAPSE_TYPES, collapse_cells  # noqa: E402
from slasolve.fem.xdmf import convert_mesh  # noqa: E402
from mixed_meshes import BOTTOM, TAGS, file_boundary_points, mixed_mesh, write_msh  # noqa: E402

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
F64 = torch.float64


def collapsed(mesh):
    """The simplex ``mesh`` with every cell padded to a collapsed quad / hexahedron: the same
    nodes, numbering and layout."""
    kind, pattern = COLLAPSE_TYPES[mesh.cell_type]
    return Mesh(comm=mesh.comm, cell_type=kind, dim=mesh.dim, cells=mesh.cells[:, pattern].contiguous(),
                node_ids=mesh.node_ids, node_coords=mesh.node_coords, owned_range=mesh.owned_range,
                n_global_nodes=mesh.n_global_nodes, n_global_cells=mesh.n_global_cells,
                boundary_mask=mesh.boundary_mask)


def distorted_box(cell):
    """A box mesh of ``cell`` with its interior nodes moved (the same on every rank count)."""
    mesh = box_mesh((5, 4) if cell == "triangle" else (3, 3, 4), cell=cell, comm=COMM)
    x = mesh.node_coords
    shift = 0.04 * torch.sin(7.0 * x.sum(1, keepdim=True) + torch.arange(mesh.dim, dtype=F64))
    mesh.node_coords = x + shift * (~mesh.boundary_mask[:, None])
    return mesh


def same_matrix(A, B, rtol=1e-13):
    ia, ja, va = A.local_rows_csr()
    ib, jb, vb = B.local_rows_csr()
    assert torch.equal(ia, ib) and torch.equal(ja, jb)
    scale = COMM.allreduce(float(va.abs().max()), op=MPI.MAX)
    assert COMM.allreduce(float((va - vb).abs().max()), op=MPI.MAX) <= rtol * scale


def max_diff(a, b):
    return COMM.allreduce(float((a - b).abs().max()) if a.numel() else 0.0, op=MPI.MAX)


@pytest.mark.parametrize("cell", ["triangle", "tetra"])
def test_collapsed_simplices_equal_p1(cell):
    """Every quantity on the collapsed mesh equals native P1 on the same simplices: stiffness,
    mass, elasticity, load, a Neumann load, the boundary facets, the dual graph, a Poisson
    solution and the neo-Hookean residual, tangent and energy (F is constant on P1 cells)."""
    mesh = distorted_box(cell)
    cmesh = collapsed(mesh)
    V, C = Assembler(mesh), Assembler(cmesh)
    same_matrix(V.stiffness(1.0), C.stiffness(1.0))
    same_matrix(V.mass(1.0), C.mass(1.0))
    f = lambda x: 1.0 + x[:, 0] ** 2 + torch.sin(x[:, -1])  # noqa: E731
    assert max_diff(V.load(f), C.load(f)) <= 1e-15
    g = lambda x: 1.0 + x[:, 0] - 2.0 * x[:, -1]  # noqa: E731
    assert max_diff(neumann_load(V, g), neumann_load(C, g)) <= 1e-15
    bv, bc = boundary_facets(mesh), boundary_facets(cmesh)
    assert len(bv) == len(bc)
    assert abs(float(bv.measures().sum()) - float(bc.measures().sum())) <= 1e-13
    assert torch.allclose(bv.centroids().sum(0), bc.centroids().sum(0), rtol=0, atol=1e-12)
    (ip1, c1), (ip2, c2) = dual_graph(mesh), dual_graph(cmesh)
    assert np.array_equal(ip1, ip2)
    assert all(set(c1[ip1[i]:ip1[i + 1]]) == set(c2[ip2[i]:ip2[i + 1]]) for i in range(len(ip1) - 1))
    sols = []
    for S in (V, C):
        bd = boundary_nodes(S.mesh)
        K, b = DirichletBC(S, bd, 0.0).apply(S.stiffness(1.0), S.load(f))
        sols.append(slasolve.solve(K, b, "direct"))
    assert max_diff(*sols) <= 1e-13 * COMM.allreduce(float(sols[0].abs().max()), op=MPI.MAX)
    # vector problems: elasticity and neo-Hookean at a smooth displacement
    Vv, Cv = Assembler(mesh, mesh.dim), Assembler(cmesh, cmesh.dim)
    same_matrix(Vv.elasticity(1.0, 0.3), Cv.elasticity(1.0, 0.3))
    x = Vv.owned_dof_coords()
    u = 0.05 * torch.sin(3.0 * x.sum(1)).to(F64)
    Pv, Pc = NeoHookean(Vv, None, mu=1.0, lmbda=1.5), NeoHookean(Cv, None, mu=1.0, lmbda=1.5)
    assert max_diff(Pv.residual(u), Pc.residual(u)) <= 1e-13
    same_matrix(Pv.jacobian(u), Pc.jacobian(u))
    assert abs(float(Pv.energy(u)) - float(Pc.energy(u))) <= 1e-13


def test_collapsed_reference_cells():
    """Local: each VTK reference cell, collapsed, is positively oriented with its exact
    volume; its degenerate facets are flagged, its others keyed by their distinct vertices."""
    ref = {"triangle": ([[0, 0], [1, 0], [0, 1]], 0.5), "quad": ([[0, 0], [1, 0], [1, 1], [0, 1]], 1.0),
           "tetra": ([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], 1 / 6),
           "pyramid": ([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0], [0, 0, 1]], 1 / 3),
           "wedge": ([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1], [1, 0, 1], [0, 1, 1]], 0.5)}
    faces = {"triangle": 3, "quad": 4, "tetra": 4, "pyramid": 5, "wedge": 5}
    for kind, (pts, vol) in ref.items():
        pts = np.array(pts, dtype=np.float64)
        q, cells = collapse_cells([(kind, np.arange(len(pts))[None])], len(pts))
        assert signed_measure(pts, cells, q)[0] > 0, kind
        got = float(element_volume(torch.from_numpy(pts[cells]), q)[0])
        assert abs(got - vol) <= 1e-15, kind
        keys, valid = facet_keys(cells, q)
        assert valid.sum() == faces[kind], kind
        assert len({tuple(k) for k in keys[valid]}) == faces[kind], kind
    # the Jacobian check skips only merged vertices: an inverted collapsed tetrahedron and a
    # pyramid lower than its base is twisted (its trilinear map folds) still raise, naming them
    tet = torch.tensor([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0, 0, 1]], dtype=F64)
    folded = torch.tensor([[0, 0, 0], [1, 0, 0.2], [1, 1, 0], [0, 1, 0.2], [0.5, 0.5, 0.05]], dtype=F64)
    for kind, x in (("tetra", tet[[0, 2, 1, 3]]), ("pyramid", folded)):
        _, cells = collapse_cells([(kind, np.arange(len(x))[None])], len(x))
        with pytest.raises(ValueError, match="non-positive Jacobian.*1 of them collapsed"):
            element_volume(x[torch.from_numpy(cells)], "hexahedron")


def test_collapse_conforms_on_random_numberings():
    """Local: for random point numberings (and cells listed in either orientation) of one mixed
    3-D mesh, the collapsed cells' faces met once are exactly the file's boundary faces (no
    false boundary at a repeated vertex) and the volume is exact."""
    if COMM.rank:
        return
    for seed in range(6):
        pts, blocks, volume, _ = mixed_mesh(3, n=2, layers=2, seed=seed, flip=seed % 2 == 1)
        kind, cells = collapse_cells(blocks, len(pts))
        keys, valid = facet_keys(cells, kind)
        uniq, count = np.unique(keys[valid], axis=0, return_counts=True)
        assert count.max() == 2
        assert np.array_equal(np.unique(uniq[count == 1]), file_boundary_points(blocks))
        neg = signed_measure(pts, cells, kind) < 0
        assert neg.any() == (seed % 2 == 1)
        cells[neg] = cells[neg][:, ORIENTATION_FLIP[kind]]      # as the readers reorient
        vol = element_volume(torch.from_numpy(pts[cells]), kind)     # raises on a bad det J
        assert abs(float(vol.sum()) - volume) <= 1e-12


def _solution_by_point(mesh, u):
    """Collective: ``{file point index: value}`` of the owned nodes, on every rank."""
    own = mesh.owned_mask().numpy()
    pairs = np.c_[mesh.original_ids.numpy()[own], u.numpy()]
    return np.concatenate(COMM.allgather(pairs)) if mesh.comm.size > 1 else pairs


def _tags_by_vertices(mesh, ids=None):
    """``(sorted file point ids of each cell + its tag)`` rows, all ranks', sorted; and the same
    for the facet tags (canonical facet keys). ``ids``: the point ids of the local nodes
    (default: ``original_ids``)."""
    comm = mesh.comm
    orig = (mesh.original_ids if ids is None else ids).numpy()
    lc = mesh.local_cells().numpy()
    cells = orig[lc]
    rows = np.c_[np.sort(cells, axis=1), mesh.cell_tags.numpy()]
    ft = mesh.facet_tags
    keys, _ = facet_keys(cells, mesh.cell_type)
    frows = np.c_[keys[ft.cells.numpy(), ft.local_facet.numpy()], ft.values.numpy()]
    if comm.size > 1:
        rows, frows = np.concatenate(comm.allgather(rows)), np.concatenate(comm.allgather(frows))
    return rows[np.lexsort(rows.T[::-1])], frows[np.lexsort(frows.T[::-1])]


def _poisson(mesh):
    """-laplace u = 1 + x, u = 0 on the boundary, by LU."""
    V = Assembler(mesh)
    K, b = DirichletBC(V, boundary_nodes(mesh), 0.0).apply(V.stiffness(1.0), V.load(lambda x: 1.0 + x[:, 0]))
    return slasolve.solve(K, b, "direct")


def _cell_signature(mesh):
    """Each local cell's vertex coordinates, sorted per coordinate (independent of vertex order)."""
    c = mesh.local_cell_coords()
    return torch.sort(c, dim=1).values.reshape(c.shape[0], -1)


def _read(path, route, shared_dir, dim, comm, tag=""):
    if route == "convert":
        out = os.path.join(shared_dir, f"collapsed{dim}{tag}.xdmf")
        if comm is COMM:
            convert_mesh(path, out, comm=COMM, collapse=True)
        return read_mesh(out, comm=comm)
    return read_mesh(path, comm=comm, collapse=True)


@pytest.mark.parametrize("dim", [2, 3])
@pytest.mark.parametrize("route", ["read", "convert"])
def test_mixed_mesh_collapsed(shared_dir, dim, route):
    """read_mesh(collapse=True) of a .msh, or convert_mesh(collapse=True) then the parallel XDMF
    read, of a mixed mesh with cells in both orientations: one Q1 cell per file cell, the
    boundary nodes exactly the file's boundary, the volume exact, the tags kept, a linear
    solution reproduced, and the solution and tags the same as the file read on one rank."""
    path = os.path.join(shared_dir, f"mixed{dim}.msh")
    pts, blocks, volume, bottom = write_msh(path, dim, flip=True, lines=True)
    mesh = _read(path, route, shared_dir, dim, COMM)
    assert mesh.cell_type == ("quad" if dim == 2 else "hexahedron")
    assert mesh.n_global_cells == sum(len(c) for _, c in blocks)
    assert mesh.n_global_nodes == len(pts)
    own = mesh.owned_mask().numpy()
    on_boundary = np.isin(mesh.node_ids.numpy(), boundary_nodes(mesh).numpy())
    got = np.sort(np.concatenate(COMM.allgather(mesh.original_ids.numpy()[own & on_boundary])))
    assert np.array_equal(got, file_boundary_points(blocks))
    V = Assembler(mesh)
    assert abs(COMM.allreduce(float(V.load(1.0).sum())) - volume) <= 1e-13
    tags = np.concatenate(COMM.allgather(mesh.cell_tags.numpy()))
    for t, c in blocks:
        assert np.count_nonzero(tags == TAGS[t]) == len(c), t
    n_bottom = COMM.allreduce(int((mesh.facet_tags.values == BOTTOM).sum()))
    assert n_bottom == sum(len(c) for _, c in bottom)
    # patch test: u = 1 + x + 2y (+ 3z) is in the space (exact stiffness quadrature on trilinear maps)
    coef = torch.tensor([1.0, 2.0, 3.0][:dim], dtype=F64)
    bd = boundary_nodes(mesh)
    xb = mesh.node_coords[torch.searchsorted(mesh.node_ids, bd)]
    K, f = DirichletBC(V, bd, 1.0 + xb @ coef).apply(V.stiffness(1.0), V.load(0.0))
    u = slasolve.solve(K, f, "direct")
    assert max_diff(u, 1.0 + mesh.owned_node_coords() @ coef) <= 1e-12
    # the same solution and tags as on one rank (every rank reads the file alone)
    u = _poisson(mesh)
    one = _read(path, route, shared_dir, dim, MPI.COMM_SELF)
    mine, ref = _solution_by_point(mesh, u), _solution_by_point(one, _poisson(one))
    mine, ref = mine[np.argsort(mine[:, 0])], ref[np.argsort(ref[:, 0])]
    assert np.array_equal(mine[:, 0], ref[:, 0])
    assert np.abs(mine[:, 1] - ref[:, 1]).max() <= 1e-12 * np.abs(ref[:, 1]).max()
    for a, b in zip(_tags_by_vertices(mesh), _tags_by_vertices(one)):
        assert np.array_equal(a, b)
    # written and read back in parallel on the saved layout: the padded facets written as quads
    # meet their faces again, and every rank gets the same nodes and cells back (after the meshio
    # route too, whose owned nodes are touched by their rank's cells, as the reload requires)
    from slasolve.fem import write_xdmf

    again = os.path.join(shared_dir, f"again{dim}.xdmf")
    write_xdmf(again, mesh)
    back = read_mesh(again, comm=COMM)
    for a, b in zip(_tags_by_vertices(mesh, mesh.node_ids), _tags_by_vertices(back)):
        assert np.array_equal(a, b)
    for x, y in ((mesh.owned_node_coords(), back.owned_node_coords()),
                 (_cell_signature(mesh), _cell_signature(back))):
        x, y = np.unique(x.numpy(), axis=0), np.unique(y.numpy(), axis=0)
        assert x.shape == y.shape and np.array_equal(x, y)


@pytest.mark.parametrize("dim", [2, 3])
def test_bilinear_solution_on_the_quads(shared_dir, dim):
    """Q1 on the quads / hexahedra of a mixed mesh: the harmonic xy (xyz) with its values
    prescribed everywhere but at the nodes inside the quad / hexahedron part is reproduced
    there to rounding. In 2-D the rows of those nodes are Q1's 9-point stencil (8/3, eight
    -1/3); in 3-D the same mesh split into simplices (P1) misses xyz (the test's contrast; in
    2-D P1 on these right triangles is the 5-point stencil, exact for xy too)."""
    path = os.path.join(shared_dir, f"bilinear{dim}.msh")
    write_msh(path, dim, n=8, layers=4)
    errors = {}
    for option in ("collapse", "simplices"):
        mesh = read_mesh(path, comm=COMM, **{option: True})
        V = Assembler(mesh)
        x = mesh.node_coords
        free = (~mesh.boundary_mask) & (x[:, 0] < 0.5 - 1e-9)
        if dim == 3:
            free &= x[:, 2] < 1.0 - 1e-9
        own = mesh.owned_mask()
        fixed = mesh.node_ids[own & ~free]
        exact = lambda p: p.prod(1)  # noqa: E731
        xf = x[torch.searchsorted(mesh.node_ids, fixed)]
        A = V.stiffness(1.0)
        if dim == 2 and option == "collapse":
            indptr, _, vals = A.local_rows_csr()
            for r in torch.nonzero(free[own]).flatten().tolist():
                row = np.sort(vals[indptr[r]:indptr[r + 1]].numpy())
                assert np.allclose(row, [-1 / 3] * 8 + [8 / 3], rtol=0, atol=1e-14), row
        K, f = DirichletBC(V, fixed, exact(xf)).apply(A, V.load(0.0))
        u = slasolve.solve(K, f, "direct")
        assert COMM.allreduce(int((free & own).sum())) >= 20
        errors[option] = max_diff(u, exact(mesh.owned_node_coords()))
    assert errors["collapse"] <= 1e-13
    if dim == 3:
        assert errors["simplices"] >= 1e-5


@pytest.mark.parametrize("dim", [2, 3])
def test_convergence_rate(shared_dir, dim):
    """A smooth manufactured solution on mixed meshes refined twice (3-D: the caps' height
    shrinking with h): the mass-norm of u_h - I_h u falls as h^2."""
    if dim == 2:
        u = lambda x: torch.sin(2 * x[:, 0] + x[:, 1]) + torch.cos(x[:, 0] - 2 * x[:, 1])  # noqa: E731
        sizes = (4, 8, 16)
    else:
        u = lambda x: torch.sin(2 * x[:, 0] + x[:, 1]) + torch.cos(x[:, 0] - 2 * x[:, 2])  # noqa: E731
        sizes = (4, 8, 16)
    f = lambda x: 5.0 * u(x)  # noqa: E731  (-laplace u = 5 u for both terms)
    errs = []
    for n in sizes:
        path = os.path.join(shared_dir, f"conv{dim}_{n}.msh")
        write_msh(path, dim, n=n, layers=n, cap=0.5 / n)
        mesh = read_mesh(path, comm=COMM, collapse=True)
        V = Assembler(mesh)
        bd = boundary_nodes(mesh)
        xb = mesh.node_coords[torch.searchsorted(mesh.node_ids, bd)]
        K, b = DirichletBC(V, bd, u(xb)).apply(V.stiffness(1.0), V.load(f))
        e = slasolve.solve(K, b, "direct") - u(mesh.owned_node_coords())
        errs.append(math.sqrt(COMM.allreduce(float(e @ (V.mass(1.0) @ e)))))
    rates = [math.log2(errs[i] / errs[i + 1]) for i in range(len(errs) - 1)]
    assert all(1.8 <= r <= 2.6 for r in rates), (errs, rates)


def test_bad_options(shared_dir):
    """collapse with simplices, collapse on higher-order cells, a non-bool, and collapse=True
    on a triangle XDMF read in parallel raise on every rank; a mixed file without an option
    names both."""
    path = os.path.join(shared_dir, "mixed2.msh")
    write_msh(path, 2)
    with pytest.raises(ValueError, match="exclude each other"):
        read_mesh(path, comm=COMM, collapse=True, simplices=True)
    with pytest.raises(ValueError, match="exclude each other"):
        convert_mesh(path, os.path.join(shared_dir, "x.xdmf"), comm=COMM, collapse=True, simplices=True)
    with pytest.raises(TypeError, match="collapse must be a bool"):
        read_mesh(path, comm=COMM, collapse=1)
    with pytest.raises(ValueError, match=r"mixes 2-D cell types.*simplices=True.*collapse=True"):
        read_mesh(path, comm=COMM)
    p2 = os.path.join(shared_dir, "quadratic.msh")
    if COMM.rank == 0:
        pts = np.array([[0, 0, 0], [1, 0, 0], [0, 1, 0], [0.5, 0, 0], [0.5, 0.5, 0], [0, 0.5, 0]], dtype=float)
        meshio.write(p2, meshio.Mesh(pts, [("triangle6", np.arange(6)[None])]), file_format="gmsh22", binary=False)
    COMM.Barrier()
    with pytest.raises(ValueError, match=r"quadratic\.msh.*triangle6.*collapse=True takes"):
        read_mesh(p2, comm=COMM, collapse=True)
    with pytest.raises(ValueError, match=r"quadratic\.msh.*triangle6.*collapse=True takes"):
        convert_mesh(p2, os.path.join(shared_dir, "q.xdmf"), comm=COMM, collapse=True)
    from slasolve.fem import write_xdmf

    tris = os.path.join(shared_dir, "tris.xdmf")
    write_xdmf(tris, box_mesh((2, 2 * COMM.size), cell="triangle", comm=COMM))
    with pytest.raises(ValueError, match=r"tris\.xdmf.*triangle cells.*convert_mesh"):
        read_mesh(tris, comm=COMM, collapse=True)
