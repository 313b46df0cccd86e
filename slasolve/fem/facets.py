"""Boundary facets and Neumann (flux / traction) boundary terms.

:func:`boundary_facets` (collective) finds the facets of the local cells that
belong to exactly one cell of the *global* mesh. Counting facets locally is not
enough in parallel: a facet on a partition boundary belongs to one cell on each of
two ranks. Each rank therefore counts its facets (keys: sorted global vertex ids),
and sends the ones it sees once to a referee rank (the owner of the facet's
smallest node id), which counts how many cells of the whole mesh have them and
replies. Only facets seen once locally travel (the domain boundary and the
partition boundaries), point to point; no rank holds a global array. The result
does not depend on the number of ranks or on ``mesh.boundary_mask``.

:func:`neumann_load` (collective) assembles ``∫_Γ g·v ds`` over the selected
boundary facets into the owned dofs: scalar fluxes for ``block_size=1``, vector
tractions (force per unit reference area, a dead load) for ``block_size=dim``.
Facet quadrature: 2-point Gauss on segments (triangle / quad cells), the 3-point
degree-2 rule on triangles (tetrahedra), 2x2 Gauss on quadrilaterals
(hexahedra); the rules integrate ``g v`` exactly for affine facets and ``g`` linear
(exact up to rounding for the interpolated forms). The facet shape functions are the
traces of the cell's P1/Q1 functions.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import numpy as np
import torch
from .._comm import check_collective, exchange_by_rank, reply_by_rank
from . import elements as _el
from .cells import CELL_FACETS, facet_keys
from .mesh import Mesh

if TYPE_CHECKING:  # annotations only: the Assembler's neumann() calls into this module
    from .assembly import Assembler

__all__ = ["BoundaryFacets", "boundary_facets", "neumann_load", "facet_rule", "tagged_facets", "tagged_nodes"]

Where = Optional[Callable[[torch.Tensor], torch.Tensor]]


# --------------------------------------------------------------------------- reference facets
def facet_rule(cell: str, dtype=torch.float64, device=None):
    """Local. Quadrature on the reference facet of ``cell``: ``(weights (nq,), N (nq, nfv),
    dN (nq, nfv, dim-1))`` (shape functions of the facet's vertices in the order of the
    facet's vertex list)."""
    if cell in ("triangle", "quad"):
        x, w = _el._gauss_1d(2)
        pts = x[:, None]
        N = np.stack([1.0 - x, x], 1)
        dN = np.broadcast_to(np.array([[-1.0], [1.0]]), (2, 2, 1)).copy()
    elif cell == "tetra":
        pts, w = _el._rule("triangle", "mass")
        N, dN = _el._shape("triangle", pts)
    elif cell == "hexahedron":
        pts, w = _el._tensor_rule(2, 2)
        N, dN = _el._shape("quad", pts)
    else:
        _el._check_cell(cell)
        raise ValueError(cell)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)  # noqa: E731
    return t(w), t(N), t(dN)


def _measure_and_normal(coords: torch.Tensor, dN: torch.Tensor):
    """Area element ``|J|`` (F, nq) and unnormalised normal (F, nq, dim) of facets."""
    T = torch.einsum("fvd,qvk->fqdk", coords, dN)                      # tangents (F, nq, dim, dim-1)
    if coords.shape[-1] == 2:
        t = T[..., 0]
        n = torch.stack([t[..., 1], -t[..., 0]], -1)
    else:
        n = torch.linalg.cross(T[..., 0], T[..., 1], dim=-1)
    return n.norm(dim=-1), n


