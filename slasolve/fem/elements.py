"""Vectorised finite element kernels: all elements of a mesh at once, in torch.

Every function here is **local** (no communication). Inputs are

* ``coords``: a floating tensor ``(E, nv, dim)`` with the vertex coordinates of
  ``E`` elements (float64 or float32; may require grad, e.g. for shape
  optimisation);
* per-element coefficients ``(E,)`` (a Python number or 0-d tensor is broadcast),
  which may require grad: every kernel is differentiable in them.

The result is a batch of dense element matrices ``(E, n, n)`` (or vectors
``(E, n)``) in the dtype and on the device of ``coords``. There is no Python loop
over elements; loops over quadrature points are inside ``einsum``.

Cells and vertex ordering (the meshio / VTK conventions)
--------------------------------------------------------
``"triangle"`` (P1)
    reference vertices (0,0), (1,0), (0,1): counter-clockwise, positive area.
``"tetra"`` (P1)
    reference vertices (0,0,0), (1,0,0), (0,1,0), (0,0,1): positive volume
    (vertex 3 lies on the side of the face 0-1-2 that its normal
    ``(x1-x0) x (x2-x0)`` points to).
``"quad"`` (Q1, bilinear, 2x2 Gauss)
    reference square [0,1]^2 with vertices counter-clockwise
    (0,0), (1,0), (1,1), (0,1).
``"hexahedron"`` (Q1, trilinear, 2x2x2 Gauss)
    reference cube [0,1]^3, VTK order: bottom face counter-clockwise seen from
    above, (0,0,0), (1,0,0), (1,1,0), (0,1,0), then the top face in the same order
    (0,0,1), (1,0,1), (1,1,1), (0,1,1).

``cell`` may be omitted: it is inferred from ``(nv, dim)`` (3,2) triangle,
(4,2) quad, (4,3) tetra, (8,3) hexahedron.

Elements whose Jacobian determinant is not positive (inverted, i.e. clockwise,
or degenerate) raise ``ValueError`` naming how many there are and the first one.
For Q1 elements the determinant is checked at the quadrature points and at the
vertices, except at the vertices that a collapsed cell merges (equal to the
other end of one of their edges), where it is zero by construction.

Collapsed Q1 cells (``read_mesh(..., collapse=True)``, :mod:`slasolve.fem.collapse`):
a quad ``(a, b, c, c)`` is the triangle ``(a, b, c)``, a hexahedron
``(a, b, c, c, d, d, d, d)`` the tetrahedron ``(a, b, c, d)``; the element
matrices have a row and column per local vertex, and the assembly's sum over
repeated vertices makes them exactly P1's (the shape functions of merged
vertices sum to the P1 one; ``det J`` is ``2|T|(1 - eta)`` and
``6|T|(1 - zeta)^2 (1 - eta)``, which the Gauss rules above integrate exactly
in stiffness, mass and load). Collapsed pyramids ``(a, b, c, d, e, e, e, e)``
and wedges ``(a, b, c, c, d, e, f, f)`` are the collapsed trilinear elements.

Quadrature: stiffness uses the rule exact for affine geometry (1 point for
simplices, 2^dim Gauss for Q1); mass and load use rules exact for P1/Q1 products
(3-point triangle, 4-point tetra, 2x2 Gauss quad, 3x3x3 Gauss hexahedron).

Elasticity: degrees of freedom are node-major, vertex ``i`` component ``d`` at
local dof ``i*dim + d``. The material is isotropic; ``kind`` is
``"plane_stress"`` or ``"plane_strain"`` in 2-D and ``"3d"`` in 3-D. With the
quad's counter-clockwise order, the Q1 plane-stress matrix of the unit square
equals the ``KE`` of the 88-line topology optimisation code (Andreassen et al.
2011) entry by entry, with no permutation (their node order upper-left,
upper-right, lower-right, lower-left with the y axis pointing down is the mirror
image of ours, and an isotropic element matrix is invariant under that mirror).
"""
from __future__ import annotations

import itertools
import math
from typing import Optional, Union

