"""Adjoint of the symmetric (generalized) eigenproblem ``A v = w M v``.

``_EigshFunction`` maps A's local values (and M's) to ``(w, V)``; the forward
is the already computed solution, the backward is **collective** (every rank
calls it, as every rank called :func:`~slasolve.eigsh`) and first-order only:
with ``create_graph=True`` it raises ``RuntimeError`` instead of returning
gradients whose second derivatives would silently miss the eigen-Hessian.

Derivation (``V^T M V = I``, ``w`` simple)
------------------------------------------
First-order perturbation of a pair ``(w_j, v_j)``::

    dw_j = v_j^T (dA - w_j dM) v_j
    dv_j = sum_{i != j} v_i v_i^T (dA - w_j dM) v_j / (w_j - w_i) - 1/2 v_j (v_j^T dM v_j)

(the sum over *all* eigenvectors ``i``). For a loss with gradients ``g = dL/dw``
and ``G = dL/dV`` this gives ``dL = sum_j <S_j, dA> + <T_j, dM>`` with::

    S_j = g_j v_j v_j^T + u_j v_j^T
    T_j = -w_j (g_j v_j v_j^T + u_j v_j^T) - 1/2 (G_j . v_j) v_j v_j^T
    u_j = sum_{i != j} v_i (v_i^T G_j) / (w_j - w_i)

``u_j`` is the solution of the singular, symmetric system
``(A - w_j M) u_j = -(I - M v_j v_j^T) G_j`` with ``v_j^T M u_j = 0``. It is split
over the computed eigenvectors ``V`` (``k`` of them) and their M-orthogonal
complement:

* the part in ``span(V)`` is explicit: ``C = V^T G`` (one reduction),
  ``u_j += sum_{i != j} v_i C_ij / (w_j - w_i)``;
* the rest solves the deflated system ``P^T (A - w_j M) P y = -P^T G_j`` with
  the M-orthogonal projector ``P = I - V V^T M`` applied inside the operator,
  by the native (collective) MINRES of :mod:`slasolve.krylov.torch_methods`
  (unpreconditioned; ``grad_rtol`` / ``grad_maxiter``), then ``u_j += P y``. The
  deflated operator is nonsingular on the complement as long as ``w_j`` is not an
  eigenvalue outside the computed set; it is SPD there when the ``k`` computed
  eigenvalues are the smallest ones.

The value gradients are the entries of the (symmetrised) matrices at the
stored nonzeros, ``sym(S)[row_k, col_k]`` with ``sym(X) = (X + X^T) / 2`` --
i.e. the gradient of ``values -> eigsh((A + A^T)/2)``, which agrees with the
unsymmetrised one for every symmetric perturbation -- computed with
:func:`slasolve.autograd.matvec_value_grad` (ghost entries of ``v`` / ``u`` by
the halo exchange; never a dense matrix).

Defined behaviour at degenerate eigenvalues
-------------------------------------------
* Eigenvalue gradients: a cluster of returned eigenvalues within
  ``degenerate_rtol * max_l |w_l|`` of each other is a repeated eigenvalue,
  whose individual copies are not differentiable. Backward accepts equal
  incoming gradients ``g`` on the whole cluster -- then the result
  ``g sum_j v_j v_j^T = g P`` depends only on the eigenspace (``P`` its
  projector) and is the exact gradient of symmetric functions of the cluster
  (e.g. its sum) -- and raises :class:`ValueError` on every rank for unequal
  ones, and for a nonzero gradient on a cluster that continues beyond the
  returned set (the next eigenvalue ``w_next``, known from eigsh's
  verification, is a copy: ``k`` cuts the eigenspace).
* Eigenvector gradients: if any returned eigenvector ``j`` with a nonzero
  incoming gradient has a partner ``i`` among the returned ones with
  ``|w_i - w_j| <= degenerate_rtol * max_l |w_l|``, backward raises
  :class:`ValueError` on every rank (no NaN/Inf is ever returned silently).
  The same for a degeneracy with the next eigenvalue outside the returned set
  (``w_next``). Any other degeneracy with an eigenvalue *outside* the returned
  set shows up as a deflated MINRES that does not converge; that raises
  :class:`~slasolve.eigen.info.EigenConvergenceError` on every rank.
"""
from __future__ import annotations

import torch

from .. import _log
from .._comm import allreduce_sum, check_collective
from ..autograd import AdjointFunction, matvec_value_grad
from .info import EigenConvergenceError

__all__ = ["EigshFunction", "DEGENERATE_RTOL"]

#: relative eigenvalue gap below which eigenvector gradients are refused
DEGENERATE_RTOL = 1e-8


class _State:
    """Everything the backward needs (detached operators, options)."""

    def __init__(self, dA, dM, grad_rtol, grad_maxiter, degenerate_rtol, w_next=None):
        self.dA = dA
        self.w_next = w_next
        self.dM = dM
        self.grad_rtol = grad_rtol
        self.grad_maxiter = grad_maxiter
        self.degenerate_rtol = degenerate_rtol


