"""Compressible neo-Hookean hyperelasticity (total Lagrangian), 2-D plane strain and 3-D.

Stored energy per unit reference volume (the compressible neo-Hookean model of
e.g. Bonet & Wood, and of the FEniCS hyperelasticity demo):

    W(F) = μ/2 (tr C - 3) - μ ln J + λ/2 (ln J)²,   C = FᵀF,  J = det F,

first Piola-Kirchhoff stress and its derivative (the consistent tangent modulus)

    P = μ (F - F⁻ᵀ) + λ ln J F⁻ᵀ
    A_iJkL = ∂P_iJ/∂F_kL = μ δ_ik δ_JL + λ F⁻¹_Lk F⁻¹_Ji - (λ ln J - μ) F⁻¹_Jk F⁻¹_Li.

Plane strain: ``F`` is the in-plane 2x2 block (``F_33 = 1``), so ``tr C - 3`` is
``tr C₂ - 2`` and ``J = det F₂``: the same formulas in 2-D. Linearised at ``F = I``
they give linear elasticity with Lamé parameters ``(λ, μ)``
(:meth:`Assembler.elasticity` with :func:`~slasolve.fem.problems.lame`).

Residual (owned dofs): ``R(u) = ∫ P(F)·∇_X v dV - ∫ b·v dV - ∫_Γ t·v dA`` with a dead
body force ``b`` and traction ``t`` (per unit reference volume / area), Dirichlet rows
handled as in :mod:`slasolve.fem.nonlinear` (lifting + symmetric elimination: the
tangent stays symmetric and exact). The tangent ``K = ∫ ∇v : A : ∇δu`` is symmetric.
Quadrature: one point on P1 simplices (``F`` is constant per cell), 2^dim Gauss points
on Q1 cells. ``μ`` and ``λ`` are per-cell tensors, differentiable (the residual is
differentiable in ``u``, ``μ``, ``λ`` and tensor-valued loads).

Without an autograd graph (grad mode off, as inside ``nonlinear_solve``'s Newton iterations and
line search; the tangent always) on float64 CPU simplices, ``residual``, ``jacobian`` and
``energy`` evaluate the same formulas on NumPy arrays laid out with the cell index last (as
:class:`~slasolve.fem.nonlinear.NonlinearDiffusion` does): equal to the torch path to rounding,
at a fraction of its per-operation cost. With grad mode on they record the torch graph.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import numpy as np
import torch

from .._comm import check_collective
from ..dsparse import DSparseTensor
from . import elements as _el
from .assembly import Assembler
from .bc import DirichletBC
from ..nonlinear.problem import solver_iterate
from .nonlinear import NonlinearProblem, _recall, checked_collectively

__all__ = ["NeoHookean", "neo_hookean_stress", "neo_hookean_tangent", "neo_hookean_energy"]


def _inv_det(F: torch.Tensor):
    J, Finv = _el._det_inv(F)
    return J, Finv


def _np_det(F: np.ndarray) -> np.ndarray:
    """Local. ``det F`` of ``(d, d, E)`` NumPy stacks (d = 2, 3; the cell index last) in the
    closed form of :func:`slasolve.fem.elements._det`."""
    a = F
    if F.shape[0] == 2:
        return a[0][0] * a[1][1] - a[0][1] * a[1][0]
    return (a[0][0] * (a[1][1] * a[2][2] - a[1][2] * a[2][1])
            - a[0][1] * (a[1][0] * a[2][2] - a[1][2] * a[2][0])
            + a[0][2] * (a[1][0] * a[2][1] - a[1][1] * a[2][0]))


def _np_inv(F: np.ndarray, det: np.ndarray) -> np.ndarray:
    """Local. ``F⁻¹`` of ``(d, d, E)`` NumPy stacks by the adjugate (the formulas of
    :func:`slasolve.fem.elements._det_inv`); ``det``: :func:`_np_det` of them, nonzero."""
    a = F
    adj = np.empty_like(F)
    if F.shape[0] == 2:
        adj[0, 0], adj[0, 1], adj[1, 0], adj[1, 1] = a[1][1], -a[0][1], -a[1][0], a[0][0]
    else:
        c = lambda i, j, k, l: a[i][j] * a[k][l] - a[i][l] * a[k][j]  # noqa: E731
        adj[0, 0], adj[0, 1], adj[0, 2] = c(1, 1, 2, 2), -c(0, 1, 2, 2), c(0, 1, 1, 2)
        adj[1, 0], adj[1, 1], adj[1, 2] = -c(1, 0, 2, 2), c(0, 0, 2, 2), -c(0, 0, 1, 2)
        adj[2, 0], adj[2, 1], adj[2, 2] = c(1, 0, 2, 1), -c(0, 0, 2, 1), c(0, 0, 1, 1)
    adj /= det
    return adj


def _np_contract(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """Local. ``Z[i, j, e] = Σ_a X[a, i, e] Y[a, j, e]`` for ``(n, p, E)`` and ``(n, q, E)`` NumPy
    stacks, one E-long row at a time: an ``(n, p, q, E)`` broadcast product then summed would pass
    through memory several times (at 5e5 cells, 150 MB per temporary)."""
    n, p, E = X.shape
    Z = np.empty((p, Y.shape[1], E))
    tmp = np.empty(E)
    for i in range(p):
        for j in range(Y.shape[1]):
            z = Z[i, j]
            np.multiply(X[0, i], Y[0, j], out=z)
            for a in range(1, n):
                z += np.multiply(X[a, i], Y[a, j], out=tmp)
    return Z


def _nan_into(un: np.ndarray, out: Optional[np.ndarray]) -> torch.Tensor:
    """Local. An all-NaN residual like ``un`` (in ``out`` when given)."""
    if out is None:
        out = np.empty_like(un)
    out.fill(math.nan)
    return torch.from_numpy(out)


def _sum2(x: np.ndarray):
    """Local. ``sum(x)`` in about twice the working precision, as ``(hi, lo)`` with ``hi + lo`` the
    sum: a pairwise tree whose additions keep their exact rounding errors (Knuth's TwoSum), those
    summed at the end. Independent of the BLAS and of the platform's ``long double``."""
    errs = []
    while x.size > 1:
        if x.size % 2:
            x = np.append(x, 0.0)
        a, b = x[0::2], x[1::2]
        s = a + b
        bb = s - a
        errs.append(((a - (s - bb)) + (b - bb)).sum())
        x = s
    return (float(x[0]) if x.size else 0.0), math.fsum(errs)


def neo_hookean_energy(F: torch.Tensor, mu, lmbda) -> torch.Tensor:
    """Local. ``W(F)`` for a batch of deformation gradients ``(..., d, d)``; ``mu``, ``lmbda``
    broadcast against ``F.shape[:-2]``."""
    J = _el._det(F)
    lnJ = torch.log(J)
    d = F.shape[-1]
    return 0.5 * mu * ((F * F).sum((-1, -2)) - d) - mu * lnJ + 0.5 * lmbda * lnJ * lnJ


def neo_hookean_stress(F: torch.Tensor, mu, lmbda) -> torch.Tensor:
    """Local. First Piola-Kirchhoff stress ``P(F)`` ``(..., d, d)``."""
    J, Finv = _inv_det(F)
    return mu[..., None, None] * F + (lmbda * torch.log(J) - mu)[..., None, None] * Finv.transpose(-1, -2)


def neo_hookean_tangent(F: torch.Tensor, mu, lmbda) -> torch.Tensor:
    """Local. ``A_iJkL = ∂P_iJ/∂F_kL``, shape ``(..., d, d, d, d)``."""
    J, Finv = _inv_det(F)
    lnJ = torch.log(J)
    d = F.shape[-1]
    eye = torch.eye(d, dtype=F.dtype, device=F.device)
    m = mu[..., None, None, None, None]
    A = m * torch.einsum("ik,JL->iJkL", eye, eye)
    A = A + lmbda[..., None, None, None, None] * torch.einsum("...Lk,...Ji->...iJkL", Finv, Finv)
    A = A - (lmbda * lnJ - mu)[..., None, None, None, None] * torch.einsum("...Jk,...Li->...iJkL", Finv, Finv)
    return A


class NeoHookean(NonlinearProblem):
    """Collective (constructor). Compressible neo-Hookean solid on a vector space (``block_size=dim``).

    Parameters
    ----------
    space : Assembler with ``block_size = dim``
    bc : DirichletBC, optional (prescribed displacements)
    mu, lmbda : number, per-cell tensor ``(E,)`` or callable of cell centroids
        Default Lamé parameters (override per call: ``residual(u, mu, lmbda)``).
    body_force : optional, anything :meth:`Assembler.load` accepts (per reference volume)
    traction : optional ``(t, where)`` or a list of them (see :class:`NonlinearProblem`)
    block_jacobian : bool (see :class:`NonlinearProblem`)
    on_inversion : {"nan", "raise"}
        What ``residual`` (and ``energy``) do at a displacement with ``det F <= 0`` at some
        quadrature point on some rank: ``"nan"`` (default) returns an all-NaN residual on
        every rank (``energy``: ``+inf``), so that a line search backtracks from an
        overshooting trial step (``nonlinear_solve``'s torch backend and PETSc's line
        searches do) and a converged result can never contain one; ``"raise"`` raises
        ``ValueError`` on every rank. ``jacobian`` always raises (Newton only linearises at
        accepted, non-inverted iterates).

    ``residual(u, mu=None, lmbda=None)`` and ``jacobian(u, mu=None, lmbda=None)`` follow
    the ``nonlinear_solve(residual, u0, *params, jacobian=...)`` convention; the residual is
    the gradient of :meth:`energy`, so give it as the line search's merit function:
    ``nonlinear_solve(P.residual, u0, mu, jacobian=P.jacobian, objective=P.energy)`` (a full
    Newton step often raises ``||F||`` while lowering the energy: backtracking on ``||F||``
    took 6-17 steps where the energy took 4-5), and for GAMG on the tangents
    ``linear_solver=dict(method="cg", pc="gamg", near_nullspace=rigid_body_modes(space))``.
    """

    def __init__(self, space: Assembler, bc: Optional[DirichletBC] = None, mu=1.0, lmbda=1.0,
                 body_force=None, traction=None, *, block_jacobian: bool = False, on_inversion: str = "nan"):
        check_collective(space.comm, None if isinstance(space, Assembler) and space.bs == space.dim else
                         ValueError("NeoHookean needs a vector space (block_size = mesh.dim)"))
        check_collective(space.comm, None if on_inversion in ("nan", "raise") else
                         ValueError(f"on_inversion must be 'nan' or 'raise', got {on_inversion!r}"),
                         agree={"on_inversion": on_inversion})
        super().__init__(space, bc, body_force, traction, block_jacobian=block_jacobian)
        self.on_inversion = on_inversion
        self.mu, self.lmbda = mu, lmbda
        self._np_geom = None    # the simplex kernels' geometry as NumPy (_np_data)
        self._gv_rest = None    # Gv[:, 1:] (_Gv_rest)

    def deformation_gradient(self, u: torch.Tensor) -> torch.Tensor:
        """Collective. ``F = I + ∇u`` at the quadrature points, ``(E, nq, dim, dim)`` (on simplices
        the ``nq`` points share one value, a broadcast view)."""
        return self._F(u).expand(-1, self.wdet.shape[1], -1, -1)

    def _F(self, u: torch.Tensor) -> torch.Tensor:
        """Collective. ``F`` at the gradient points ``(E, ng, dim, dim)`` (``ng = 1`` on simplices)."""
        ue = self.cell_values(self.lift(u))                                 # (E, nv, dim)
        E, _, d = ue.shape
        # from the vertices' displacements relative to the first (see _np_H)
        H = torch.bmm((ue[:, 1:] - ue[:, :1]).transpose(1, 2), self._Gv_rest())  # (E, dim, ng*dim): H[e, i, (q, J)]
        H = H.view(E, d, -1, d).transpose(1, 2)
        return H + torch.eye(d, dtype=H.dtype, device=H.device)

    def _Gv_rest(self) -> torch.Tensor:
        """Local. ``Gv[:, 1:]`` (the gradients of every vertex's shape function but the first),
        contiguous, made once."""
        if self._gv_rest is None:
            self._gv_rest = self.Gv[:, 1:].contiguous()
        return self._gv_rest

    def _F_checked(self, u, raise_on_inverted: bool = True):
        """Collective. ``(F, inverted)`` at the gradient points: ``inverted`` is True on every rank
        when some rank has ``det F <= 0`` at a quadrature point (then ``ValueError`` on every rank
        if asked)."""
        F = self._F(u)
        with torch.no_grad():
            J = _el._det(F)
        return F, self._inverted(J, raise_on_inverted)

    @staticmethod
    def _inversion_error(J) -> Optional[ValueError]:
        """Local. The problem with this rank's determinants ``J`` (torch or NumPy), or None."""
        bad = int((J <= 0).sum())
        if not bad:
            return None
        return ValueError(f"{bad} quadrature point(s) with det F <= 0 (min {float(J.min()):.3e}): "
                          "the displacement inverts elements")

    def _inverted(self, J, raise_on_inverted: bool) -> bool:
        """Collective. Whether some rank has a determinant ``J <= 0`` (this rank's: a torch tensor
        or NumPy array, no autograd); with ``raise_on_inverted`` a ``ValueError`` on every rank then."""
        err = self._inversion_error(J)
        bad = 0 if err is None else int((J <= 0).sum())
        if raise_on_inverted:
            check_collective(self.comm, err)
            return False
        n_bad = self.comm.allreduce(bad) if self.comm.Get_size() > 1 else bad
        return n_bad > 0

    # ------------------------------------- simplices without autograd (NumPy)
    # Every array has the cell index last ((d, d, E), (nv, d, E), ...): NumPy's elementwise loops
    # then run over E-long contiguous rows; with E first they run over 2-4 long ones (np.einsum
    # and broadcasting on (E, d, d) stacks took longer than the torch path).
    def _np_data(self):
        """Local. The simplex kernels' ``(G, w, L)`` as NumPy arrays (made once): the gradients
        ``G[a, J, e]`` ``(nv, dim, E)``, the cell volumes ``(E,)`` and the unit-coefficient
        stiffness ``L[a, b, e] = w G_a·G_b`` ``(nv, nv, E)``."""
        if self._np_geom is None:
            G = np.ascontiguousarray(self.G[:, 0].detach().numpy().transpose(1, 2, 0))
            L = np.ascontiguousarray(_el._gram(self.G, self.wg).detach().numpy().transpose(1, 2, 0))
            self._np_geom = (G, np.ascontiguousarray(self.wg[:, 0].detach().numpy()), L)
        return self._np_geom

    def _np_H(self, ul: np.ndarray) -> np.ndarray:
        """Collective. ``H[i, J, e] = Σ_a u_ai G_aJ = F - I`` ``(dim, dim, E)`` (simplices) from the
        lifted owned dofs, as ``Σ_(a>0) (u_a - u_0)_i G_aJ`` (the gradients sum to zero): the
        displacements' common part cancels before it is multiplied by the gradients ``~1/h``.
        Summed as written, ``H`` had rounding errors of ``eps |u| / h`` instead of ``eps |u_a - u_0| / h``:
        on the 2-D bench problem at 180k cells the residual at the solution was then 1.7e-14 off a
        long double evaluation (4e-16 now), which was the floor Newton's residual stopped at."""
        U = self._np_cell_values(ul, lifted=True)                            # (nv, dim, E)
        return _np_contract(U[1:] - U[0], self._np_data()[0][1:])

    def _np_kinematics(self, un: np.ndarray, memo: Optional[list] = None, exchange: bool = True):
        """Collective. ``(F, det F, F⁻¹)`` ``(dim, dim, E)``, ``(E,)``, ``(dim, dim, E)`` (simplices;
        ``F⁻¹`` is inf/NaN at inverted cells) at the owned dofs ``un`` (lifted here); not to be
        changed. ``memo``: a one-entry list keeping the latest ones (see :func:`_recall`);
        ``exchange``: see :meth:`NonlinearProblem._np_extended_at`."""
        ue = self._np_extended_at(un, memo, exchange)
        hit = _recall(memo, ue)
        if hit is not None:
            return hit
        U = self._np_cell_values(ue, extended=True)                          # (nv, dim, E)
        F = _np_contract(U[1:] - U[0], self._np_data()[0][1:])
        for i in range(F.shape[0]):
            F[i, i] += 1.0
        det = _np_det(F)
        with np.errstate(invalid="ignore", divide="ignore"):
            out = (F, det, _np_inv(F, det))
        if memo is not None:
            memo[0] = (ue.copy(), out)
        return out

    def _np_residual(self, un: np.ndarray, mu: np.ndarray, lmbda: np.ndarray, at_iterate: bool = False,
                     out: Optional[np.ndarray] = None, memo: Optional[list] = None) -> torch.Tensor:
        """Collective. :meth:`residual` on simplices without autograd (the same formulas in NumPy) at
        the owned dofs ``un``; ``out``: written there (a tensor over it returned). ``at_iterate`` (a
        solver's own iterate, the same on every rank): with ``on_inversion="nan"`` only the ranks with
        inverted cells return NaN, with no reduction (the solver's norm of the residual is NaN on
        every rank all the same)."""
        F, det, Finv = self._np_kinematics(un, memo)
        local = at_iterate and self.on_inversion == "nan"
        if local:
            inverted = self._inversion_error(det) is not None
        elif self._inverted(det, self.on_inversion == "raise"):
            return _nan_into(un, out)
        G, w, _ = self._np_data()
        with np.errstate(invalid="ignore", divide="ignore"):   # inverted cells (local): NaN below
            P = mu * F
            P += (lmbda * np.log(det) - mu) * Finv.transpose(1, 0, 2)
            P *= w
            # re[a, i, e] = Σ_J G[a, J, e] P[i, J, e]
            r = self._np_finish_residual(un, _np_contract(G.transpose(1, 0, 2), P.transpose(1, 0, 2)), out)
        return _nan_into(un, out) if local and inverted else r

    def _np_tangent_sums(self, un: np.ndarray, mu: np.ndarray, lmbda: np.ndarray, memo: Optional[list] = None,
                         exchange: bool = True):
        """Collective. The formulas of :meth:`_tangent_blocks` on simplices without autograd, from
        the owned dofs ``un``, summed straight into the matrix slots: ``(nnz + n_remote, dim, dim)`` (see
        :meth:`_np_finish_block_jacobian`); no ``(dim, dim, E, nv, nv)`` array is formed. Returns
        them and this rank's inversion error (or None), raised on every rank by the values' check;
        ``exchange``: see :meth:`NonlinearProblem._np_extended_at`."""
        F, det, Finv = self._np_kinematics(un, memo, exchange)
        err = self._inversion_error(det)
        G, w, L = self._np_data()
        d = F.shape[0]
        with np.errstate(invalid="ignore", divide="ignore"):   # inverted cells: raised by the caller
            # Bt[i, a, e] = B_ai = Σ_J G_aJ F⁻¹_Ji
            Bt = _np_contract(Finv, G.transpose(1, 0, 2))
            cw = (lmbda * np.log(det) - mu) * w
        lw = lmbda * w
        # K[i, k, e, a, b] = lw B_ai B_bk - cw B_ak B_bi + δ_ik μ L_ab, one (i, k) block at a time:
        # an (nv, nv, E) temporary summed into its slots by one bincount. K[k, i, e, a, b] =
        # K[i, k, e, b, a], so the blocks k < i are the sums of i < k at the transposed slots.
        Bl, Bc, lap = Bt * lw, Bt * cw, L * mu
        slots = self._np_block_slots()
        n = self.space.nnz + self.space.n_remote
        V = np.empty((n, d, d))
        t = np.empty(lap.shape)
        for i in range(d):
            for k in range(i, d):
                np.multiply(Bl[i][:, None, :], Bt[k][None, :, :], out=t)
                t -= Bc[k][:, None, :] * Bt[i][None, :, :]
                if i == k:
                    t += lap
                V[:, i, k] = np.bincount(slots, weights=t.reshape(-1), minlength=n)
        if d > 1:
            tr = self._np_transposed_slots()
            for i in range(d):
                for k in range(i + 1, d):
                    V[:, k, i] = V[tr, i, k]
        return V, err

    def _np_energy(self, u: torch.Tensor, mu: np.ndarray, lmbda: np.ndarray) -> torch.Tensor:
        """Collective. :meth:`energy` on simplices without autograd."""
        ul = self._np_lift(u.detach().numpy())
        H = self._np_H(ul)
        d = H.shape[0]
        F = H.copy()
        for i in range(d):
            F[i, i] += 1.0
        if self._inverted(_np_det(F), self.on_inversion == "raise"):
            return torch.full((), math.inf, dtype=u.dtype, device=u.device)
        # W without the O(1) terms that cancel (||F||² - d, tr H - ln J): with H = F - I,
        # ||F||² - d = 2 tr H + ||H||², J = 1 + j, j = tr H + q (q: the principal minors of H of
        # order >= 2), so W = μ/2 ||H||² + μ (j - ln(1 + j) - q) + λ/2 ln(1 + j)²; computed from
        # F instead, each cell's rounding error is eps d μ |T|, and their sum several ulp of E
        # (which made the line search reject steps near the solution)
        q = _np_det(H)                                                      # 2-D: the only one
        if d == 3:
            for i, k in ((0, 1), (0, 2), (1, 2)):
                q += H[i, i] * H[k, k] - H[i, k] * H[k, i]
        j = sum(H[i, i] for i in range(d)) + q
        lnJ = np.log1p(j)
        W = 0.5 * mu * (H * H).sum((0, 1)) + mu * ((j - lnJ) - q) + 0.5 * lmbda * lnJ * lnJ
        terms = self._np_data()[1] * W
        ext = self.external()
        if ext is not None:
            terms = np.concatenate([terms, -(ext.detach().numpy() * ul)])
        # Near the solution the line search compares energies that differ by far less than their
        # rounding (on the 3-D bench problem at ||F|| ~ 1e-12: 1e-5 ulp of E, against +-3 ulp of
        # noise from a plain sum, which made it reject every step). The cells' terms are accurate
        # to ~0.03 ulp of the total: summed in about twice the precision, nearby energies round to
        # the same double and a step that does not raise it is accepted.
        hi, lo = _sum2(terms)
        # the ranks' shares combined exactly, in rank order (the same value on every rank)
        e = math.fsum(v for pair in self.comm.allgather((hi, lo)) for v in pair) if self.comm.Get_size() > 1 \
            else hi + lo
        return torch.tensor(e, dtype=u.dtype)

    def _params(self, u, mu, lmbda, numpy: bool = False):
        """Collective. ``u`` checked and ``(mu, lmbda)`` per local cell (one collective check;
        ``numpy``: as NumPy arrays)."""
        return self._inputs(u, ("mu", mu, self.mu), ("lmbda", lmbda, self.lmbda), numpy=numpy)

    def _kernel_coefs(self, residual, jacobian, params: tuple, errors: bool = False):
        if not self.simplex or self.block_jacobian:
            return (None, None) if errors else None
        return self._np_kernel_coefs(((residual, NeoHookean.residual), (jacobian, NeoHookean.jacobian)), params,
                                     (("mu", self.mu), ("lmbda", self.lmbda)), errors)

    def iterate_kernels(self, residual, jacobian, params: tuple):
        """Local. See :meth:`NonlinearProblem.iterate_kernels`: on simplices with the scalar (AIJ)
        tangent, the NumPy path's formulas (the same operations: the same values)."""
        coefs = self._kernel_coefs(residual, jacobian, params)
        if coefs is None:
            return None
        mu, lmbda = coefs
        memo = [None]   # Newton's tangent is evaluated where its latest residual was

        def residual_into(x: np.ndarray, out: np.ndarray) -> None:
            self._np_residual(x, mu, lmbda, True, out, memo)

        def values(x: np.ndarray, exchange: bool):
            V, err = self._np_tangent_sums(x, mu, lmbda, memo, exchange)
            return self._np_block_values(V), err

        def tangent_values(x: np.ndarray) -> np.ndarray:
            return self._np_tangent_checked(x, memo, values)
        return self._bound_kernels(residual_into, tangent_values)

    @checked_collectively
    def residual(self, u: torch.Tensor, mu: Union[None, float, torch.Tensor] = None,
                 lmbda: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
        """Collective. Owned rows of internal minus external forces (Dirichlet rows ``u - g``)."""
        if self.simplex and self._fast(u):
            return self._np_residual(u.detach().numpy(), *self._params(u, mu, lmbda, numpy=True),
                                     at_iterate=solver_iterate(u, (mu, lmbda)))
        m, l = self._params(u, mu, lmbda)
        F, inverted = self._F_checked(u, self.on_inversion == "raise")
        if inverted:
            return torch.full_like(u, math.nan)
        E, ng, d = F.shape[0], F.shape[1], F.shape[2]
        P = neo_hookean_stress(F, m[:, None], l[:, None]) * self.wg[..., None, None]
        # re[e, v, i] = Σ_(q,J) G[e, v, (q, J)] P[e, q, i, J]
        re = torch.bmm(self.Gv, P.transpose(-1, -2).reshape(E, ng * d, d))
        return self._finish_residual(u, re.reshape(E, -1))

    @checked_collectively
    def jacobian(self, u: torch.Tensor, mu: Union[None, float, torch.Tensor] = None,
                 lmbda: Union[None, float, torch.Tensor] = None) -> DSparseTensor:
        """Collective. Consistent (symmetric) tangent with Dirichlet rows/columns eliminated."""
        if self.simplex and self._fast(u, graph=False):
            m, l = self._params(u, mu, lmbda, numpy=True)
            return self._np_finish_block_jacobian(*self._np_tangent_sums(u.detach().numpy(), m, l))
        m, l = self._params(u, mu, lmbda)
        with torch.no_grad():
            F, _ = self._F_checked(u.detach())
            Kb = self._tangent_blocks(F, m.detach(), l.detach())
        return self._finish_jacobian(Kb, blocked=True)

    def _tangent_blocks(self, F: torch.Tensor, mu: torch.Tensor, lmbda: torch.Tensor) -> torch.Tensor:
        """Local. Element tangents ``∫ ∇v : A : ∇δu`` in the Assembler's block-entry-major layout
        ``(dim, dim, E, nv, nv)`` (``[i, k, e, a, b]``: row ``a i``, column ``b k``).

        With the pulled-back gradients ``B = G F⁻¹`` (``B_ai = G_aJ F⁻¹_Ji``) the contraction
        with ``A`` is ``K[ai, bk] = Σ_q w (λ B_ai B_bk - (λ ln J - μ) B_ak B_bi + μ δ_ik G_a·G_b)``,
        so the 4th-order ``A`` is never formed."""
        E, ng, d = F.shape[0], F.shape[1], F.shape[2]
        nv = self.space.nv
        det, Finv = _el._det_inv(F)
        lw = lmbda[:, None] * self.wg                                       # (E, ng)
        cw = (lmbda[:, None] * torch.log(det) - mu[:, None]) * self.wg
        B = torch.matmul(self.G, Finv)                                      # (E, ng, nv, d)
        if ng == 1:
            Bt = B[:, 0].permute(2, 0, 1)                                   # (d, E, nv): Bt[i, e, a] = B_ai
            K = torch.mul((Bt * lw.T[:, :, None])[:, None, :, :, None], Bt[None, :, :, None, :])
            K.addcmul_((Bt * cw.T[:, :, None])[None, :, :, :, None], Bt[:, None, :, None, :], value=-1)
        else:
            # sums over the Gauss points as batched matmuls: O_w[e, ai, bk] = Σ_q w_q B_ai B_bk
            Bf = B.reshape(E, ng, nv * d)
            Ol = torch.bmm((Bf * lw[..., None]).transpose(1, 2), Bf).view(E, nv, d, nv, d)
            Oc = torch.bmm((Bf * cw[..., None]).transpose(1, 2), Bf).view(E, nv, d, nv, d)
            K = torch.empty((d, d, E, nv, nv), dtype=F.dtype, device=F.device)
            torch.sub(Ol.permute(2, 4, 0, 1, 3), Oc.permute(4, 2, 0, 1, 3), out=K)
        lap = _el._gram(self.G, mu[:, None] * self.wg)                      # μ ∫ ∇N_a·∇N_b
        for i in range(d):
            K[i, i] += lap
        return K

    def energy(self, u: torch.Tensor, mu=None, lmbda=None) -> torch.Tensor:
        """Collective. Total potential energy (replicated 0-d tensor) ``∫ W dV - ∫ b·u - ∫_Γ t·u``
        at the lifted ``u``; its gradient with respect to the free dofs is the residual."""
        from ..autograd import global_sum

        if self.simplex and self._fast(u):
            return self._np_energy(u, *self._params(u, mu, lmbda, numpy=True))
        m, l = self._params(u, mu, lmbda)
        ul = self.lift(u)
        F, inverted = self._F_checked(u, self.on_inversion == "raise")
        if inverted:
            return torch.full((), math.inf, dtype=u.dtype, device=u.device)
        e = (self.wg * neo_hookean_energy(F, m[:, None], l[:, None])).sum()
        ext = self.external()
        if ext is not None:
            e = e - (ext * ul).sum()
        return global_sum(e, self.comm)