import numpy as np
import torch

from ..sparse import all_finite
from .cells import CELL_DIM, CELL_EDGES, CELL_TYPES, CELL_VERTICES

__all__ = ["CELL_TYPES", "cell_dim", "n_vertices", "infer_cell", "stiffness", "mass",
           "load", "element_volume", "elasticity_stiffness", "elasticity_parts"]

Coef = Union[float, int, torch.Tensor]


_QUAD_VERTS = np.array([[0, 0], [1, 0], [1, 1], [0, 1]], dtype=np.float64)
_HEX_VERTS = np.array([[0, 0, 0], [1, 0, 0], [1, 1, 0], [0, 1, 0],
                       [0, 0, 1], [1, 0, 1], [1, 1, 1], [0, 1, 1]], dtype=np.float64)


def cell_dim(cell: str) -> int:
    """Local. Topological dimension of ``cell``."""
    _check_cell(cell)
    return CELL_DIM[cell]


def n_vertices(cell: str) -> int:
    """Local. Number of vertices of ``cell``."""
    _check_cell(cell)
    return CELL_VERTICES[cell]


def infer_cell(nv: int, dim: int) -> str:
    """Local. The cell type with ``nv`` vertices in ``dim`` dimensions."""
    for c in CELL_TYPES:
        if CELL_VERTICES[c] == nv and CELL_DIM[c] == dim:
            return c
    raise ValueError(f"cannot infer the cell type of elements with {nv} vertices in {dim}-D; "
                     f"supported: {', '.join(f'{c} ({CELL_VERTICES[c]} vertices, {CELL_DIM[c]}-D)' for c in CELL_TYPES)}")


def _check_cell(cell) -> None:
    if not isinstance(cell, str):
        raise TypeError(f"cell must be a string, one of {CELL_TYPES}, got {type(cell).__name__}")
    if cell not in CELL_DIM:
        raise ValueError(f"cell must be one of {CELL_TYPES}, got {cell!r}")


# --------------------------------------------------------------------------- reference
def _gauss_1d(n: int):
    if n == 2:
        a = 0.5 / math.sqrt(3.0)
        return np.array([0.5 - a, 0.5 + a]), np.array([0.5, 0.5])
    if n == 3:
        a = 0.5 * math.sqrt(0.6)
        return np.array([0.5 - a, 0.5, 0.5 + a]), np.array([5.0, 8.0, 5.0]) / 18.0
    raise ValueError(n)


def _tensor_rule(dim: int, n: int):
    x, w = _gauss_1d(n)
    pts = np.array(list(itertools.product(x, repeat=dim)))[:, ::-1]  # x fastest (cosmetic)
    wts = np.array([np.prod(c) for c in itertools.product(w, repeat=dim)])
    return np.ascontiguousarray(pts), wts


def _rule(cell: str, kind: str):
    """Quadrature (points (nq, dim), weights (nq,)) on the reference cell."""
    if cell == "triangle":
        if kind == "stiffness":
            return np.array([[1 / 3, 1 / 3]]), np.array([0.5])
        return np.array([[1 / 6, 1 / 6], [2 / 3, 1 / 6], [1 / 6, 2 / 3]]), np.full(3, 1 / 6)
    if cell == "tetra":
        if kind == "stiffness":
            return np.array([[0.25, 0.25, 0.25]]), np.array([1 / 6])
        a, b = 0.5854101966249685, 0.1381966011250105
        return np.array([[b, b, b], [a, b, b], [b, a, b], [b, b, a]]), np.full(4, 1 / 24)
    if cell == "quad":
        return _tensor_rule(2, 2)
    # hexahedron: 2x2x2 is exact for stiffness of parallelepipeds and for the
    # volume; the mass needs 3x3x3 (trilinear * trilinear * quadratic det J)
    return _tensor_rule(3, 2 if kind in ("stiffness", "volume") else 3)