class EigshFunction(AdjointFunction):
    """``(valsA, valsM, w, V, state) -> (w, V)``; see the module docstring."""

    @staticmethod
    def forward(ctx, valsA, valsM, w, V, state):
        ctx.state = state
        ctx.has_M = valsM is not None
        ctx.save_for_backward(w, V, valsA, valsM)
        return w.clone(), V.clone()

    name = "slasolve.eigsh"

    @staticmethod
    def comm(ctx):
        return ctx.state.dA.comm

    @staticmethod
    @_log.logged("slaAdjoint", "slaEigBackward")
    def adjoint(ctx, saved, gw, gV):
        st = ctx.state
        w, V, _, _ = saved
        with torch.no_grad(), _log.collect() as times:
            gA, gM = _eig_value_grads(st, w, V, gw, gV, ctx.needs_input_grad[0],
                                      ctx.has_M and ctx.needs_input_grad[1])
        info = getattr(st, "info", None)     # the forward's EigenInfo (eigsh sets it)
        if info is not None:
            info.times["backward"] = info.times.get("backward", 0.0) + times["total"]
        return gA, gM, None, None, None


def _eig_value_grads(st, w, V, gw, gV, want_A, want_M):
    dA, dM = st.dA, st.dM
    comm = dA.comm

    def rs(t):
        return allreduce_sum(comm, t)

    k = w.numel()
    dt = V.dtype
    Ls_A, Rs_A, Ls_M, Rs_M = [], [], [], []
    if gw is None:
        gw = torch.zeros_like(w)
    gw = gw.to(dt)
    err = None
    try:   # gw may differ between ranks (a rank-dependent loss): decide together
        _check_eigenvalue_grads(st, w, gw)
    except ValueError as e:
        err = e
    check_collective(comm, err)
    Ls_A.append(V * gw[None, :])
    Rs_A.append(V)
    coefM = -(gw * w)
    if gV is not None:
        gV = gV.to(dt)
        MV = dM @ V if dM is not None else V
        small = rs(torch.cat([V.mT @ gV, (gV * gV).sum(0, keepdim=True)], 0))
        C, gn2 = small[:k], small[k]
        active = gn2 > 0
        if bool(active.any()):
            scale = float(w.abs().max()) if k else 1.0
            diff = w[None, :] - w[:, None]            # diff[i, j] = w_j - w_i
            offd = ~torch.eye(k, dtype=torch.bool, device=w.device)
            near = (diff.abs() <= st.degenerate_rtol * max(scale, torch.finfo(dt).tiny)) & offd
            bad = near & (active[None, :] | active[:, None])
            if st.w_next is not None:
                cut = (w - st.w_next).abs() <= st.degenerate_rtol * max(scale, abs(st.w_next),
                                                                         torch.finfo(dt).tiny)
                if bool((cut & active).any()):
                    j = int(torch.nonzero(cut & active)[0])
                    raise ValueError(
                        f"eigsh backward: eigenvector gradient requested for w[{j}] = {float(w[j]):.16g}, "
                        f"which is (nearly) degenerate with the next eigenvalue {st.w_next:.16g} that was not "
                        "returned; the eigenvectors of a repeated eigenvalue are not differentiable. Request "
                        "more eigenpairs (larger k) so the whole eigenspace is returned and use a loss of the "
                        "spanned subspace, or break the degeneracy.")
            if bool(bad.any()):
                i, j = (int(t) for t in torch.nonzero(bad)[0])
                raise ValueError(
                    f"eigsh backward: eigenvector gradients requested for (nearly) degenerate eigenvalues "
                    f"w[{i}] = {float(w[i]):.16g} and w[{j}] = {float(w[j]):.16g} (relative gap "
                    f"{float(diff[i, j].abs()) / max(scale, 1e-300):.3g} <= {st.degenerate_rtol:g}); the "
                    "eigenvectors of a repeated eigenvalue are not differentiable. Use a loss of the "
                    "eigenvalues / of the spanned subspace only, or break the degeneracy.")
            U = _adjoint_vectors(st, w, V, MV, gV, C, active, rs)
            cvec = torch.diagonal(C)                   # G_j . v_j
            Ls_A += [0.5 * U, 0.5 * V]
            Rs_A += [V, U]
            coefM = coefM - 0.5 * cvec
            Ls_M += [-0.5 * U * w[None, :], -0.5 * V * w[None, :]]
            Rs_M += [V, U]
    gA = gM = None
    if want_A:
        gA = matvec_value_grad(dA, torch.cat(Ls_A, 1), torch.cat(Rs_A, 1)).to(dA.values.dtype)
    if want_M:
        Ls_M.insert(0, V * coefM[None, :])
        Rs_M.insert(0, V)
        gM = matvec_value_grad(dM, torch.cat(Ls_M, 1), torch.cat(Rs_M, 1)).to(dM.values.dtype)
    return gA, gM


