"""The residual / Jacobian callables of one nonlinear solve, with counters and checks.

Every call here is collective when the user's functions are (they usually exchange
ghosts): the backends call them in the same order on every rank, deciding everything
from reduced scalars.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from .._comm import allreduce_int, allreduce_sum, check_collective, raise_collected
from ..dsparse import DSparseTensor

__all__ = ["Problem", "global_norm", "raises_collectively", "solver_iterate"]

_NOT_GIVEN = object()
# (u, params) while a solver evaluates its residual / Jacobian at one of its own iterates
_ITERATE = [None]


def solver_iterate(u: torch.Tensor, params: tuple) -> bool:
    """Local. Whether ``u`` is the iterate a nonlinear solver is evaluating its residual or
    Jacobian at right now, with ``params`` (compared by identity) the parameters it passes: then
    ``u`` is the solver's own vector (this rank's owned rows, ``u0``'s dtype; NaN/Inf in it reach
    the solver's norms on every rank alike) and the parameters passed the collective checks of the
    same solve's evaluations at ``u0``, so a ``raises_collectively`` callable may skip checking
    them again (no reduction). Decided alike on every rank: every rank evaluates at its iterates
    at the same points, with the same parameters."""
    it = _ITERATE[0]
    if it is None or u is not it[0] or len(params) < len(it[1]):
        return False
    return all(a is b for a, b in zip(params, it[1])) and all(p is None for p in params[len(it[1]):])


def raises_collectively(fn) -> bool:
    """Local. Whether ``fn`` declares (an attribute ``raises_collectively = True``, as the
    residual and Jacobian methods of :mod:`slasolve.fem`'s problems do) that it checks its
    inputs collectively, raises on every rank alike, and returns results whose type, shape and
    dtype are the same function of its inputs on every rank: then a problem with its result is
    the same on every rank, and checking it needs no reduction."""
    return getattr(fn, "raises_collectively", False) is True


def global_norm(comm, r: torch.Tensor) -> float:
    """Collective. The global 2-norm of the owned rows ``r`` (one Allreduce; NaN/Inf propagate)."""
    s = allreduce_sum(comm, (r.detach().to(torch.float64) ** 2).sum().reshape(1))
    return math.sqrt(float(s[0]))


class Problem:
    """Collective calls of ``residual(u, *params)`` and ``jacobian(u, *params)`` at detached
    parameters, without autograd, checked collectively (shape, dtype, pattern; a
    :func:`raises_collectively` callable's results with no reduction, their problems being the
    same on every rank)."""

    def __init__(self, residual, jacobian, params, comm, n_local: int, dtype: torch.dtype, objective=None):
        self._residual, self._jacobian, self._objective = residual, jacobian, objective
        self.params = params
        self.comm, self.n_local, self.dtype = comm, n_local, dtype
        self.nfev = 0
        self.njev = 0
        self.nobj = 0
        self._pattern = None  # (layout, indptr, indices) of the first Jacobian
        # set by the backend once the residual and Jacobian at u0 passed their collective checks:
        # later evaluations are at the solver's own iterates (solver_iterate)
        self.iterating = False
        # callables whose problems are the same on every rank: checked here without a reduction
        self._local_checks = (raises_collectively(residual), raises_collectively(jacobian))
        # the residual and Jacobian are methods of one object that check the same inputs alike
        # (a slasolve.fem problem's): the Jacobian at the u whose residual passed those checks
        # (u0) need not check them again
        owner = getattr(residual, "__self__", None)
        self._one_owner = all(self._local_checks) and owner is not None and owner is getattr(jacobian, "__self__", None)
        self._checked_u = None   # the u of the latest residual evaluation that passed (one_owner)

    def iterate_kernels(self):
        """Local. The NumPy kernels of the residual's owner for this solve's own iterates
        (:meth:`slasolve.fem.NonlinearProblem.iterate_kernels`: ``(residual_into, tangent_values)``),
        or None: only for a residual and Jacobian that are methods of one object checking their
        inputs collectively, in float64. Ask once the evaluations at ``u0`` passed their checks;
        decided alike on every rank (from the problem and the parameters' types)."""
        if not self._one_owner or self.dtype != torch.float64:
            return None
        make = getattr(self._residual.__self__, "iterate_kernels", None)
        if make is None:
            return None
        return make(self._residual, self._jacobian, self.params)

    def start_error(self, u0: torch.Tensor):
        """Local. ``(applies, error)``: whether :meth:`start_kernels` evaluates at ``u0`` by the kernels
        (:meth:`slasolve.fem.NonlinearProblem.start_error`; decided from the methods and the
        parameters' types), and where it does, this rank's problem with ``u0`` or the parameters, or
        None. For a caller that combines the error (and ``applies``, as a setting every rank must
        agree on) into a collective check it makes anyway, then calls ``start_kernels(u0, checked=True)``
        where ``applies``."""
        if not self._one_owner or self.dtype != torch.float64:
            return False, None
        make = getattr(self._residual.__self__, "start_error", None)
        if make is None:
            return False, None
        return make(self._residual, self._jacobian, self.params, u0)

    def start_kernels(self, u0: torch.Tensor, checked: bool = False):
        """Collective. For a solver that evaluates ``F`` and the Jacobian by the NumPy kernels of the
        residual's owner from ``u0`` on (:meth:`slasolve.fem.NonlinearProblem.start_kernels`: ``u0``
        and the parameters checked in one collective check instead of the methods' checks):
        ``(template, kernels)``, ``template`` the DSparseTensor whose entries the kernels' tangent
        values are (the Jacobian's layout and pattern) and ``kernels`` as :meth:`iterate_kernels`
        gives them; or None (then evaluate by :meth:`residual_local` and :meth:`jacobian`), decided
        as :meth:`iterate_kernels` is, alike on every rank. A problem with ``u0`` or the parameters
        raises on every rank, as the methods'. ``checked``: :meth:`start_error` said the kernels
        apply, and its error was combined into a collective check that passed on every rank (no
        check here). Nothing is evaluated (nor counted) here."""
        if not self._one_owner or self.dtype != torch.float64:
            return None
        make = getattr(self._residual.__self__, "start_kernels", None)
        if make is None:
            return None
        template = make(self._residual, self._jacobian, self.params, u0, checked=checked)   # the collective check
        if template is None:
            return None
        kernels = self.iterate_kernels()   # decided alike now: the inputs passed on every rank
        if kernels is None:   # not reached: the check asked what the kernels are made of
            raise RuntimeError("slasolve internal: start_kernels passed without iterate_kernels")
        if self._pattern is None:
            self._pattern = (template._layout, template.local.indptr, template.local.indices, template.comm)
        return template, kernels

    def without_objective(self) -> "Problem":
        """Local. The same residual, Jacobian and parameters without an objective; its call
        counters continue from this one's."""
        plain = Problem(self._residual, self._jacobian, self.params, self.comm, self.n_local, self.dtype)
        plain.nfev, plain.njev = self.nfev, self.njev
        return plain

    def _call(self, fn, u: torch.Tensor, iterate: bool = False):
        """Local. ``(fn(u, *params), None)`` without autograd, or ``(None, exception)``: the
        caller combines it across ranks (user code raising on one rank ends it everywhere).
        ``iterate``: ``u`` and the parameters passed the checks already (:func:`solver_iterate`)."""
        outer = _ITERATE[0]
        if self.iterating or iterate:
            _ITERATE[0] = (u, self.params)
        try:
            if not torch.is_grad_enabled():   # inside the Newton iterations (see petsc_snes)
                return fn(u, *self.params), None
            with torch.no_grad():
                return fn(u, *self.params), None
        except Exception as e:  # noqa: BLE001 - user code
            return None, e
        finally:
            _ITERATE[0] = outer

    def residual(self, u: torch.Tensor, *, check: bool = True) -> torch.Tensor:
        """Collective. ``residual(u, *params)`` (no autograd), its result checked when ``check``;
        an exception on any rank is raised on every rank (one integer Allreduce)."""
        if check:
            r, err = self.residual_local(u)
        else:
            self.nfev += 1
            r, err = self._call(self._residual, u)
        if self._local_checks[0]:   # the same problem on every rank (raises_collectively)
            if err is not None:
                raise err
        else:
            check_collective(self.comm, err)   # also when not checking: a raise on one rank ends it everywhere
        return r.detach() if r.requires_grad else r

    def residual_local(self, u: torch.Tensor):
        """Local (the user's function may communicate: call it on every rank alike). ``(r, None)``
        with ``r = residual(u, *params)`` checked (shape, dtype), or ``(None, the problem)``: a
        deferred check, whose error the caller combines with a later reduction."""
        self.nfev += 1
        r, err = self._call(self._residual, u)
        if err is None:
            if not isinstance(r, torch.Tensor):
                err = TypeError(f"residual must return a torch.Tensor, got {type(r).__name__}")
            elif r.shape != (self.n_local,):
                err = ValueError(f"residual must return this rank's {self.n_local} owned rows, shape "
                                 f"({self.n_local},), got {tuple(r.shape)}")
            elif r.dtype != self.dtype:
                err = TypeError(f"residual returned dtype {r.dtype}, u0 is {self.dtype}")
            else:
                if self._one_owner:
                    self._checked_u = u
                return (r.detach() if r.requires_grad else r), None
        return None, err

    @property
    def has_objective(self) -> bool:
        return self._objective is not None

    def objective(self, u: torch.Tensor) -> float:
        """Collective. ``objective(u, *params)`` (no autograd) as a float, the same on every rank:
        a real scalar (0-d tensor or number) that every rank must return alike (a global sum,
        e.g. :func:`slasolve.global_sum`; values differing by more than rounding raise on every
        rank). A non-finite value on any rank is ``inf`` everywhere (the line search backtracks)."""
        self.nobj += 1
        e, err = self._call(self._objective, u)
        val = math.nan
        if err is None:
            if isinstance(e, torch.Tensor) and e.numel() == 1 and not e.is_complex():
                val = float(e.detach().reshape(()))
            elif isinstance(e, (int, float)) and not isinstance(e, bool):
                val = float(e)
            else:
                err = TypeError(f"objective must return a real scalar (a 0-d tensor), got "
                                f"{type(e).__name__}{tuple(e.shape) if isinstance(e, torch.Tensor) else ''}")
        finite = math.isfinite(val)
        # the error check rides on the value's own reduction (a deferred check)
        buf = np.array([0.0 if finite else 1.0, val if finite else 0.0, -val if finite else 0.0,
                        0.0 if err is None else 1.0])
        if self.comm.Get_size() > 1:
            self.comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
        if buf[3] > 0:
            raise_collected(self.comm, err, allreduce_int(self.comm, int(err is not None)))
        if buf[0] > 0:
            return math.inf
        hi, lo = float(buf[1]), -float(buf[2])
        if hi - lo > 1e-12 * max(abs(hi), abs(lo)):   # the same test on every rank (reduced values)
            raise ValueError(f"objective returned different values on different ranks ({lo!r} to {hi!r}): "
                             "return the global value on every rank (sum the ranks' shares, e.g. with "
                             "slasolve.global_sum)")
        return hi

    def jacobian(self, u: torch.Tensor, pending=_NOT_GIVEN):
        """Collective. ``jacobian(u, *params)`` (no autograd): a square row-shard
        DSparseTensor whose owned rows match ``u``, with the pattern of the first call.
        ``pending``: this rank's error (or None) from a deferred check (:meth:`residual_local`),
        raised on every rank by this call's own check, before any problem of the Jacobian.
        The Jacobian of a ``raises_collectively`` callable is checked with no reduction (and so is
        ``pending`` when the residual is one too: its problems are the same on every rank)."""
        self.njev += 1
        J, err = self._call(self._jacobian, u, iterate=u is self._checked_u)
        if pending is not _NOT_GIVEN and pending is not None:
            err = pending   # the residual's problem comes first
        elif err is not None:
            pass
        elif self._pattern is not None and type(J) is DSparseTensor and J._layout is self._pattern[0] \
                and J.comm is self._pattern[3]:
            # the first Jacobian's layout and communicator: its shape, rows and columns were checked then
            if J.local.is_block:
                err = ValueError("jacobian must return a scalar (non-block) DSparseTensor")
            elif J.dtype != self.dtype:
                err = TypeError(f"jacobian returned dtype {J.dtype}, u0 is {self.dtype}")
        elif not isinstance(J, DSparseTensor) or not J.is_row_shard:
            err = TypeError(f"jacobian must return a row-sharded DSparseTensor, got {type(J).__name__}")
        elif MPI.Comm.Compare(J.comm, self.comm) not in (MPI.IDENT, MPI.CONGRUENT):
            err = ValueError("jacobian returned a DSparseTensor on another communicator than the solve's "
                             "(pass comm= to nonlinear_solve)")
        elif J.local.is_block:
            err = ValueError("jacobian must return a scalar (non-block) DSparseTensor")
        elif J.n_local != self.n_local or J.global_shape[0] != J.global_shape[1] \
                or J.row_range != J.col_range:
            err = ValueError(f"jacobian must be square with this rank's {self.n_local} owned rows and "
                             f"columns matching u; got global shape {tuple(J.global_shape)}, owned rows "
                             f"{J.row_range}, owned columns {J.col_range}")
        elif J.dtype != self.dtype:
            err = TypeError(f"jacobian returned dtype {J.dtype}, u0 is {self.dtype}")
        elif self._pattern is not None and J._layout is not self._pattern[0]:
            ip, ix = J.local.indptr, J.local.indices
            if not (ip.shape == self._pattern[1].shape and ix.shape == self._pattern[2].shape
                    and torch.equal(ip, self._pattern[1]) and torch.equal(ix, self._pattern[2])):
                err = ValueError("jacobian returned a different sparsity pattern than at the first "
                                 "Newton step; keep one pattern (store explicit zeros)")
        if self._local_checks[1] and (pending is _NOT_GIVEN or self._local_checks[0]):
            if err is not None:   # the same problem on every rank
                raise err
        else:
            check_collective(self.comm, err)
        if self._pattern is None:
            self._pattern = (J._layout, J.local.indptr, J.local.indices, J.comm)
        return J.detach() if J.values.requires_grad else J