def _shape(cell: str, pts: np.ndarray):
    """Shape functions N (nq, nv) and reference gradients dN (nq, nv, dim)."""
    nq = pts.shape[0]
    if cell in ("triangle", "tetra"):
        d = pts.shape[1]
        N = np.concatenate([1.0 - pts.sum(1, keepdims=True), pts], axis=1)
        dN1 = np.concatenate([-np.ones((1, d)), np.eye(d)], axis=0)
        return N, np.broadcast_to(dN1, (nq, d + 1, d)).copy()
    verts = _QUAD_VERTS if cell == "quad" else _HEX_VERTS
    # 1-D factors: f(x) = x for vertex coordinate 1, 1 - x for 0
    f = np.where(verts[None] == 1, pts[:, None, :], 1.0 - pts[:, None, :])  # (nq, nv, dim)
    df = np.where(verts[None] == 1, 1.0, -1.0) * np.ones_like(f)
    N = f.prod(-1)
    dim = pts.shape[1]
    dN = np.empty_like(f)
    for k in range(dim):
        g = f.copy()
        g[..., k] = df[..., k]
        dN[..., k] = g.prod(-1)
    return N, dN


_CACHE: dict = {}


def _reference(cell: str, kind: str, dtype, device):
    key = (cell, kind, dtype, str(device))
    if key not in _CACHE:
        pts, w = _rule(cell, kind)
        N, dN = _shape(cell, pts)
        if cell in ("quad", "hexahedron"):
            # also check det J at the vertices (the extreme values for a bilinear det)
            verts = _QUAD_VERTS if cell == "quad" else _HEX_VERTS
            _, dNv = _shape(cell, verts)
            dNcheck = np.concatenate([dN, dNv], axis=0)
        else:
            dNcheck = dN[:1]
        t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)  # noqa: E731
        _CACHE[key] = (t(w), t(N), t(dN), t(dNcheck))
    return _CACHE[key]


# --------------------------------------------------------------------------- validation
def _check_coords(coords, cell: Optional[str]) -> str:
    if not isinstance(coords, torch.Tensor):
        raise TypeError(f"coords must be a torch.Tensor of shape (E, nv, dim), got {type(coords).__name__}")
    if not coords.is_floating_point():
        raise TypeError(f"coords must be a floating tensor (float64 or float32), got {coords.dtype}")
    if coords.dim() != 3:
        raise ValueError(f"coords must have shape (E, nv, dim), got shape {tuple(coords.shape)}")
    if cell is None:
        cell = infer_cell(coords.shape[1], coords.shape[2])
    _check_cell(cell)
    if coords.shape[1] != CELL_VERTICES[cell] or coords.shape[2] != CELL_DIM[cell]:
        raise ValueError(f"coords must have shape (E, {CELL_VERTICES[cell]}, {CELL_DIM[cell]}) for cell {cell!r}, "
                         f"got {tuple(coords.shape)}")
    if not bool(torch.isfinite(coords.detach()).all()):
        raise ValueError("coords contains NaN or infinite values")
    return cell


_NUMPY_DTYPES = {torch.float64: np.float64, torch.float32: np.float32}


def _coef(name: str, c: Coef, E: int, like: torch.Tensor, numpy: bool = False):
    """Local. The coefficient ``c`` (a number or ``(E,)`` / 0-d tensor) checked, as ``(E,)`` values
    of ``like``'s dtype and device; ``numpy``: as a NumPy array (CPU; no autograd)."""
    if isinstance(c, bool) or not isinstance(c, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a number or a torch.Tensor of shape ({E},), got {type(c).__name__}")
    if isinstance(c, torch.Tensor):
        if c.dtype == torch.bool or c.is_complex():
            raise TypeError(f"{name} must be a real tensor, got {c.dtype}")
        if c.dim() == 0:
            c = c.reshape(1).expand(E)
        elif c.shape != (E,):
            raise ValueError(f"{name} must have shape ({E},) (one value per element), got {tuple(c.shape)}")
        if not all_finite(c):
            raise ValueError(f"{name} contains NaN or infinite values")
        c = c.to(dtype=like.dtype, device=like.device)
        return c.detach().numpy() if numpy else c
    if not math.isfinite(float(c)):
        raise ValueError(f"{name} must be finite, got {c}")
    if numpy:
        return np.full(E, float(c), dtype=_NUMPY_DTYPES[like.dtype])
    return torch.full((E,), float(c), dtype=like.dtype, device=like.device)


def _jacobians(coords: torch.Tensor, dN: torch.Tensor) -> torch.Tensor:
    # J[e, q, d, k] = d x_d / d xi_k
    return torch.einsum("evd,qvk->eqdk", coords, dN)


def _det(J: torch.Tensor) -> torch.Tensor:
    """Determinants of 2x2 / 3x3 matrices in closed form (batched LAPACK calls on
    millions of tiny matrices cost ten times more)."""
    if J.shape[-1] == 2:
        a = _entries(J)
        return a[0][0] * a[1][1] - a[0][1] * a[1][0]
    if J.shape[-1] == 3:
        a = _entries(J)
        return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
                - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
                + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))
    return torch.linalg.det(J)