@dataclass
class BoundaryFacets:
    """The boundary facets of this rank's cells (see :func:`boundary_facets`).

    Attributes
    ----------
    cell_type : the mesh's cell type.
    cells : ``(F,)`` local cell index (row of ``mesh.cells``) of each facet.
    local_facet : ``(F,)`` which facet of the cell (index into the cell's facet list).
    vertices : ``(F, nfv)`` the facet's vertices as positions ``0..nv-1`` in its cell.
    nodes : ``(F, nfv)`` global node ids of the facet's vertices.
    coords : ``(F, nfv, dim)`` their coordinates.
    """

    cell_type: str
    cells: torch.Tensor
    local_facet: torch.Tensor
    vertices: torch.Tensor
    nodes: torch.Tensor
    coords: torch.Tensor

    def __len__(self) -> int:
        return int(self.cells.shape[0])

    @property
    def n(self) -> int:
        """Local. Number of facets on this rank."""
        return len(self)

    def select(self, mask: torch.Tensor) -> "BoundaryFacets":
        """Local. The facets where ``mask`` (``(F,)`` bool) is True."""
        cc = None if self._cell_centroids is None else self._cell_centroids[mask]
        return BoundaryFacets(self.cell_type, self.cells[mask], self.local_facet[mask], self.vertices[mask],
                              self.nodes[mask], self.coords[mask], cc)

    def centroids(self) -> torch.Tensor:
        """Local. ``(F, dim)`` vertex averages (of the distinct vertices: a collapsed cell's
        triangle facet ``(a, b, c, c)`` has the triangle's)."""
        return _el.distinct_mean(self.coords)

    def measures(self) -> torch.Tensor:
        """Local. ``(F,)`` lengths (2-D) / areas (3-D)."""
        w, _, dN = facet_rule(self.cell_type, self.coords.dtype, self.coords.device)
        jac, _ = _measure_and_normal(self.coords, dN)
        return (jac * w).sum(1)

    def normals(self) -> torch.Tensor:
        """Local. ``(F, dim)`` outward unit normals at the facet centroids (pointing away
        from the centroid of the facet's cell; exact for flat facets of convex cells)."""
        dt, dev = self.coords.dtype, self.coords.device
        if self.cell_type in ("triangle", "quad"):
            dN = torch.tensor([[[-1.0], [1.0]]], dtype=dt, device=dev)
        else:
            _, dN1 = _el._shape("triangle" if self.cell_type == "tetra" else "quad",
                                np.array([[1 / 3, 1 / 3]] if self.cell_type == "tetra" else [[0.5, 0.5]]))
            dN = torch.as_tensor(dN1, dtype=dt, device=dev)
        _, n = _measure_and_normal(self.coords, dN)
        n = n[:, 0] / n[:, 0].norm(dim=-1, keepdim=True)
        if self._cell_centroids is not None and n.shape[0]:
            outward = ((self.centroids() - self._cell_centroids) * n).sum(-1)
            n = torch.where(outward[:, None] < 0, -n, n)
        return n

    _cell_centroids: Optional[torch.Tensor] = None


def _facet_table(cell: str) -> torch.Tensor:
    return torch.as_tensor(CELL_FACETS[cell], dtype=torch.int64)


