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

import math
from typing import Optional, Union

import numpy as np
import torch

from .._comm import check_collective
from ..dsparse import DSparseTensor
from ..nonlinear.problem import solver_iterate
from ..sparse import all_finite, all_finite_np
from . import elements as _el
from .assembly import Assembler
from .bc import DirichletBC
from .facets import BoundaryFacets, boundary_facets, neumann_load

__all__ = ["NonlinearProblem", "NonlinearDiffusion"]


def checked_collectively(method):
    """Mark a problem's ``residual`` / ``jacobian``: it checks its inputs collectively, raises on
    every rank alike and returns this rank's owned rows of one type and dtype on every rank
    (``raises_collectively``), so :func:`slasolve.nonlinear_solve` checks its results with no
    reduction of its own."""
    method.raises_collectively = True
    return method


def _sum_into(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """Local. ``zeros(n).index_add(0, index, weights)`` in NumPy (float64; ``bincount`` adds in
    sequence, as ``index_add``; on empty input it would return int64)."""
    return np.bincount(index, weights=weights, minlength=n).astype(np.float64, copy=False)


def _recall(memo: Optional[list], key: np.ndarray):
    """Local. What ``memo`` (a one-entry list ``[(key, value)]`` or ``[None]``, or None) keeps for
    ``key``, or None. The key is the extended dof array (after the halo exchange, which every
    rank makes alike), so whether it hits is this rank's own business: no collective depends on
    it. Equal keys give the same cell data, hence the same values bit for bit."""
    if memo is None or memo[0] is None:
        return None
    k, value = memo[0]
    return value if k.shape == key.shape and np.array_equal(k, key) else None


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

    Attributes
    ----------
    N : ``(nq, nv)`` shape functions at the quadrature points; ``wdet`` ``(E, nq)`` their
        weights times ``det J``.
    G : ``(E, ng, nv, dim)`` reference-configuration gradients at the ``ng`` gradient points
        (``ng = 1`` on simplices, where they are constant per cell; the Gauss points on Q1
        cells), a view of ``Gv`` ``(E, nv, ng*dim)``; ``wg`` ``(E, ng)`` their weights.
    """

    #: True while :meth:`iterate_kernels`' kernels run (see :meth:`_bound_kernels`): their halo
    #: exchanges then use the plans' bound (header-less) exchanges
    _np_bound = False

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
        self._ext = None        # the extended node array's cell rows (built on first use)
        self._bc_masks = {}     # dtype -> the Dirichlet elimination's masks
        self._slots = {}        # dtype -> the scalar tangent's kept entries (see _scalar_slots)
        self._np = None         # NumPy copies of the index arrays of the no-autograd path (_np_index)
        self._np_slots = None   # NumPy copies of _scalar_slots(float64)
        self._np_dofs = None    # vector spaces: the cells' dofs in the extended array (_np_cell_dofs)
        self._np_bslots = None  # vector spaces: the element blocks' matrix slots (_np_block_slots)
        self._np_tslots = None  # vector spaces: the transposed blocks' slots (_np_transposed_slots)
        self._np_masks = None   # NumPy copies of _dirichlet_masks(float64)
        self._np_perm = None    # NumPy copy of the scalar layout's permutation
        self._np_consts = {}    # coefficient name -> (number, its per-cell NumPy array)
        self._np_bcv = None     # (bc.values, its NumPy view)
        self._np_ext = None     # (external(), its NumPy view)
        self._external_kept = None   # (data key, external load) while the data are plain numbers
        terms = [] if neumann is None else ([neumann] if isinstance(neumann, tuple) else list(neumann))
        self._neumann = []
        for g, where in terms:
            facets = where if isinstance(where, BoundaryFacets) else boundary_facets(space.mesh, where)
            self._neumann.append((g, facets))
        dt, dev = space.dtype, space.device
        w, N, dN, dNcheck = _quadrature(space.cell, dt, dev)
        X = space.cell_coords
        _el._check_orientation(X, space.cell, dNcheck)
        # P1 gradients are constant per cell: one Jacobian and one gradient point per cell
        self.simplex = space.cell in ("triangle", "tetra")
        dNg = dN[:1] if self.simplex else dN
        det, Jinv = _el._det_inv(_el._jacobians(X, dNg))             # (E, ng)
        E, nv, dim = X.shape[0], N.shape[1], X.shape[2]
        ng = dNg.shape[0]
        self.w = w                                                    # (nq,) reference weights
        self.wdet = det * w                                           # (E, nq)
        self.N = N                                                    # (nq, nv)
        # gradient points: 1 on simplices (weight = cell volume), the nq Gauss points on Q1 cells
        self.wg = det * w.sum() if self.simplex else self.wdet        # (E, ng)
        # reference-configuration gradients stored as (E, nv, ng*dim) for batched matmuls;
        # self.G is the (E, ng, nv, dim) view of the same memory
        self.Gv = torch.matmul(dNg, Jinv).permute(0, 2, 1, 3).reshape(E, nv, ng * dim)
        self.G = self.Gv.view(E, nv, ng, dim).permute(0, 2, 1, 3)

    @property
    def block_size(self) -> int:
        """Local. Dofs per node (the space's block size), e.g. for :func:`slasolve.nonlinear_solve`'s
        ``linear_solver=dict(block_size=P.block_size)`` (the PETSc Jacobian Mat's block size)."""
        return int(self.space.bs)

    # ---------------------------------------------------------------- pieces
    def lift(self, u: torch.Tensor) -> torch.Tensor:
        """Local. ``u`` with the constrained dofs replaced by the Dirichlet values."""
        if self.bc is None:
            return u
        return u.index_put((self.bc._local,), self.bc.values.to(u.dtype))

    def _extended(self):
        """Local. ``(cells, n_ext)``: the local cells' vertices ``(E, nv)`` as rows of the
        extended node array ``[owned nodes | ghost nodes]`` (ghosts in the halo plan's order), and
        its row count; built once. One gather from it gives the cell values, one ``index_add``
        into it the local sums (no scatter through the local node numbering)."""
        if self._ext is None:
            sp = self.space
            n_owned, n_ghost = int(sp._owned_pos.numel()), int(sp._ghost_pos.numel())
            pos = torch.empty(n_owned + n_ghost, dtype=torch.long, device=sp.local_cells.device)
            pos[sp._owned_pos.to(pos.device)] = torch.arange(n_owned, device=pos.device)
            pos[sp._ghost_pos.to(pos.device)] = torch.arange(n_owned, n_owned + n_ghost, device=pos.device)
            cells = pos[sp.local_cells]
            self._ext = (cells, cells.reshape(-1), n_owned + n_ghost)
        return self._ext

    def cell_values(self, u: torch.Tensor) -> torch.Tensor:
        """Collective. ``(E, nv, bs)`` values of the owned-dof vector ``u`` at the local cells'
        vertices (ghosts fetched by the halo; differentiable)."""
        sp = self.space
        xo = u.reshape(-1, sp.bs)
        if self.comm.Get_size() > 1:
            xo = torch.cat([xo, sp.node_plan.forward(xo)])
        cells, flat, _ = self._extended()
        E, nv = cells.shape
        if sp.bs == 1:   # a 1-D index_select: several times faster than indexing rows
            return xo.reshape(-1).index_select(0, flat).view(E, nv, 1)
        return xo.index_select(0, flat).view(E, nv, sp.bs)

    def _assemble_cells(self, re: torch.Tensor) -> torch.Tensor:
        """Collective. Sum cell vectors ``(E, nv, bs)`` into the owned dofs (ghost-node sums to
        their owners by the reverse halo); the Assembler's ``assemble_vector`` without its checks,
        in one ``index_add`` over the extended node array (the same sums in the same order)."""
        sp = self.space
        _, flat, n_ext = self._extended()
        bs = sp.bs
        if bs == 1:
            buf = re.new_zeros(n_ext).index_add(0, flat, re.reshape(-1))[:, None]
        else:  # index_add along the last dim: over (n, bs) rows torch takes a slow row-by-row path
            fe = re.permute(2, 0, 1).reshape(bs, -1)
            buf = fe.new_zeros((bs, n_ext)).index_add(1, flat, fe).T
        n_owned = sp.n_owned_nodes
        owned = buf[:n_owned]
        if self.comm.Get_size() > 1:
            owned = owned + sp.node_plan.reverse(buf[n_owned:])
        return owned.reshape(-1)

    # ------------------------------------------- the no-autograd path (NumPy)
    def _fast(self, u: torch.Tensor, graph: bool = True) -> bool:
        """Local. Whether this evaluation records no autograd graph (``torch.no_grad``, as inside
        the Newton iterations; ``graph=False``: never one, as for tangents) on float64 CPU data:
        then the kernels run on NumPy arrays, whose per-operation cost is a fraction of torch's at
        the sizes where that cost dominates. Decided from the grad mode and the space, the same
        on every rank."""
        sp = self.space
        return not (graph and torch.is_grad_enabled()) and sp.dtype == torch.float64 \
            and sp.device.type == "cpu" and isinstance(u, torch.Tensor) and u.dtype == torch.float64 \
            and u.device.type == "cpu"

    def iterate_kernels(self, residual, jacobian, params: tuple):
        """Local. NumPy kernels for a nonlinear solver that keeps its iterates in NumPy arrays
        (``nonlinear_solve``'s PETSc backend: its Vecs' arrays), or None where there are none (then
        call ``residual`` / ``jacobian``). ``residual`` and ``jacobian`` must be this object's own
        methods and ``params`` what the solver passes them, after their evaluations at ``u0``
        passed their collective checks; the kernels give what those methods give at the solver's
        own iterates (``slasolve.nonlinear.problem.solver_iterate``), with the same
        collectives and errors (raised on every rank), without the methods' torch tensors:

        * ``residual_into(x, out)``: Collective. The owned rows of the residual at the owned dofs
          ``x`` (float64, not changed) written into ``out`` (float64, the same length).
        * ``tangent_values(x)``: Collective. The values (float64) of the tangent at ``x``, in the
          entry order of the DSparseTensor ``jacobian`` returns, checked.

        Every rank calls them alike (the same kernels in the same order), each ``x`` a float64
        array of this rank's owned dofs: their halo exchanges are the plans' header-less bound
        exchanges (``HaloPlan.bound_exchange``), which rely on that instead of checking it.

        Decided from the problem, the methods and the parameters' types, the same on every rank."""
        return None

    def start_error(self, residual, jacobian, params: tuple, u: torch.Tensor):
        """Local. ``(applies, error)``: whether :meth:`start_kernels` applies to these methods,
        parameters and ``u`` (decided from the methods and the types), and where it does, this
        rank's problem with ``u`` or the parameters that its collective check raises, or None."""
        if not (isinstance(u, torch.Tensor) and u.dtype == torch.float64 and u.device.type == "cpu"):
            return False, None
        coefs, err = self._kernel_coefs(residual, jacobian, params, errors=True)
        if coefs is None and err is None:
            return False, None
        return True, self._u_error(u, numpy=True) or err

    def start_kernels(self, residual, jacobian, params: tuple, u: torch.Tensor, checked: bool = False):
        """Collective. For a nonlinear solver that starts at ``u`` with ``params`` and evaluates there
        by :meth:`iterate_kernels`' kernels too: ``u`` and the parameters checked in one collective
        check, as the methods check them (a problem raises on every rank), then the template: the
        DSparseTensor whose entries the kernels' tangent values are (the layout and pattern of what
        the ``jacobian`` method returns; its values are not the tangent's). After it
        :meth:`iterate_kernels` answers alike on every rank. None where the kernels do not apply
        (decided from the methods and the types, alike on every rank; no reduction): then call the
        methods. ``checked``: the caller had :meth:`start_error` answer ``(True, error)`` and
        combined ``error`` into a collective check of its own, passed on every rank: no check here."""
        if not checked:
            applies, err = self.start_error(residual, jacobian, params, u)
            if not applies:
                return None
            check_collective(self.comm, err)
        return self._kernel_template()

    def _kernel_coefs(self, residual, jacobian, params: tuple, errors: bool = False):
        """Local. The coefficients :meth:`iterate_kernels` makes its kernels with, or None where
        there are none (:meth:`_np_kernel_coefs`, also for ``errors``); no collective."""
        return (None, None) if errors else None

    def _kernel_template(self) -> DSparseTensor:
        """Local. The DSparseTensor whose entries :meth:`iterate_kernels`' tangent values are."""
        return self._np_template()

    def _np_capable(self) -> bool:
        """Local. Whether the space's data are float64 on the CPU (the NumPy path's)."""
        sp = self.space
        return sp.dtype == torch.float64 and sp.device.type == "cpu"

    def _np_kernel_coefs(self, method_pairs, params: tuple, names, errors: bool = False):
        """Local. The coefficients ``names`` (``(name, default)`` pairs) as NumPy arrays per local cell
        from ``params`` for :meth:`iterate_kernels`, or None when the kernels do not apply: the
        methods are not this object's (``method_pairs``: ``(given, the class's function)``), the data
        are not float64 on the CPU, a coefficient is a callable (it may answer differently per call)
        or does not convert. ``errors``: ``(coefficients or None, this rank's problem with a
        coefficient or None)``, the problem only where the rest (decided from the types, alike on
        every rank) lets the kernels apply."""
        none = (None, None) if errors else None
        if not self._np_capable() or len(params) > len(names):
            return none
        for given, func in method_pairs:
            if getattr(given, "__self__", None) is not self or getattr(given, "__func__", None) is not func:
                return none
        values = tuple(params) + (None,) * (len(names) - len(params))
        for (name, default), value in zip(names, values):
            v = default if value is None else value
            if callable(v) and not isinstance(v, torch.Tensor):
                return none
        out = []
        for (name, default), value in zip(names, values):
            c, err = self._param_local(name, value, default, numpy=True)
            if err is not None:
                return (None, err) if errors else None
            out.append(c)
        return (out, None) if errors else out

    def _np_external(self):
        """Local (collective when the data are not plain numbers: see :meth:`external`). The external
        terms as a NumPy view, or None; and whether they are kept (the same on every call)."""
        ext = self.external()
        if ext is None:
            return None, self._constant_data_key() is not None
        hit = self._np_ext
        if hit is None or hit[0] is not ext:   # a view: kept while external() keeps the tensor
            hit = self._np_ext = (ext, ext.detach().numpy())
        return hit[1], self._constant_data_key() is not None

    def _np_index(self):
        """Local. ``(flat cells, (E, nv), n_ext, constrained dofs)`` as NumPy arrays (built once)."""
        if self._np is None:
            cells, flat, n_ext = self._extended()
            bc_idx = None if self.bc is None else self.bc._local.cpu().numpy()
            self._np = (flat.cpu().numpy(), tuple(cells.shape), n_ext, bc_idx)
        return self._np

    def _np_lift(self, u: np.ndarray) -> np.ndarray:
        """Local. :meth:`lift` on a NumPy owned-dof vector (a copy when there are constrained dofs)."""
        idx = self._np_index()[3]
        if idx is None:
            return u
        u = u.copy()
        u[idx] = self._np_bc_values()
        return u

    def _np_bc_values(self) -> np.ndarray:
        """Local. The Dirichlet values as a NumPy view (kept while ``bc.values`` is the same
        tensor: a view sees its in-place changes)."""
        g = self.bc.values
        hit = self._np_bcv
        if hit is None or hit[0] is not g:
            hit = self._np_bcv = (g, g.detach().numpy())
        return hit[1]

    def _np_cell_dofs(self) -> np.ndarray:
        """Local. Vector spaces: the local cells' dofs in the extended dof array ``[owned | ghost]``
        (node-major), laid out ``(nv, bs, E)``: the cell index last, so that NumPy's elementwise
        kernels run over long contiguous rows rather than over ``bs``- or ``nv``-long ones. Built once."""
        if self._np_dofs is None:
            flat, (E, nv), _, _ = self._np_index()
            bs = self.space.bs
            self._np_dofs = flat.reshape(E, nv).T[:, None, :] * bs + np.arange(bs)[None, :, None]
        return self._np_dofs

    def _np_halo(self, plan, kind: int, a: np.ndarray) -> np.ndarray:
        """Collective (the plan's neighbours). ``plan.forward_array(a)`` (``kind`` 0) or
        ``plan.reverse_array(a)`` (1); inside the Newton kernels (:meth:`_bound_kernels`) the plan's
        ``BoundExchange`` (``HaloPlan.bound_exchange``) instead, which checks nothing: there every rank makes
        the same exchanges in the same order (SNES's callbacks, ordered by its collective decisions)
        on float64 arrays of the plan's sizes (SNES's own vectors), what the checked exchanges'
        headers verify. The same values bit for bit either way."""
        if self._np_bound and a.dtype == np.float64:
            return plan.bound_exchange(kind, a.shape[1:]).run(a)
        return plan.forward_array(a) if kind == 0 else plan.reverse_array(a)

    def _bound_kernels(self, residual_into, tangent_values):
        """Local. ``(residual_into, tangent_values)`` (:meth:`iterate_kernels`' kernels) run with
        :attr:`_np_bound` set: their halo exchanges are the plans' bound ones (:meth:`_np_halo`).
        Only SNES's callbacks (and ``nonlinear_solve`` after SNES, alike on every rank) call them."""
        def bound(kernel):
            def run(*args):
                self._np_bound = True
                try:
                    return kernel(*args)
                finally:
                    self._np_bound = False
            return run
        if self.comm.Get_size() == 1:   # no exchanges
            return residual_into, tangent_values
        return bound(residual_into), bound(tangent_values)

    def _np_extended(self, u: np.ndarray) -> np.ndarray:
        """Collective. The lifted owned dofs ``u`` followed by the ghost nodes' (the extended dof
        array the cell values are taken from; ``u`` itself on one rank)."""
        if self.comm.Get_size() > 1:
            bs = self.space.bs
            u = np.concatenate([u, self._np_halo(self.space.node_plan, 0, u.reshape(-1, bs)).reshape(-1)])
        return u

    def _np_extended_at(self, u: np.ndarray, memo: Optional[list], exchange: bool = True) -> np.ndarray:
        """Collective when ``exchange`` (else local). :meth:`_np_extended` of ``lift(u)``; without
        ``exchange``, the ghost part is taken from ``memo``'s latest extended array (see
        :func:`_recall`) instead: right only where no rank's owned dofs changed since, which
        :meth:`_np_tangent_checked` decides."""
        ul = self._np_lift(u)
        if exchange or memo is None or memo[0] is None or self.comm.Get_size() == 1:
            return self._np_extended(ul)
        return np.concatenate([ul, memo[0][0][ul.shape[0]:]])

    def _np_tangent_checked(self, x: np.ndarray, memo: Optional[list], values) -> np.ndarray:
        """Collective. ``values(x, exchange)`` (a tangent's values and this rank's error, unchecked;
        ``exchange`` as :meth:`_np_extended_at`) checked as :meth:`_np_check_values` does.

        Newton evaluates its tangent where it evaluated its latest residual: the ghost values of
        that residual's exchange, kept in ``memo``, are then this iterate's on every rank whose owned
        dofs are unchanged, so the first attempt makes no forward exchange. Whether any rank's owned
        dofs changed rides on the values' check (one reduction, as before); if one did, the values
        (and errors, its floating-point warnings silenced) of that attempt are dropped and every rank
        evaluates again with the exchange."""
        if memo is None or memo[0] is None or self.comm.Get_size() == 1:
            v, err = values(x, True)
            return self._np_check_values(v, err)
        ul = self._np_lift(x)
        stale = not np.array_equal(ul, memo[0][0][:ul.shape[0]])
        with np.errstate(all="ignore"):   # stale ghosts may overflow; real overflows raise below
            v, err = values(x, False)
        if err is None and not all_finite_np(v):
            err = ValueError("the tangent has NaN or infinite values (the state or the coefficients "
                             "overflow)")
        if check_collective(self.comm, err, flag=stale, flag_voids_errors=True):
            v, err = values(x, True)
            return self._np_check_values(v, err)
        return v

    def _np_cell_values(self, u: np.ndarray, lifted: bool = False, extended: bool = False) -> np.ndarray:
        """Collective. :meth:`cell_values` of ``lift(u)`` (``lifted``: ``u`` is already lifted;
        ``extended``: ``u`` is :meth:`_np_extended`'s array, no communication) as NumPy: ``(E, nv)``
        for a scalar space; ``(nv, bs, E)`` for a vector one (cell index last, see :meth:`_np_cell_dofs`)."""
        bs = self.space.bs
        if not (lifted or extended):
            u = self._np_lift(u)
        if not extended:
            u = self._np_extended(u)
        if bs > 1:
            return u.take(self._np_cell_dofs())
        flat, shape, _, _ = self._np_index()
        return u.take(flat).reshape(shape)

    def _np_assemble_cells(self, re: np.ndarray) -> np.ndarray:
        """Collective. :meth:`_assemble_cells` on NumPy arrays, the cell vectors laid out as
        :meth:`_np_cell_values` gives cell values (scalar spaces: the same sums in the same order,
        ``bincount`` adds its weights in sequence as ``index_add`` does); the owned dofs, flat."""
        flat, _, n_ext, _ = self._np_index()
        bs = self.space.bs
        if bs == 1:
            buf = _sum_into(flat, re.reshape(-1), n_ext)
        else:
            buf = _sum_into(self._np_cell_dofs().reshape(-1), re.reshape(-1), n_ext * bs)
        n_owned = self.space.n_owned_nodes * bs
        owned = buf[:n_owned]
        if self.comm.Get_size() > 1:
            owned = owned + self._np_halo(self.space.node_plan, 1, buf[n_owned:].reshape(-1, bs)).reshape(-1)
        return owned

    def _np_finish_residual(self, u: np.ndarray, re: np.ndarray, out: Optional[np.ndarray] = None,
                            ext=False) -> torch.Tensor:
        """Collective. :meth:`_finish_residual` on NumPy arrays (``re`` as :meth:`_np_assemble_cells`
        takes it); ``out``: written there (the owned rows' length, float64), a tensor over it
        returned; ``ext``: the external terms as :meth:`_np_external` gives them (``False``: ask it)."""
        r = self._np_assemble_cells(re)
        if ext is False:
            ext = self._np_external()[0]
        if ext is not None:
            if out is None:
                r -= ext
            else:
                r = np.subtract(r, ext, out=out)
        if out is not None and r is not out:
            out[...] = r
            r = out
        if self.bc is not None:
            idx = self._np_index()[3]
            r[idx] = u[idx] - self._np_bc_values()
        return torch.from_numpy(r)

    def _np_finish_jacobian(self, Ke: np.ndarray, cell_last: bool = False) -> DSparseTensor:
        """Collective. :meth:`_finish_jacobian` of scalar element tangents ``(E, nv, nv)`` on NumPy
        arrays (with Dirichlet rows; otherwise the torch code on the same values); ``cell_last``:
        laid out ``(nv, nv, E)`` (:class:`NonlinearDiffusion`), summed in the same order."""
        sp = self.space
        if sp.bs != 1 or self.bc is None:
            if cell_last:
                Ke = np.ascontiguousarray(Ke.transpose(2, 0, 1))
            return self._finish_jacobian(torch.from_numpy(Ke))
        return self._np_checked_values(sp.template, self._np_scalar_values(Ke, cell_last))

    def _np_scalar_values(self, Ke: np.ndarray, cell_last: bool) -> np.ndarray:
        """Local (collective on several ranks: the reverse halo). The values of a scalar space's
        tangent with Dirichlet rows (``sp.template``'s entries, unchecked) from element tangents
        ``Ke`` laid out as :meth:`_np_finish_jacobian` takes them."""
        sp = self.space
        hit = self._np_slots
        if hit is None:
            kept, kept_slot, remote, remote_slot, zero, base = self._scalar_slots(torch.float64)
            hit = tuple(t.cpu().numpy() for t in (kept, kept_slot, remote, remote_slot, zero, base))
            # the same entries' positions in the (nv, nv, E) layout
            E, nv = self._np_index()[1]
            where = np.arange(E * nv * nv).reshape(nv, nv, E).transpose(2, 0, 1).reshape(-1)
            hit = self._np_slots = hit + (where[hit[0]], where[hit[2]])
        kept, kept_slot, remote, remote_slot, zero, base, kept_last, remote_last = hit
        if cell_last:
            kept, remote = kept_last, remote_last
        flat = Ke.reshape(-1)
        # the kept entries never land on the constrained diagonal (eliminated): base + sum as index_add
        v = base + _sum_into(kept_slot, flat.take(kept), sp.nnz)
        if self.comm.Get_size() > 1:
            r = _sum_into(remote_slot, flat.take(remote), sp.n_remote)
            r = self._np_halo(sp.nnz_plan, 1, r)
            v = v + np.where(zero, 0.0, r)
        return v

    def _np_check_values(self, v: np.ndarray, err: Optional[Exception] = None) -> np.ndarray:
        """Collective. ``v`` (tangent values) checked finite in one collective check together with
        ``err`` (this rank's problem found while computing them, e.g. inverted cells)."""
        if err is None and not all_finite_np(v):
            err = ValueError("the tangent has NaN or infinite values (the state or the coefficients "
                             "overflow)")
        check_collective(self.comm, err)
        return v

    def _np_checked_values(self, template: DSparseTensor, v: np.ndarray, err: Optional[Exception] = None
                           ) -> DSparseTensor:
        """Collective. ``template`` with the tangent values ``v`` (its shape, float64), checked
        as :meth:`_np_check_values` does: :meth:`DSparseTensor.with_values`'s reduction, without its
        checks of what this class made itself (shape, dtype)."""
        return template._with_checked_values(torch.from_numpy(self._np_check_values(v, err)))

    def _np_block_slots(self) -> np.ndarray:
        """Local. Vector spaces: the matrix slot (``< nnz``: owned block, else ``nnz +`` remote
        entry) of each element-matrix block ``(a, b)`` of each cell, laid out ``(nv, nv, E)`` (the
        cell index last, as :meth:`_np_cell_dofs`), flat. Built once."""
        if self._np_bslots is None:
            sp = self.space
            E, nv = sp.mesh.n_local_cells, sp.nv
            slot = sp._slot.cpu().numpy().reshape(E, nv, nv)
            self._np_bslots = np.ascontiguousarray(slot.transpose(1, 2, 0)).reshape(-1)
        return self._np_bslots

    def _np_transposed_slots(self) -> np.ndarray:
        """Local. Vector spaces: ``t[s]`` = the slot of the transposed block of slot ``s`` (the slot of
        block ``(b, a)`` where ``s`` is that of ``(a, b)``, in any cell: both depend on the two
        nodes only), over the ``nnz + n_remote`` slots of this rank's element sums. Built once."""
        if self._np_tslots is None:
            sp = self.space
            S = self._np_block_slots().reshape(sp.nv, sp.nv, -1)
            t = np.arange(sp.nnz + sp.n_remote)      # a slot no cell reaches holds zeros: any value works
            t[S.reshape(-1)] = S.transpose(1, 0, 2).reshape(-1)
            self._np_tslots = t
        return self._np_tslots

    def _np_finish_block_jacobian(self, V: np.ndarray, err: Optional[Exception] = None) -> DSparseTensor:
        """Collective. The tangent of the element sums ``V`` (see :meth:`_np_block_values`), checked
        together with ``err`` (this rank's problem found while computing ``V``, raised on every rank)."""
        v = self._np_check_values(self._np_block_values(V), err)
        return self._np_template()._with_checked_values(torch.from_numpy(v))

    def _np_template(self) -> DSparseTensor:
        """Local (collective at the first call on a vector space: :meth:`_scalar_layout`). The
        template whose entries :meth:`_np_block_values` gives."""
        sp = self.space
        return sp.template if self.block_jacobian else self._scalar_layout(sp.template)[0]

    def _np_block_values(self, V: np.ndarray) -> np.ndarray:
        """Collective. :meth:`_finish_jacobian` of element tangents already summed per matrix slot:
        ``V`` ``(nnz + n_remote, bs, bs)``, the owned blocks then the entries of other ranks' rows
        (the sums :meth:`Assembler._assemble_slots` makes), on NumPy arrays; the same Dirichlet
        elimination and scalar (AIJ) or block layout; the values of :meth:`_np_template`'s entries,
        unchecked."""
        sp = self.space
        nnz = sp.nnz
        v = V[:nnz]
        if self.comm.Get_size() > 1:
            v = v + self._np_halo(sp.nnz_plan, 1, V[nnz:])
        if self.bc is not None:
            if self._np_masks is None:
                zero, diag = self._dirichlet_masks(torch.float64)
                self._np_masks = (zero.cpu().numpy(), None if diag is None else diag.cpu().numpy())
            zero, diag = self._np_masks
            v = np.where(zero, 0.0, v)
            if diag is not None:
                v += diag
        if self.block_jacobian:
            return v
        if self._np_perm is None:
            self._np_perm = self._scalar_layout(sp.template)[1].cpu().numpy()
        return v.reshape(-1).take(self._np_perm)

    def _constant_data_key(self):
        """Local. A key of the source and Neumann data when all of them are plain numbers (or
        sequences of numbers): their load vector is then the same on every call and is kept.
        None when any is a tensor (it may require grad or change in place) or a callable (it
        may read state, e.g. the time)."""
        def plain(v):
            if isinstance(v, (bool, torch.Tensor)) or callable(v):
                return None
            if isinstance(v, (int, float)):
                return float(v)
            if isinstance(v, (list, tuple)) and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                    for x in v):
                return tuple(float(x) for x in v)
            return None
        parts = [None if self.source is None else plain(self.source)]
        if self.source is not None and parts[0] is None:
            return None
        for g, facets in self._neumann:
            pg = plain(g)
            if pg is None:
                return None
            parts.append((pg, id(facets)))
        return tuple(parts)

    def external(self) -> Optional[torch.Tensor]:
        """Collective. Owned-dof vector of the source and Neumann terms, ``∫ f·v + ∫_Γ g·v``
        (``None`` when there are none). Differentiable in tensor-valued data. Kept between
        calls while the data are plain numbers (decided alike on every rank: the data are)."""
        key = self._constant_data_key()
        kept = self._external_kept
        if key is not None and kept is not None and kept[0] == key:
            return kept[1]
        out = self._external()
        self._external_kept = (key, out) if key is not None else None
        return out

    def _external(self) -> Optional[torch.Tensor]:
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
        r = self._assemble_cells(re.reshape(re.shape[0], -1, sp.bs))
        ext = self.external()
        if ext is not None:
            r = r - ext
        if self.bc is not None:
            idx = self.bc._local
            r = r.index_put((idx,), u[idx] - self.bc.values.to(u.dtype))
        return r

    def _dirichlet_masks(self, dtype):
        """Local. ``(zero, diag)`` of the symmetric elimination, as :meth:`DirichletBC.apply`
        makes them: entries set to 0, then the values added on the constrained diagonal (a
        tensor of the values' shape; ``None`` for ``diagonal="keep"``, whose ``zero`` spares the
        diagonal). Built once per dtype."""
        bc = self.bc
        hit = self._bc_masks.get(dtype)
        if hit is None:
            if bc.diagonal == "keep":
                hit = (bc._zero & ~bc._diag, None)
            else:
                hit = (bc._zero, bc._diag.to(dtype) * float(bc.diagonal))
            self._bc_masks[dtype] = hit
        return hit

    def _scalar_slots(self, dtype):
        """Local. For a scalar space with Dirichlet rows: ``(kept, kept_slot, remote, remote_slot,
        zero, base)``: the element-matrix entries that land on owned nonzeros the elimination
        keeps and their slots, those that land on other ranks' rows and their slots there, the
        elimination's mask and its starting values (the constrained diagonal, or zeros). Built
        once per dtype."""
        hit = self._slots.get(dtype)
        if hit is None:
            sp = self.space
            zero, diag = self._dirichlet_masks(dtype)
            slot, nnz = sp._slot, sp.nnz
            local = slot < nnz
            keep = local.clone()
            keep[local] = ~zero[slot[local]]
            kept = torch.nonzero(keep).flatten()
            remote = torch.nonzero(~local).flatten()
            base = torch.zeros(nnz, dtype=dtype, device=slot.device) if diag is None else diag
            hit = self._slots[dtype] = (kept, slot[kept], remote, slot[remote] - nnz, zero, base)
        return hit

    def _finish_jacobian(self, Ke: torch.Tensor, blocked: bool = False) -> DSparseTensor:
        """Collective. Assemble element tangents ``Ke`` (``(E, nv*bs, nv*bs)``, or with ``blocked``
        the Assembler's block-entry-major ``(bs, bs, E, nv, nv)``); Dirichlet elimination as
        :meth:`DirichletBC.apply` does it (the same values), before the one final tensor is made.
        Scalar spaces sum only the entries the elimination keeps, onto the constrained diagonal."""
        sp = self.space
        if sp.bs == 1 and self.bc is not None:
            kept, kept_slot, remote, remote_slot, zero, base = self._scalar_slots(Ke.dtype)
            flat = Ke.reshape(-1)
            v = base.index_add(0, kept_slot, flat.index_select(0, kept))
            if self.comm.Get_size() > 1:
                r = flat.new_zeros(sp.n_remote).index_add(0, remote_slot, flat.index_select(0, remote))
                r = sp.nnz_plan.reverse(r)
                v = v + torch.where(zero, torch.zeros((), dtype=r.dtype, device=r.device), r)
            return sp.template.with_values(v)
        if blocked:
            K = sp._assemble_slots(Ke.reshape(sp.bs * sp.bs, -1))
        else:
            K = sp.assemble_matrix(Ke, check=False)
        v = K.values
        if self.bc is not None:
            zero, diag = self._dirichlet_masks(v.dtype)
            v = torch.where(zero, torch.zeros((), dtype=v.dtype, device=v.device), v)
            if diag is not None:
                v = v + diag
        if sp.bs > 1 and not self.block_jacobian:
            T, perm = self._scalar_layout(K)
            return T.with_values(v.reshape(-1)[perm])
        return K.with_values(v) if self.bc is not None else K

    def _scalar_layout(self, K: DSparseTensor):
        """Collective (first call). ``(template, perm)``: a scalar (AIJ) DSparseTensor on a scalar
        layout built once (``nonlinear_solve`` takes scalar Jacobians), and the permutation of the
        block values into its entries."""
        sp = self.space
        bs = sp.bs
        if self._scalar_template is None:
            ps, perm = K.local._pattern.scalar(bs, bs)
            n = sp.n_global_dofs
            zeros = torch.zeros(ps.nnz, dtype=K.dtype, device=sp.device)
            self._scalar_template = (DSparseTensor.from_local_rows(ps.indptr, ps.indices, zeros, (n, n), sp.comm)
                                     .to(sp.device), perm.to(sp.device))
        return self._scalar_template

    def _u_error(self, u, numpy: bool = False) -> Optional[Exception]:
        """Local. The problem with ``u``, or None (``numpy``: tested on its NumPy view)."""
        sp = self.space
        if not isinstance(u, torch.Tensor) or u.shape != (sp.n_owned_dofs,):
            return ValueError(f"u must be a tensor of the owned dofs, shape ({sp.n_owned_dofs},), got "
                              f"{tuple(u.shape) if isinstance(u, torch.Tensor) else type(u).__name__}")
        if not (all_finite_np(u.detach().numpy()) if numpy else all_finite(u)):
            return ValueError("u contains NaN or infinite values")
        return None

    def _check_u(self, u) -> None:
        """Collective. Raise on every rank when some rank's ``u`` is not its owned dofs or not finite."""
        check_collective(self.comm, self._u_error(u))

    def _param_local(self, name: str, value, default, numpy: bool = False):
        """Local. ``(coefficient per local cell, None)`` or ``(None, the problem with it)``;
        ``numpy``: the coefficient as a NumPy array (the no-autograd path)."""
        v = default if value is None else value
        sp = self.space
        if numpy and type(v) is float:   # a number: the same (read-only) array while it is the same
            hit = self._np_consts.get(name)
            if hit is not None and hit[0] == v:
                return hit[1], None
        try:
            c = _el._coef(name, sp._coef(name, v), sp.mesh.n_local_cells, sp.cell_coords, numpy)
            if numpy and type(v) is float:
                c.flags.writeable = False
                self._np_consts[name] = (v, c)
            return c, None
        except (ValueError, TypeError) as e:
            return None, e

    def _param(self, name: str, value, default):
        v, err = self._param_local(name, value, default)
        check_collective(self.comm, err)
        return v

    def _inputs(self, u, *params, numpy: bool = False):
        """Collective. Check ``u`` and convert the ``(name, value, default)`` coefficients, with one
        collective check for all of them (one Allreduce per residual / tangent); ``numpy``: as
        NumPy arrays, for the no-autograd path (:meth:`_fast`). At a nonlinear solver's own iterate
        with the parameters its evaluations at ``u0`` checked (:func:`solver_iterate`, the same
        answer on every rank) nothing is checked again: no reduction."""
        values = tuple(value for _, value, _ in params)
        if solver_iterate(u, values) and not any(  # a callable coefficient may answer differently
                callable(d if v is None else v) and not isinstance(d if v is None else v, torch.Tensor)
                for _, v, d in params):
            out = []
            for name, value, default in params:
                v, err = self._param_local(name, value, default, numpy)
                if err is not None:   # not reached: the same values passed at u0 on every rank
                    raise err
                out.append(v)
            return out
        err = self._u_error(u, numpy)
        out = []
        for name, value, default in params:
            v, e = self._param_local(name, value, default, numpy)
            err = err or e
            out.append(v)
        check_collective(self.comm, err)
        return out


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
        if self.simplex:
            # constant gradients: the cell integrals reduce to the unit-coefficient stiffness
            # L = |T| G Gᵀ and the volume-normalised mass M (|T| uᵀMu = ∫u², exact for degree 2)
            self._L = _el._gram(self.G, self.wg)                                    # (E, nv, nv)
            self._M = (self.N.T * self.w) @ self.N / self.w.sum()                   # (nv, nv)
        self._LM_np = None

    def _cell_u(self, u):
        return self.cell_values(self.lift(u))[..., 0]                               # (E, nv)

    def _np_LM(self):
        """Local. The no-autograd path's data (made once), the cell index last (see
        :meth:`_np_cell_dofs`): ``L`` ``(nv, nv, E)``, ``Mᵀ`` ``(nv, nv)`` and the cells' vertices
        in the extended node array ``(nv, E)``."""
        if self._LM_np is None:
            flat, (E, nv), _, _ = self._np_index()
            self._LM_np = (np.ascontiguousarray(self._L.detach().numpy().transpose(1, 2, 0)),
                           np.ascontiguousarray(self._M.detach().numpy().T),
                           np.ascontiguousarray(flat.reshape(E, nv).T))
        return self._LM_np

    def _np_terms(self, u: np.ndarray, memo: Optional[list] = None, exchange: bool = True):
        """Collective. :meth:`_simplex_terms` of the owned dofs ``u`` (lifted here) on the
        no-autograd path, laid out ``(nv, E)``: ``(M u, s, L u)`` (NumPy's elementwise loops then
        run over the E-long rows instead of nv-long ones, and no einsum is needed); ``L u`` is the
        caller's to change. ``memo``: a one-entry list keeping the latest terms (see :func:`_recall`);
        ``exchange``: see :meth:`_np_extended_at`."""
        L, Mt, cells = self._np_LM()
        u = self._np_extended_at(u, memo, exchange)
        hit = _recall(memo, u)
        if hit is not None:
            return hit[0], hit[1], hit[2].copy()
        ue = u.take(cells)                                                          # (nv, E)
        t = Mt @ ue                                                                 # (M u)_j, (nv, E)
        s = (t * ue).sum(0)
        s += 1
        Lu = np.add.reduce(L * ue, axis=1)                                          # (L u)_i
        if memo is not None:
            memo[0] = (u.copy(), (t, s, Lu.copy()))
        return t, s, Lu

    @staticmethod
    def _simplex_terms(ue, L, M):
        """Local. ``(M u, s = 1 + uᵀ M u, L u)`` per cell from the cell values ``ue`` ``(E, nv)``;
        written with operators torch tensors and NumPy arrays share (both paths run it)."""
        t = ue @ M                                                                  # (E, nv)
        # NumPy's batched matmul makes one BLAS call per cell; einsum loops in C
        Lu = np.einsum("eij,ej->ei", L, ue) if isinstance(ue, np.ndarray) else (L @ ue[:, :, None])[..., 0]
        return t, 1 + (t * ue).sum(-1), Lu

    @classmethod
    def _simplex_tangent(cls, ue, k, L, M):
        """Local. Element tangents ``(E, nv, nv)`` on simplices: κ(1+u²)∇δu·∇v -> κ s L and
        2κ u δu ∇u·∇v -> 2κ (L u)_i (M u)_j (row i: test v_i); torch or NumPy."""
        t, s, Lu = cls._simplex_terms(ue, L, M)
        return L * (k * s)[:, None, None] + (Lu * (2 * k)[:, None])[:, :, None] * t[:, None, :]

    def _kernel_template(self) -> DSparseTensor:
        return self.space.template   # as _np_finish_jacobian's (a scalar space with a Dirichlet condition)

    def _kernel_coefs(self, residual, jacobian, params: tuple, errors: bool = False):
        if not self.simplex or self.bc is None:
            return (None, None) if errors else None
        return self._np_kernel_coefs(((residual, NonlinearDiffusion.residual),
                                      (jacobian, NonlinearDiffusion.jacobian)), params, (("kappa", self.kappa),),
                                     errors)

    def iterate_kernels(self, residual, jacobian, params: tuple):
        """Local. See :meth:`NonlinearProblem.iterate_kernels`: on simplices with a Dirichlet
        condition, the NumPy path's formulas (the same operations: the same values)."""
        coefs = self._kernel_coefs(residual, jacobian, params)
        if coefs is None:
            return None
        (k,) = coefs
        ext, kept = self._np_external()
        L = self._np_LM()[0]
        memo = [None]   # Newton's tangent is evaluated where its latest residual was

        def residual_into(x: np.ndarray, out: np.ndarray) -> None:
            _, s, Lu = self._np_terms(x, memo)
            Lu *= k * s
            self._np_finish_residual(x, Lu.T, out, ext if kept else False)

        def values(x: np.ndarray, exchange: bool):
            t, s, Lu = self._np_terms(x, memo, exchange)
            Lu *= 2 * k
            Ke = L * (k * s)
            Ke += Lu[:, None, :] * t[None, :, :]
            return self._np_scalar_values(Ke, True), None

        def tangent_values(x: np.ndarray) -> np.ndarray:
            return self._np_tangent_checked(x, memo, values)
        return self._bound_kernels(residual_into, tangent_values)

    @checked_collectively
    def residual(self, u: torch.Tensor, kappa: Union[None, float, torch.Tensor] = None) -> torch.Tensor:
        """Collective. Owned rows of ``R(u) = ∫ κ(1+u²)∇u·∇v - ∫ f v - ∫_Γ g v`` (Dirichlet rows ``u - g``)."""
        if self.simplex and self._fast(u):
            (k,) = self._inputs(u, ("kappa", kappa, self.kappa), numpy=True)
            un = u.detach().numpy()
            _, s, Lu = self._np_terms(un)
            Lu *= k * s
            return self._np_finish_residual(un, Lu.T)    # summed cell by cell, as index_add does
        (k,) = self._inputs(u, ("kappa", kappa, self.kappa))
        ue = self._cell_u(u)
        E = ue.shape[0]
        if self.simplex:
            # ∫ κ(1+u²) ∇u·∇N_i = κ (1 + mean of u²) (L u)_i
            _, s, Lu = self._simplex_terms(ue, self._L, self._M)
            re = (k * s)[:, None] * Lu
        else:
            c = k[:, None] * self.wdet * (1 + (ue @ self.N.T) ** 2)                    # (E, nq)
            gq = torch.bmm(ue[:, None, :], self.Gv).reshape(E, -1, self.space.dim)  # (E, nq, dim)
            re = torch.bmm(self.Gv, (c[..., None] * gq).reshape(E, -1, 1)).reshape(E, -1)
        return self._finish_residual(u, re)

    @checked_collectively
    def jacobian(self, u: torch.Tensor, kappa: Union[None, float, torch.Tensor] = None) -> DSparseTensor:
        """Collective. Consistent tangent ``dR/du`` (not symmetric) with Dirichlet rows/columns eliminated."""
        if self.simplex and self._fast(u, graph=False):
            (k,) = self._inputs(u, ("kappa", kappa, self.kappa), numpy=True)
            t, s, Lu = self._np_terms(u.detach().numpy())
            # _simplex_tangent laid out (nv, nv, E): K_ij = κ s L_ij + 2κ (L u)_i (M u)_j
            Lu *= 2 * k
            Ke = self._np_LM()[0] * (k * s)
            Ke += Lu[:, None, :] * t[None, :, :]
            return self._np_finish_jacobian(Ke, cell_last=True)
        (k,) = self._inputs(u, ("kappa", kappa, self.kappa))
        with torch.no_grad():
            ue = self._cell_u(u.detach())
            k = k.detach()
            E, nv = ue.shape
            if self.simplex:
                Ke = self._simplex_tangent(ue, k, self._L, self._M)
            else:
                nq, dim = self.N.shape[0], self.space.dim
                uq = ue @ self.N.T                                                     # (E, nq)
                kw = k[:, None] * self.wdet
                gq = torch.bmm(ue[:, None, :], self.Gv).reshape(E, 1, nq, dim)
                G4 = self.Gv.view(E, nv, nq, dim)
                a = (G4 * gq).sum(-1)                                                  # ∇u·∇N_i (E, nv, nq)
                Ke = (a * (2 * kw * uq)[:, None, :]) @ self.N                          # 2κ u δu ∇u·∇v
                Gw = (G4 * (kw * (1 + uq * uq))[:, None, :, None]).reshape(E, nv, nq * dim)
                Ke = torch.baddbmm(Ke, Gw, self.Gv.transpose(1, 2))
        return self._finish_jacobian(Ke)

    @staticmethod
    def flux(u: torch.Tensor, grad_u: torch.Tensor, kappa=1.0) -> torch.Tensor:
        """Local. The physical flux ``κ (1 + u²) ∇u`` (``(n,)``, ``(n, dim)`` -> ``(n, dim)``)."""
        return kappa * (1 + u * u)[..., None] * grad_u