def _entries(J: torch.Tensor):
    """``a[i][j] = J[..., i, j]`` as views. Through ``unbind`` rather than indexing: the backward
    of each index is a zero-filled tensor of the full size, that of ``unbind`` one stack."""
    return [row.unbind(-1) for row in J.unbind(-2)]


def _det_inv(J: torch.Tensor):
    """``(det J, J^{-1})`` by the adjugate for 2x2 / 3x3 (1x1 and others via LAPACK)."""
    det = _det(J)
    if J.shape[-1] == 2:
        a = _entries(J)
        adj = torch.stack([torch.stack([a[1][1], -a[0][1]], -1),
                           torch.stack([-a[1][0], a[0][0]], -1)], -2)
    elif J.shape[-1] == 3:
        a = _entries(J)
        c = lambda i, j, k, l: a[i][j] * a[k][l] - a[i][l] * a[k][j]  # noqa: E731
        adj = torch.stack([
            torch.stack([c(1, 1, 2, 2), -c(0, 1, 2, 2), c(0, 1, 1, 2)], -1),
            torch.stack([-c(1, 0, 2, 2), c(0, 0, 2, 2), -c(0, 0, 1, 2)], -1),
            torch.stack([c(1, 0, 2, 1), -c(0, 0, 2, 1), c(0, 0, 1, 1)], -1)], -2)
    else:
        return det, torch.linalg.inv(J)
    return det, adj / det[..., None, None]


def _merged_vertices(coords: torch.Tensor, cell: str) -> torch.Tensor:
    """Local. ``(E, nv)`` bool: the vertex equals the other end of one of its edges (a
    collapsed Q1 cell's merged vertices, where det J is zero by construction)."""
    e = torch.as_tensor(CELL_EDGES[cell], device=coords.device)                   # (ne, 2)
    zero = (coords[:, e[:, 0]] == coords[:, e[:, 1]]).all(-1)                      # (E, ne)
    inc = torch.zeros(e.shape[0], CELL_VERTICES[cell], dtype=coords.dtype, device=coords.device)
    inc[torch.arange(e.shape[0]), e[:, 0]] = 1
    inc[torch.arange(e.shape[0]), e[:, 1]] = 1
    return (zero.to(coords.dtype) @ inc) > 0


def distinct_mean(coords: torch.Tensor) -> torch.Tensor:
    """Local. ``(..., dim)`` average of the distinct vertices of ``coords`` ``(..., nv, dim)``:
    the vertex average of the triangle / tetrahedron / ... a collapsed Q1 cell (or facet) is
    (a plain ``mean`` weights its repeated vertices twice). Vertices are the same when their
    coordinates are equal (a repeated node has the very same values)."""
    nv = coords.shape[-2]
    with torch.no_grad():
        same = (coords[..., :, None, :] == coords[..., None, :, :]).all(-1)       # (..., nv, nv)
        earlier = torch.ones(nv, nv, dtype=torch.bool, device=coords.device).tril(-1)
        w = (~(same & earlier).any(-1)).to(coords.dtype)                           # first occurrences
    return (coords * w[..., None]).sum(-2) / w.sum(-1)[..., None]