def _check_eigenvalue_grads(st, w, gw):
    """ValueError unless the eigenvalue gradient is well defined: equal incoming
    gradients within each cluster of (nearly) equal returned eigenvalues (then
    ``sum_j g_j v_j v_j^T = g P`` with ``P`` the basis-independent projector onto the
    eigenspace), and none on a cluster that continues beyond the returned set
    (``w_next``, from eigsh's verification). Local (reduced, identical data)."""
    k = w.numel()
    if k == 0 or not bool((gw != 0).any()):
        return
    dt = w.dtype
    scale = max(float(w.abs().max()), abs(st.w_next) if st.w_next is not None else 0.0, torch.finfo(dt).tiny)
    thr = st.degenerate_rtol * scale
    gtol = 1e3 * torch.finfo(dt).eps * float(gw.abs().max())
    near = (w[None, :] - w[:, None]).abs() <= thr
    unequal = (gw[None, :] - gw[:, None]).abs() > gtol
    bad = near & unequal
    if bool(bad.any()):
        i, j = (int(t) for t in torch.nonzero(bad)[0])
        raise ValueError(
            f"eigsh backward: different gradients ({float(gw[i]):.6g}, {float(gw[j]):.6g}) for the (nearly) "
            f"repeated eigenvalues w[{i}] = {float(w[i]):.16g} and w[{j}] = {float(w[j]):.16g}; individual "
            "copies of a repeated eigenvalue are not differentiable (only symmetric functions of the "
            "cluster, e.g. its sum, are). Use such a loss or break the degeneracy.")
    if st.w_next is not None:
        cut = ((w - st.w_next).abs() <= thr) & (gw != 0)
        if bool(cut.any()):
            j = int(torch.nonzero(cut)[0])
            raise ValueError(
                f"eigsh backward: gradient requested for w[{j}] = {float(w[j]):.16g}, a copy of a repeated "
                f"eigenvalue whose other copies ({st.w_next:.16g}) were not returned (k cuts the eigenspace); "
                "it is not differentiable there. Request more eigenpairs (larger k) so the whole cluster is "
                "returned, or break the degeneracy.")


def _adjoint_vectors(st, w, V, MV, G, C, active, rs):
    """``U[:, j] = u_j`` (module docstring) for the active columns, 0 elsewhere."""
    from ..krylov.torch_methods import minres
    dA, dM = st.dA, st.dM
    k = w.numel()
    n_global = int(rs(torch.tensor([float(V.shape[0])], dtype=V.dtype))[0])
    # explicit part over the computed eigenvectors
    diff = w[None, :] - w[:, None]                    # (i, j): w_j - w_i
    eye = torch.eye(k, dtype=torch.bool, device=w.device)
    coef = torch.where(eye, torch.zeros_like(C), C / torch.where(eye, torch.ones_like(diff), diff))
    coef = coef * active[None, :].to(C.dtype)
    U = V @ coef
    n_rest = n_global - k
    if n_rest <= 0:
        return U

    def proj(x):      # P x = x - V (V^T M x)
        return x - V @ rs(MV.mT @ x[:, None])[:, 0]

    def projT(x):     # P^T x = x - M V (V^T x)
        return x - MV @ rs(V.mT @ x[:, None])[:, 0]

    maxiter = st.grad_maxiter if st.grad_maxiter is not None else max(10 * n_rest, 100)

    def reduce_sum(t):
        return rs(t)

    # accuracy of u_j relative to ||G_j||: the projected right-hand side may be ~0
    # (a loss of v_j's norm, e.g. (v_j ** 2).sum()), where a relative test cannot pass
    B = -torch.stack([projT(G[:, j]) for j in range(k)], 1) if k else G
    bn2 = rs(torch.stack([(B * B).sum(0), (G * G).sum(0)]))
    for j in range(k):
        if not bool(active[j]):
            continue
        b = B[:, j]
        wj = float(w[j])
        bn, gn = float(bn2[0, j]) ** 0.5, float(bn2[1, j]) ** 0.5
        if bn <= st.grad_rtol * gn:
            continue        # u_j's complement part is below the requested accuracy

        def op(y, wj=wj):
            py = proj(y)
            ky = dA @ py
            ky = ky - wj * (dM @ py if dM is not None else py)
            return projT(ky)

        y, info = minres(op, b, rtol=st.grad_rtol * gn / bn, maxiter=maxiter, reduce_sum=reduce_sum)
        if not info.converged:
            raise EigenConvergenceError(
                f"eigsh backward: the projected adjoint solve for eigenvector {j} (w = {wj:.16g}) did not "
                f"converge ({info.reason} after {info.iterations} MINRES iterations, residual norm "
                f"{info.residual_norm:.3g}, grad_rtol = {st.grad_rtol:g}); w[{j}] is probably (nearly) "
                "degenerate with an eigenvalue that was not computed: request more eigenpairs (larger k) "
                "or raise grad_rtol / grad_maxiter.")
        U[:, j] = U[:, j] + proj(y)
    return U

