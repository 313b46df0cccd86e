"""Nonlinear finite element problems: residuals and consistent tangents for Newton.

A problem object ``P`` offers ``P.residual(u, *params)`` (the owned rows of the
residual, a torch tensor differentiable in ``u`` and in the parameters) and
``P.jacobian(u, *params)`` (the consistent tangent ``dR/du`` as a
:class:`~slasolve.DSparseTensor` on the :class:`~slasolve.fem.Assembler`'s fixed
pattern), so that ::

    u = slasolve.nonlinear_solve(P.residual, u0, kappa, jacobian=P.jacobian)

solves ``R(u, kappa) = 0`` and differentiates ``u`` in ``kappa`` by the implicit
function theorem. Element kernels are vectorised over all local cells (no Python loop
over elements); assembly reuses the Assembler's pattern, reverse halo and cached
PETSc Mat.

Dirichlet conditions (both problems): a :class:`~slasolve.fem.DirichletBC` ``bc``
with values ``g``. The physics is evaluated at ``ũ = u`` with the constrained dofs
replaced by ``g`` (a lifting), and the constrained rows of the residual are
``u_D - g``. Hence ``dR_F/du_D = 0`` exactly, and the consistent tangent is the
assembled ``dR/du`` with the constrained rows and columns zeroed and 1 on their
diagonal (:meth:`DirichletBC.apply`): symmetric whenever the physics tangent is,
*and* the exact derivative of the residual (so the adjoint of ``nonlinear_solve`` is
right, also for gradients with respect to ``g``). Any ``u0`` works; after the first
Newton step ``u_D = g`` holds exactly. The first residual and tangent are evaluated at
``u0`` with ``g`` inserted (as when a Dirichlet condition is applied to the initial guess
in other codes): for large prescribed values on a fine mesh (one layer of cells taking
the whole jump, e.g. inverting elements in hyperelasticity) start from an extension of
``g`` into the domain or step the load.

:class:`NonlinearDiffusion` (this module): ``-div(κ (1 + u²) ∇u) = f`` with ``κ`` per
cell (the quasilinear model problem of the FEniCS tutorial). Its tangent
``∫ κ[(1+u²) ∇δu·∇v + 2 u δu ∇u·∇v]`` is **not symmetric** (use GMRES / BiCGStab;
``nonlinear_solve``'s adjoint solves with its transpose). The continuous problem has a
unique solution for any ``f`` (the Kirchhoff transform ``w = u + u³/3`` makes it linear,
``-div(κ ∇w) = f``, for constant ``κ``). Chosen over the p-Laplacian because its tangent
is bounded and non-degenerate (no regularisation parameter) and it exercises the
non-symmetric path. Quadrature: degree 2 on P1 simplices (the integrands are
quadratic), 2^dim Gauss points on Q1 cells. Hyperelasticity:
:mod:`slasolve.fem.hyperelastic`.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .._comm import check_collective
from ..dsparse import DSparseTensor
from . import elements as _el
from .assembly import Assembler
from .bc import DirichletBC
from .facets import BoundaryFacets, boundary_facets, neumann_load

__all__ = ["NonlinearProblem", "NonlinearDiffusion"]


def _quadrature(cell: str, dtype, device):
    """Quadrature for the nonlinear kernels: degree 2 on simplices (integrands of P1 cells
    are quadratic), 2^dim Gauss on Q1 cells. Returns ``(w, N, dN, dNcheck)``."""
    return _el._reference(cell, "mass" if cell in ("triangle", "tetra") else "stiffness", dtype, device)


class NonlinearProblem:
    """Collective (constructor). Shared machinery: the space, the Dirichlet lifting, the
    body / Neumann load terms and the cell geometry at the quadrature points.

    Parameters
    ----------
    space : Assembler
    bc : DirichletBC, optional
        Constrained dofs and values (``None``: no Dirichlet condition; the tangent may
        then be singular for pure Neumann problems).
    source : optional
        Volume source / body force, anything :meth:`Assembler.load` accepts.
    neumann : optional
        Boundary flux / traction terms: a ``(g, where)`` pair or a list of them
        (``where`` as in :func:`~slasolve.fem.boundary_facets`, ``None`` for the whole
        boundary; ``where`` may also be a :class:`BoundaryFacets`); ``g`` as in
        :func:`~slasolve.fem.neumann_load`.
    block_jacobian : bool
        Vector spaces: return the tangent as a block (BSR, ``(bs, bs)`` blocks)
        DSparseTensor on the Assembler's layout instead of the default scalar (AIJ) one on
        a scalar layout built at the first call (:func:`slasolve.nonlinear_solve` takes
        scalar Jacobians).
    """

    def __init__(self, space: Assembler, bc: Optional[DirichletBC] = None, source=None, neumann=None, *,
                 block_jacobian: bool = False):
        err = None
        if not isinstance(space, Assembler):
            err = TypeError(f"space must be an Assembler, got {type(space).__name__}")
        elif bc is not None and (not isinstance(bc, DirichletBC) or bc.space is not space):
            err = ValueError("bc must be a DirichletBC built on this space")
        check_collective(space.comm if isinstance(space, Assembler) else None, err)
        self.space = space
        self.comm = space.comm
        self.bc = bc
        self.source = source
        self.block_jacobian = bool(block_jacobian)
        self._scalar_template = None
        terms = [] if neumann is None else ([neumann] if isinstance(neumann, tuple) else list(neumann))
        self._neumann = []
        for g, where in terms:
            facets = where if isinstance(where, BoundaryFacets) else boundary_facets(space.mesh, where)
            self._neumann.append((g, facets))
        dt, dev = space.dtype, space.device
        w, N, dN, dNcheck = _quadrature(space.cell, dt, dev)
        X = space.cell_coords
        _el._check_orientation(X, space.cell, dNcheck)
        J = _el._jacobians(X, dN)
        det, Jinv = _el._det_inv(J)
        self.wdet = det * w                                           # (E, nq)
        self.N = N                                                    # (nq, nv)
        self.G = torch.einsum("qvk,eqkd->eqvd", dN, Jinv)             # (E, nq, nv, dim) reference-config gradients

    # ---------------------------------------------------------------- pieces
    def lift(self, u: torch.Tensor) -> torch.Tensor:
        """Local. ``u`` with the constrained dofs replaced by the Dirichlet values."""
        if self.bc is None:
            return u
        return torch.where(self.bc.constrained, self.bc.full().to(u.dtype), u)

    def cell_values(self, u: torch.Tensor) -> torch.Tensor:
        """Collective. ``(E, nv, bs)`` values of the owned-dof vector ``u`` at the local cells'
        vertices (ghosts fetched by the halo; differentiable)."""
        sp = self.space
        return sp.fetch_ghosts(u).reshape(-1, sp.bs)[sp.local_cells]

    def external(self) -> Optional[torch.Tensor]:
        """Collective. Owned-dof vector of the source and Neumann terms, ``∫ f·v + ∫_Γ g·v``
        (``None`` when there are none). Differentiable in tensor-valued data."""
        sp = self.space
        out = None
        if self.source is not None:
            f = self.source
            if isinstance(f, (list, tuple)):
                f = torch.as_tensor(f, dtype=sp.dtype, device=sp.device)
            elif callable(f) and not isinstance(f, torch.Tensor):
                # evaluate the callable here: whatever it raises, on any rank, is raised on every rank
                err, vals = None, None
                try:
                    v = f(sp.mesh.node_coords.to(sp.device))
                    v = v if isinstance(v, torch.Tensor) else torch.as_tensor(v)
                    n = sp.mesh.node_ids.shape[0]
                    if v.numel() != n * sp.bs:
                        raise ValueError(f"source(x) must return ({n},)" + ("" if sp.bs == 1 else
                                         f" or ({n}, {sp.bs})") + f" values, got shape {tuple(v.shape)}")
                    vals = v.to(dtype=sp.dtype, device=sp.device).reshape(n, sp.bs)[sp.local_cells]
                except Exception as e:  # noqa: BLE001
                    err = e
                check_collective(self.comm, err)
                f = vals
            out = sp.load(f)
        for g, facets in self._neumann:
            b = neumann_load(sp, g, facets=facets)
            out = b if out is None else out + b
        return out

    def _finish_residual(self, u: torch.Tensor, re: torch.Tensor) -> torch.Tensor:
        """Collective. Assemble internal cell vectors ``re`` minus the external terms; Dirichlet rows."""
        sp = self.space
        r = sp.assemble_vector(re, check=False)
        ext = self.external()
        if ext is not None:
            r = r - ext
        if self.bc is not None:
            r = torch.where(self.bc.constrained, u - self.bc.full().to(u.dtype), r)
        return r

    def _finish_jacobian(self, Ke: torch.Tensor) -> DSparseTensor:
        K = self.space.assemble_matrix(Ke, check=False)
        if self.bc is not None:
            K, _ = self.bc.apply(K)
        if self.space.bs > 1 and not self.block_jacobian:
            K = self._scalar(K)
        return K

    def _scalar(self, K: DSparseTensor) -> DSparseTensor:
        """Collective (first call). The block tangent as a scalar (AIJ) DSparseTensor on a
        scalar layout built once (``nonlinear_solve`` takes scalar Jacobians)."""
        sp = self.space
        bs = sp.bs
        if self._scalar_template is None:
            ps, perm = K.local._pattern.scalar(bs, bs)
            n = sp.n_global_dofs
            zeros = torch.zeros(ps.nnz, dtype=K.dtype, device=sp.device)
            self._scalar_template = (DSparseTensor.from_local_rows(ps.indptr, ps.indices, zeros, (n, n), sp.comm)
                                     .to(sp.device), perm.to(sp.device))
        T, perm = self._scalar_template
        return T.with_values(K.values.reshape(-1)[perm])

    def _check_u(self, u) -> None:
        sp = self.space
        err = None
        if not isinstance(u, torch.Tensor) or u.shape != (sp.n_owned_dofs,):
            err = ValueError(f"u must be a tensor of the owned dofs, shape ({sp.n_owned_dofs},), got "
                             f"{tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
        elif not bool(torch.isfinite(u.detach()).all()):
            err = ValueError("u contains NaN or infinite values")
        check_collective(self.comm, err)

    def _param(self, name: str, value, default):
        v = default if value is None else value
        sp = self.space
        E = sp.mesh.n_local_cells
        err = None
        try:
            v = sp._coef(name, v)
            v = _el._coef(name, v, E, sp.cell_coords)
        except (ValueError, TypeError) as e:
            err = e
        check_collective(self.comm, err)
        return v


class NonlinearDiffusion(NonlinearProblem):
    """Collective (constructor). ``-div(κ (1 + u²) ∇u) = f`` on a scalar space (see the module doc).

    ``residual(u, kappa=None)`` / ``jacobian(u, kappa=None)``: ``kappa`` per local cell
    ``(E,)`` (or a number / callable of cell centroids; default: the constructor's), may
    require grad. The Neumann data ``g`` is the flux ``κ (1+u²) ∂u/∂n = g``.
    """

    def __init__(self, space: Assembler, bc: Optional[DirichletBC] = None, kappa=1.0, source=None,
                 neumann=None):
        check_collective(space.comm, None if isinstance(space, Assembler) and space.bs == 1 else
                         ValueError("NonlinearDiffusion needs a scalar space (block_size=1)"))
        super().__init__(space, bc, source, neumann)
        self.kappa = kappa

    def _fields(self, u):
        ue = self.cell_values(self.lift(u))[..., 0]                  # (E, nv)
        uq = ue @ self.N.T                                            # (E, nq)
        gq = torch.einsum("eqvd,ev->eqd", self.G, ue)                 # (E, nq, dim)
        return ue, uq, gq

    def residual(self, u: torch.Tensor, kappa: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
        """Collective. Owned rows of ``R(u) = ∫ κ(1+u²)∇u·∇v - ∫ f v - ∫_Γ g v`` (Dirichlet rows ``u - g``)."""
        self._check_u(u)
        k = self._param("kappa", kappa, self.kappa)
        _, uq, gq = self._fields(u)
        flux = (k[:, None] * self.wdet * (1 + uq * uq))[..., None] * gq            # (E, nq, dim)
        re = torch.einsum("eqd,eqvd->ev", flux, self.G)
        return self._finish_residual(u, re)

    def jacobian(self, u: torch.Tensor, kappa: Union[None, float, torch.Tensor] = None) -> DSparseTensor:
        """Collective. Consistent tangent ``dR/du`` (not symmetric) with Dirichlet rows/columns eliminated."""
        self._check_u(u)
        k = self._param("kappa", kappa, self.kappa)
        with torch.no_grad():
            _, uq, gq = self._fields(u.detach())
            kw = k.detach()[:, None] * self.wdet                     # (E, nq)
            Ke = _el._gram(self.G, kw * (1 + uq * uq))
            # 2 u δu ∇u·∇v : row i (test v_i), column j (δu = N_j)
            a = torch.einsum("eqvd,eqd->eqv", self.G, gq)             # ∇u·∇N_i (E, nq, nv)
            Ke = Ke + torch.einsum("eq,eqi,qj->eij", 2 * kw * uq, a, self.N)
        return self._finish_jacobian(Ke)

    @staticmethod
    def flux(u: torch.Tensor, grad_u: torch.Tensor, kappa=1.0) -> torch.Tensor:
        """Local. The physical flux ``κ (1 + u²) ∇u`` (``(n,)``, ``(n, dim)`` -> ``(n, dim)``)."""
        return kappa * (1 + u * u)[..., None] * grad_u