def _check_orientation(coords: torch.Tensor, cell: str, dNcheck: torch.Tensor) -> None:
    if coords.shape[0] == 0:
        return
    with torch.no_grad():
        det = _det(_jacobians(coords, dNcheck))  # (E, nq')
        # relative tolerance: a degenerate element has det ~ 0 up to rounding
        scale = (coords.amax(1) - coords.amin(1)).amax(-1) ** CELL_DIM[cell]  # (E,)
        tol = 64 * torch.finfo(coords.dtype).eps * scale
        low = det <= tol[:, None]
        collapsed = None
        if cell in CELL_EDGES:      # the last nv columns are the vertices: skip merged ones
            nv = CELL_VERTICES[cell]
            suspect = torch.nonzero(low[:, -nv:].any(1)).flatten()   # only those (none on most meshes)
            if suspect.numel():
                merged = _merged_vertices(coords[suspect], cell)
                low[suspect, -nv:] &= ~merged
                collapsed = torch.zeros(coords.shape[0], dtype=torch.bool, device=coords.device)
                collapsed[suspect] = merged.any(1)
        bad = low.any(1)
        nbad = int(bad.sum())
    if nbad:
        first = int(torch.nonzero(bad)[0, 0])
        hint = ""
        if collapsed is not None and bool(collapsed[bad].any()):
            ncol = int(collapsed[bad].sum())
            hint = (f"; {ncol} of them collapsed (repeated vertices: a pyramid or wedge read with collapse=True "
                    f"whose trilinear map folds, e.g. a pyramid lower than its base is twisted; such a mesh "
                    f"needs better cells, or simplices=True)")
        raise ValueError(f"{nbad} {cell} element(s) with non-positive Jacobian determinant "
                         f"(inverted or degenerate); first is element {first} "
                         f"(local index in coords), min det J = {float(det[first][low[first]].min()):.3e}{hint}")