def _find_boundary(mesh: Mesh) -> BoundaryFacets:
    comm = mesh.comm
    size = comm.Get_size()
    cell = mesh.cell_type
    table = _facet_table(cell)                                    # (nf, nfv)
    nf, nfv = table.shape
    gc = mesh.cells.to(torch.int64)
    E = gc.shape[0]
    k, valid = facet_keys(gc.numpy(), cell)                      # (E, nf, nfv), (E, nf)
    keys = torch.from_numpy(k.reshape(E * nf, nfv))
    if E:
        uk, inv, cnt = torch.unique(keys, dim=0, return_inverse=True, return_counts=True)
    else:
        uk, inv, cnt = keys, keys[:, 0], keys[:, 0]
    once = cnt == 1
    if E and not valid.all():       # a collapsed cell's degenerate facets are no facets (keys of their own)
        once[inv[torch.from_numpy(~valid.reshape(-1))]] = False
    if size > 1:
        cand = uk[once].numpy()                                    # (k, nfv), rows sorted by key
        offsets = np.asarray(comm.allgather(int(mesh.owned_range[0])), dtype=np.int64)
        owner = np.searchsorted(offsets, cand[:, 0], side="right") - 1
        order = np.argsort(owner, kind="stable")
        cand = np.ascontiguousarray(cand[order])
        counts = np.bincount(owner, minlength=size).astype(np.int64)
        xcomm = comm.Dup()
        try:
            recv, rcounts = exchange_by_rank(xcomm, cand.reshape(-1), counts * nfv)
            recv = recv.reshape(-1, nfv)
            if recv.shape[0]:
                _, rinv, rcnt = np.unique(recv, axis=0, return_inverse=True, return_counts=True)
                ans = rcnt[rinv.reshape(-1)].astype(np.int64)
            else:
                ans = np.empty(0, dtype=np.int64)
            glob = reply_by_rank(xcomm, ans, rcounts // nfv, counts)
        finally:
            xcomm.Free()
        single = np.empty_like(glob)
        single[order] = glob
        bmask_u = torch.zeros(uk.shape[0], dtype=torch.bool)
        bmask_u[torch.nonzero(once).flatten()] = torch.from_numpy(single == 1)
    else:
        bmask_u = once
    is_b = bmask_u[inv] if E else torch.zeros(0, dtype=torch.bool)
    idx = torch.nonzero(is_b).flatten()
    c, f = idx // nf, idx % nf
    verts = table[f]
    fnodes = gc[c[:, None], verts]
    lc = mesh.local_cells()
    coords = mesh.node_coords[lc[c[:, None], verts]]
    return BoundaryFacets(cell, c, f, verts, fnodes, coords, _el.distinct_mean(mesh.node_coords[lc[c]]))


def _cache_key(mesh: Mesh):
    return (id(mesh.cells), mesh.cells._version, id(mesh.node_coords), mesh.node_coords._version)


def _mesh_of(mesh_or_space):
    """Local. The mesh of an ``Assembler`` (its ``mesh``), or the argument itself."""
    return mesh_or_space if isinstance(mesh_or_space, Mesh) else getattr(mesh_or_space, "mesh", mesh_or_space)


def boundary_facets(mesh: Union[Mesh, Assembler], where: Where = None) -> BoundaryFacets:
    """Collective. The boundary facets of this rank's cells (facets of exactly one global cell).

    ``mesh``: a :class:`Mesh` or an :class:`Assembler`. ``where``: optional vectorised
    predicate on node coordinates (as for :func:`~slasolve.fem.boundary_nodes`): a facet
    is kept when it holds at every one of its vertices, so ``lambda x: x[:, 0] < 1e-12``
    selects the facets on the face ``x = 0``. The facet search is collective (one
    point-to-point exchange) and cached on the mesh; the selection is local. A predicate
    that fails or returns the wrong shape on any rank raises on every rank.
    """
    mesh = _mesh_of(mesh)
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh must be a Mesh or an Assembler, got {type(mesh).__name__}")
    if mesh._boundary_facets is None or mesh._boundary_facets[0] != _cache_key(mesh):
        mesh._boundary_facets = (_cache_key(mesh), _find_boundary(mesh))
    facets = mesh._boundary_facets[1]
    if where is None:
        return facets
    err, keep = None, None
    try:
        F, nfv, dim = facets.coords.shape
        k = where(facets.coords.reshape(F * nfv, dim))
        k = k if isinstance(k, torch.Tensor) else torch.as_tensor(np.asarray(k))
        if k.dtype != torch.bool or k.numel() != F * nfv:
            raise ValueError(f"where must return a ({F * nfv},) bool tensor for {F * nfv} points, got "
                             f"{k.dtype} of shape {tuple(k.shape)}")
        keep = k.reshape(F, nfv).all(1)
    except Exception as e:  # noqa: BLE001 - a user predicate may raise anything; raised on every rank
        err = e
    check_collective(mesh.comm, err)
    return facets.select(keep)


# --------------------------------------------------------------------------- Neumann load
def _facet_values(g, facets: BoundaryFacets, xq: torch.Tensor, N: torch.Tensor, bs: int, dtype, device):
    """Values of ``g`` at the facet quadrature points, ``(F, nq, bs)``."""
    F, nq = xq.shape[0], xq.shape[1]
    nfv = facets.vertices.shape[1]
    if callable(g) and not isinstance(g, torch.Tensor) and F == 0:
        v = xq.new_zeros((0, nq, bs))                     # g is not called without points
    elif callable(g) and not isinstance(g, torch.Tensor):
        v = g(xq.reshape(F * nq, xq.shape[-1]))
        v = torch.as_tensor(np.asarray(v), dtype=dtype, device=device) if not isinstance(v, torch.Tensor) \
            else v.to(dtype=dtype, device=device)
        if v.numel() != F * nq * bs or (v.dim() > 0 and v.shape[0] != F * nq):
            raise ValueError(f"g(x) must return ({F * nq},)" + ("" if bs == 1 else f" or ({F * nq}, {bs})")
                             + f" values for {F * nq} points, got shape {tuple(v.shape)}")
        v = v.reshape(F, nq, bs)
    elif isinstance(g, (int, float, list, tuple)) and not isinstance(g, bool) or \
            (isinstance(g, torch.Tensor) and (g.dim() == 0 or (g.dim() == 1 and g.shape[0] == bs and
                                                              (bs > 1 or F != 1)))):
        c = torch.as_tensor(g, dtype=dtype, device=device) if not isinstance(g, torch.Tensor) \
            else g.to(dtype=dtype, device=device)
        if c.numel() not in (1, bs):
            raise ValueError(f"a constant g must have 1 or {bs} values, got {c.numel()}")
        v = c.reshape(-1).expand(bs).reshape(1, 1, bs).expand(F, nq, bs)
    elif isinstance(g, torch.Tensor):
        g = g.to(dtype=dtype, device=device)
        if g.shape == ((F,) if bs == 1 else (F, bs)) or (bs == 1 and g.shape == (F, 1)):
            v = g.reshape(F, 1, bs).expand(F, nq, bs)
        elif g.shape == ((F, nfv) if bs == 1 else (F, nfv, bs)):
            v = torch.einsum("qa,fac->fqc", N, g.reshape(F, nfv, bs))
        else:
            raise ValueError(f"g has shape {tuple(g.shape)}; expected a constant ({bs},), per-facet values "
                             f"({F}{'' if bs == 1 else f', {bs}'}) or per-facet vertex values "
                             f"({F}, {nfv}{'' if bs == 1 else f', {bs}'}) for the {F} selected facets")
    else:
        raise TypeError("g must be a number, a sequence of block_size numbers, a callable g(x) or a tensor, "
                        f"got {type(g).__name__}")
    if not bool(torch.isfinite(v.detach()).all()):
        raise ValueError("g contains NaN or infinite values")
    return v


def neumann_element_vectors(space: Assembler, g, facets: BoundaryFacets) -> torch.Tensor:
    """Local. Cell vectors ``(E, nv * bs)`` holding ``∫_f g·v ds`` of the given facets (zero
    elsewhere); ``space.assemble_vector`` of them is the Neumann load."""
    dt, dev = space.dtype, space.device
    w, N, dN = facet_rule(space.cell, dt, dev)
    X = facets.coords.to(dtype=dt, device=dev)
    jac, _ = _measure_and_normal(X, dN)                              # (F, nq)
    xq = torch.einsum("qa,fad->fqd", N, X)
    v = _facet_values(g, facets, xq, N, space.bs, dt, dev)          # (F, nq, bs)
    fe = torch.einsum("fq,qa,fqc->fac", jac * w, N, v)              # (F, nfv, bs)
    E, nv, bs = space.mesh.n_local_cells, space.nv, space.bs
    slot = (facets.cells.to(dev)[:, None] * nv + facets.vertices.to(dev)).reshape(-1)
    buf = fe.new_zeros((E * nv, bs)).index_add(0, slot, fe.reshape(-1, bs))
    return buf.reshape(E, nv * bs)


def tagged_facets(mesh: Union[Mesh, Assembler], value: int) -> BoundaryFacets:
    """Collective. The boundary facets of this rank's cells whose facet tag
    (``mesh.facet_tags``, e.g. a gmsh physical group) is ``value``: pass them to
    :func:`neumann_load` as ``facets=``. A mesh without facet tags raises ``ValueError`` on
    every rank; a value no facet has gives no facets."""
    mesh = _mesh_of(mesh)
    check_collective(mesh.comm, None if mesh.facet_tags is not None else ValueError(
        "this mesh has no facet tags (read one with tags: slasolve.fem.read_mesh of an XDMF file)"))
    bf = boundary_facets(mesh)
    ft = mesh.facet_tags
    nf = len(CELL_FACETS[mesh.cell_type])
    sel = ft.values == int(value)
    keys = (ft.cells[sel] * nf + ft.local_facet[sel]).numpy()
    mask = np.isin((bf.cells * nf + bf.local_facet).numpy(), keys)
    return bf.select(torch.from_numpy(mask))


def tagged_nodes(mesh: Union[Mesh, Assembler], value: int) -> torch.Tensor:
    """Collective. Sorted global ids of the *owned* nodes on the facets tagged ``value``
    (e.g. for :class:`DirichletBC` on a physical group); the ranks holding the facets send
    their nodes to the owners (one exchange)."""
    from .distribute import _Exchange

    mesh = _mesh_of(mesh)
    nodes = torch.unique(tagged_facets(mesh, value).nodes).numpy()
    comm = mesh.comm
    starts = np.asarray([r[0] for r in comm.allgather(mesh.owned_range)], dtype=np.int64)
    owner = np.searchsorted(starts, nodes, side="right") - 1
    got = _Exchange(comm, nodes, owner).recv
    return torch.from_numpy(np.unique(got).astype(np.int64))


def neumann_load(space: Assembler, g=1.0, where: Where = None, *,
                 facets: Optional[BoundaryFacets] = None) -> torch.Tensor:
    """Collective. Neumann load ``∫_Γ g·v ds`` on the owned dofs, ``(n_owned_dofs,)``.

    Parameters
    ----------
    space : Assembler
        Scalar (``g`` is a flux, ``-κ ∂u/∂n = -g``) or vector (``g`` is a traction,
        force per unit area of the reference configuration) space.
    g : number, ``bs`` numbers, callable or tensor
        A constant; a callable ``g(x)`` of ``(n, dim)`` quadrature points returning
        ``(n,)`` / ``(n, bs)``; or a tensor of per-facet values ``(F,)`` / ``(F, bs)``, or
        per-facet vertex values ``(F, nfv)`` / ``(F, nfv, bs)`` (interpolated), for the
        ``F`` facets selected on this rank. Differentiable in tensor values (and
        in whatever a callable computes from differentiable tensors).
    where : callable, optional
        Predicate on node coordinates selecting the facets (see :func:`boundary_facets`);
        default: the whole boundary.
    facets : BoundaryFacets, optional
        Use these facets instead of ``where`` (e.g. to build per-facet ``g`` from
        ``facets.normals()`` for a pressure ``g = -p n``).
    """
    if not isinstance(getattr(space, "mesh", None), Mesh) or not hasattr(space, "assemble_vector"):
        raise TypeError(f"space must be an Assembler, got {type(space).__name__}")
    err = None
    if facets is not None and where is not None:
        err = ValueError("give either where or facets, not both")
    check_collective(space.comm, err)
    if facets is None:
        facets = boundary_facets(space.mesh, where)
    be, err = None, None
    try:
        if not isinstance(facets, BoundaryFacets) or facets.cell_type != space.cell:
            raise TypeError("facets must be the BoundaryFacets of this space's mesh")
        be = neumann_element_vectors(space, g, facets)
    except Exception as e:  # noqa: BLE001 - a user callable may raise anything; raised on every rank
        err = e
    check_collective(space.comm, err)
    return space.assemble_vector(be, check=False)