def _gram(G: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """``K[e,i,j] = sum_{q,d} wq[e,q] G[e,q,i,d] G[e,q,j,d]`` as one batched matmul."""
    E, nq, nv, dim = G.shape
    Gt = G.permute(0, 2, 1, 3).reshape(E, nv, nq * dim)
    Gw = (G * wq[:, :, None, None]).permute(0, 2, 1, 3).reshape(E, nv, nq * dim)
    return torch.bmm(Gw, Gt.transpose(1, 2))


def _geometry(coords: torch.Tensor, cell: str, kind: str):
    """Weights w*detJ (E, nq), shape functions N (nq, nv), physical gradients (E, nq, nv, dim)."""
    w, N, dN, dNcheck = _reference(cell, kind, coords.dtype, coords.device)
    _check_orientation(coords, cell, dNcheck)
    J = _jacobians(coords, dN)
    det, Jinv = _det_inv(J)
    # grad phi_v = J^{-T} grad_ref phi_v  ->  G[e,q,v,d] = sum_k dN[q,v,k] Jinv[e,q,k,d]
    G = torch.einsum("qvk,eqkd->eqvd", dN, Jinv)
    return det * w, N, G


# --------------------------------------------------------------------------- kernels
def element_volume(coords: torch.Tensor, cell: Optional[str] = None) -> torch.Tensor:
    """Local. Area (2-D) or volume (3-D) of every element, shape ``(E,)``."""
    cell = _check_coords(coords, cell)
    w, _, dN, dNcheck = _reference(cell, "volume", coords.dtype, coords.device)
    _check_orientation(coords, cell, dNcheck)
    return (_det(_jacobians(coords, dN)) * w).sum(1)


def stiffness(coords: torch.Tensor, kappa: Coef = 1.0, cell: Optional[str] = None) -> torch.Tensor:
    """Local. Element matrices of ``∫ kappa ∇u·∇v``, shape ``(E, nv, nv)``.

    ``kappa``: per-element coefficient ``(E,)`` (or a number); differentiable.
    """
    cell = _check_coords(coords, cell)
    k = _coef("kappa", kappa, coords.shape[0], coords)
    wdet, _, G = _geometry(coords, cell, "stiffness")
    return _gram(G, wdet * k[:, None])


def mass(coords: torch.Tensor, rho: Coef = 1.0, cell: Optional[str] = None) -> torch.Tensor:
    """Local. Consistent mass matrices of ``∫ rho u v``, shape ``(E, nv, nv)``."""
    cell = _check_coords(coords, cell)
    r = _coef("rho", rho, coords.shape[0], coords)
    wdet, N, _ = _geometry(coords, cell, "mass")
    # one (E, nq) x (nq, nv*nv) matmul (a three-operand einsum is several times slower)
    NN = (N[:, :, None] * N[:, None, :]).reshape(N.shape[0], -1)
    E, nv = coords.shape[0], N.shape[1]
    return ((wdet * r[:, None]) @ NN).reshape(E, nv, nv)


def load(coords: torch.Tensor, f_nodal: torch.Tensor, cell: Optional[str] = None) -> torch.Tensor:
    """Local. Consistent load vectors ``∫ f v``, shape ``(E, nv)``.

    ``f_nodal``: ``(E, nv)`` values of ``f`` at each element's vertices (``f`` is
    interpolated with the element's own shape functions), or a number for a
    constant ``f``. Differentiable in ``f_nodal``.
    """
    cell = _check_coords(coords, cell)
    E, nv = coords.shape[0], coords.shape[1]
    if isinstance(f_nodal, bool) or not isinstance(f_nodal, (int, float, torch.Tensor)):
        raise TypeError(f"f_nodal must be a torch.Tensor of shape ({E}, {nv}) or a number, "
                        f"got {type(f_nodal).__name__}")
    if isinstance(f_nodal, torch.Tensor):
        if f_nodal.dtype == torch.bool or f_nodal.is_complex():
            raise TypeError(f"f_nodal must be a real tensor, got {f_nodal.dtype}")
        if f_nodal.dim() == 0:
            f_nodal = f_nodal.reshape(1, 1).expand(E, nv)
        if f_nodal.shape != (E, nv):
            raise ValueError(f"f_nodal must have shape ({E}, {nv}), got {tuple(f_nodal.shape)}")
        if not bool(torch.isfinite(f_nodal.detach()).all()):
            raise ValueError("f_nodal contains NaN or infinite values")
        f = f_nodal.to(dtype=coords.dtype, device=coords.device)
    else:
        if not math.isfinite(float(f_nodal)):
            raise ValueError(f"f_nodal must be finite, got {f_nodal}")
        f = torch.full((E, nv), float(f_nodal), dtype=coords.dtype, device=coords.device)
    M = mass(coords, 1.0, cell)
    return torch.einsum("eij,ej->ei", M, f)


def _lame(young: torch.Tensor, nu: torch.Tensor, kind: str):
    mu = young / (2 * (1 + nu))
    if kind == "plane_stress":
        lam = young * nu / (1 - nu * nu)
    else:  # plane strain and 3-D
        lam = young * nu / ((1 + nu) * (1 - 2 * nu))
    return lam, mu


def _elasticity_coefs(E: int, dim: int, young: Coef, nu: Coef, kind: Optional[str], like: torch.Tensor):
    """Validated ``(kind, λ, μ)`` (``(E,)`` tensors) of :func:`elasticity_stiffness`."""
    if kind is None:
        if dim == 2:
            raise ValueError("kind must be 'plane_stress' or 'plane_strain' for 2-D cells")
        kind = "3d"
    if not isinstance(kind, str) or kind not in ("plane_stress", "plane_strain", "3d"):
        raise ValueError(f"kind must be 'plane_stress', 'plane_strain' or '3d', got {kind!r}")
    if (dim == 2) != (kind != "3d"):
        raise ValueError(f"kind={kind!r} does not fit the {dim}-D cell")
    Y = _coef("young", young, E, like)
    v = _coef("nu", nu, E, like)
    hi = 1.0 if kind == "plane_stress" else 0.5
    if E and not bool(((v.detach() > -1) & (v.detach() < hi)).all()):
        raise ValueError(f"nu must lie in (-1, {hi}) for kind={kind!r}")
    lam, mu = _lame(Y, v, kind)
    return kind, lam, mu


def elasticity_parts(coords: torch.Tensor, cell: Optional[str] = None):
    """Local. The two geometry-only parts ``(K_λ, K_μ)``, each ``(E, nv*dim, nv*dim)``, of the
    elasticity matrices: ``K = λ K_λ + μ K_μ`` for per-element ``λ, μ`` (node-major dofs)."""
    cell = _check_coords(coords, cell)
    dim = CELL_DIM[cell]
    wdet, _, G = _geometry(coords, cell, "stiffness")
    E, nq, nv, _ = G.shape
    # K_λ[i a, j b] = Σ_q w G_ia G_jb ; K_μ[i a, j b] = Σ_q w (G_ib G_ja + δ_ab G_i·G_j)
    Gw = (G * wdet[:, :, None, None]).reshape(E, nq, nv * dim)
    Gf = G.reshape(E, nq, nv * dim)
    KL = torch.bmm(Gw.transpose(1, 2), Gf)                                  # (E, nv*dim, nv*dim)
    KM = KL.reshape(E, nv, dim, nv, dim).transpose(2, 4).reshape(E, nv * dim, nv * dim)
    lap = _gram(G, wdet)
    eye = torch.eye(dim, dtype=coords.dtype, device=coords.device)
    KM = KM + (lap[:, :, None, :, None] * eye[None, None, :, None, :]).reshape(E, nv * dim, nv * dim)
    return KL, KM


def _elasticity_parts_blocked(coords: torch.Tensor, cell: str):
    """:func:`elasticity_parts` in the block-entry-major layout ``(dim, dim, E, nv, nv)``
    (``[a, b, e, i, j]`` = entry ``(i a, j b)``), written directly (no permuting copies)."""
    cell = _check_coords(coords, cell)
    dim = CELL_DIM[cell]
    wdet, _, G = _geometry(coords, cell, "stiffness")
    E, nq, nv, _ = G.shape
    g = G.permute(3, 1, 0, 2)                         # (dim, nq, E, nv)
    wg = g * wdet.T[None, :, :, None]
    KL = None
    for q in range(nq):                               # over quadrature points (1 for simplices)
        t = wg[:, q, None, :, :, None] * g[None, :, q, :, None, :]   # (dim, dim, E, nv, nv)
        KL = t if KL is None else KL + t
    KM = KL.transpose(0, 1).clone()                   # K_μ[a,b,e,i,j] ∋ Σ w G_ib G_ja = K_λ[b,a,e,i,j]
    lap = KL[0, 0]
    for a in range(1, dim):
        lap = lap + KL[a, a]
    for a in range(dim):
        KM[a, a] += lap
    return KL, KM


def elasticity_stiffness(coords: torch.Tensor, young: Coef, nu: Coef, cell: Optional[str] = None,
                         kind: Optional[str] = None) -> torch.Tensor:
    """Local. Isotropic linear elasticity element matrices ``(E, nv*dim, nv*dim)``.

    ``∫ λ div u div v + 2 μ ε(u):ε(v)``, dofs node-major (vertex ``i``, component
    ``d`` at ``i*dim + d``). ``young`` and ``nu``: numbers or ``(E,)`` tensors
    (differentiable). ``kind``: ``"plane_stress"`` or ``"plane_strain"`` for 2-D
    cells (required), ``"3d"`` for 3-D cells (the default there).
    """
    cell = _check_coords(coords, cell)
    dim = CELL_DIM[cell]
    try:
        kind, lam, mu = _elasticity_coefs(coords.shape[0], dim, young, nu, kind, coords)
    except ValueError as e:
        if "does not fit" in str(e):
            raise ValueError(f"kind={kind!r} does not fit the {dim}-D cell {cell!r}") from None
        raise
    KL, KM = elasticity_parts(coords, cell)
    return lam[:, None, None] * KL + mu[:, None, None] * KM
