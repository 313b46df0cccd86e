"""The Taylor test: a gradient checked by the convergence of a first-order remainder.

For a functional ``J(m)`` (a scalar, the same on every rank) and a direction ``dm``,

    r0(h) = |J(m + h dm) - J(m)|               -> 0 like h   (rate 1),
    r1(h) = |J(m + h dm) - J(m) - h dJ.dm|     -> 0 like h^2 (rate 2) iff dJ is the gradient.

``dJ.dm`` is a global inner product: each rank holds its rows (its share) of the gradient
and of ``dm``, and the local products are summed over the ranks. This is pyadjoint's
``taylor_test`` for torch tensors distributed the slasolve way; re-exported by
:mod:`slasolve.testing`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Union

import torch

from ._comm import allreduce_max, allreduce_sum, check_collective, get_comm

__all__ = ["taylor_test", "TaylorResult", "TaylorTestError"]

Tensors = Union[torch.Tensor, Sequence[torch.Tensor]]


class TaylorTestError(AssertionError):
    """The first-order Taylor remainder did not converge at the required rate (the gradient,
    or the functional's evaluation, is wrong or too inexact); raised on every rank."""


@dataclass
class TaylorResult:
    """Local. What :func:`taylor_test` measured (identical on every rank).

    Attributes
    ----------
    rate : float
        The smallest first-order convergence rate (``min(rates)``; 2.0 for a correct
        gradient, 1.0 for a wrong one). ``inf`` when every remainder is at rounding level
        (``J`` affine along ``dm``: the gradient is exact to rounding).
    rates : list of float
        ``log2(r1(h_{i-1}) / r1(h_i))`` between consecutive step sizes whose remainders are
        above the rounding floor.
    h : list of float
        The step sizes, ``h0 / 2**i``.
    remainders : list of float
        ``r1(h) = |J(m + h dm) - J(m) - h dJ.dm|``.
    zeroth_order : list of float
        ``r0(h) = |J(m + h dm) - J(m)|`` (rate 1 unless ``dJ.dm`` is 0).
    J0 : float
        ``J(m)``.
    dJdm : float
        The directional derivative ``dJ.dm`` that was tested (global).
    floor : float
        The rounding floor of the remainders (``64 eps max|J|``); remainders below it carry no
        rate.
    passed : bool
        ``rate >= min_rate``.
    """
    rate: float
    rates: List[float]
    h: List[float]
    remainders: List[float]
    zeroth_order: List[float]
    J0: float
    dJdm: float
    floor: float
    min_rate: float
    passed: bool = field(default=False)

    def __float__(self) -> float:
        return float(self.rate)

    def table(self) -> str:
        """Local. The measurements as a small text table."""
        lines = [f"J(m) = {self.J0:.16e}, dJ.dm = {self.dJdm:.16e}, rounding floor {self.floor:.2e}",
                 "       h          |J(m+h dm)-J(m)|   |J(m+h dm)-J(m)-h dJ.dm|"]
        for h, r0, r1 in zip(self.h, self.zeroth_order, self.remainders):
            lines.append(f"  {h:12.4e}   {r0:14.6e}     {r1:14.6e}")
        lines.append(f"rates: {', '.join(f'{r:.3f}' for r in self.rates) or '-'} (min {self.rate:.3f}, "
                     f"need >= {self.min_rate})")
        return "\n".join(lines)


def _as_list(x, what: str) -> List[torch.Tensor]:
    items = [x] if isinstance(x, torch.Tensor) else list(x) if isinstance(x, (list, tuple)) else None
    if items is None or not all(isinstance(t, torch.Tensor) for t in items):
        raise TypeError(f"{what} must be a torch.Tensor or a list/tuple of tensors, got {type(x).__name__}")
    return items


def _scalar(comm, value, what: str) -> float:
    """Collective. ``value`` as a float, checked to be a scalar with the same value on every rank."""
    err = None
    v = float("nan")
    try:
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise TypeError(f"J must return a scalar torch.Tensor, got "
                            f"{tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__}")
        v = float(value.detach().reshape(()))
    except TypeError as e:
        err = e
    check_collective(comm, err)
    finite = math.isfinite(v)
    red = allreduce_max(comm, torch.tensor([v if finite else 0.0, -v if finite else 0.0, 0.0 if finite else 1.0],
                                           dtype=torch.float64)).tolist()
    if red[2] > 0:
        raise ValueError(f"taylor_test: {what} is not finite (on some rank)")
    spread = red[0] + red[1]
    if spread > 8 * torch.finfo(torch.float64).eps * max(abs(red[0]), abs(red[1])):
        raise ValueError(f"taylor_test: {what} differs between ranks (max - min = {spread:.3e}): J must "
                         "return the global value on every rank, e.g. slasolve.global_sum(local_part)")
    return v


def taylor_test(J: Callable[..., torch.Tensor], m: Tensors, dm: Tensors, *, dJdm: Optional[float] = None,
                h0: float = 1e-2, steps: int = 4, min_rate: float = 1.9, comm=None,
                raise_on_fail: bool = True, verbose: bool = False) -> TaylorResult:
    """Collective. Check the gradient of ``J`` at ``m`` along ``dm`` by Taylor remainders.

    Evaluates ``J(m + h dm)`` for ``h = h0, h0/2, ..., h0/2**(steps-1)`` and the remainders
    ``r1(h) = |J(m + h dm) - J(m) - h dJ.dm|``, which fall like ``h**2`` (rate 2) exactly when
    ``dJ.dm`` is the derivative of ``J`` along ``dm``, and like ``h`` (rate 1) when it is not.
    Like pyadjoint's ``taylor_test`` (same default steps ``0.01 / 2**i``).

    Parameters
    ----------
    J : callable
        ``J(m)`` (``J(*m)`` when ``m`` is a list/tuple) returning a scalar tensor with the
        same value on every rank (e.g. ``slasolve.global_sum(local_loss)``). Called
        collectively ``steps + 1`` times (``steps + 2`` when ``dJdm`` is not given: once
        with autograd for the gradient).
    m : torch.Tensor or list of torch.Tensor
        The point. Each rank passes its own rows (owned rows of a distributed vector,
        per-cell values of its cells, a replicated tensor). Not modified.
    dm : torch.Tensor or list of torch.Tensor
        The direction, shaped like ``m``. Scale it to the size of ``m``'s variations: the
        remainders must stay above rounding (and above the tolerances of iterative solves
        inside ``J``) at the smallest step.
    dJdm : float, optional
        The directional derivative to test (global, the same on every rank). Default: by
        autograd, ``sum over ranks of sum_i <dJ/dm_i, dm_i>`` -- each rank's gradient is its
        share (slasolve's convention: a gradient with respect to a tensor that every rank
        uses identically holds this rank's contribution). For a gradient that is already
        complete on every rank (e.g. computed through :func:`slasolve.testing.local_slice`),
        compute the product yourself and pass it here.
    h0, steps
        The largest step and the number of steps (at least 2), halved each time.
    min_rate : float
        The smallest acceptable rate (1.9).
    comm : MPI.Comm, optional
        Default ``MPI.COMM_WORLD``.
    raise_on_fail : bool
        Raise :class:`TaylorTestError` (an ``AssertionError``), on every rank, when the
        minimum rate is below ``min_rate``; else return the result with ``passed=False``.
    verbose : bool
        Print the table on rank 0.

    Returns
    -------
    TaylorResult
        ``result.rate`` is the minimum rate (``float(result)`` too), ``result.rates`` all of
        them; the same on every rank.

    Notes
    -----
    Remainders below the rounding floor ``64 eps max|J|`` carry no rate (they are dropped);
    when all of them are below it, ``J`` is affine along ``dm`` to rounding and the test
    passes with ``rate = inf``. Inexact evaluations of ``J`` (iterative solves at loose
    tolerances) put a noise floor under the remainders that shows up as a low rate at small
    ``h``: solve tightly (``rtol=1e-12``) inside ``J`` or raise ``h0``.

    Examples
    --------
    >>> import torch, slasolve
    >>> from slasolve.testing import taylor_test
    >>> x = torch.tensor([1.0, 2.0], dtype=torch.float64)
    >>> J = lambda x: slasolve.global_sum((x ** 3).sum())
    >>> r = taylor_test(J, x, torch.ones(2, dtype=torch.float64))
    >>> round(r.rate, 1), r.passed
    (2.0, True)
    """
    comm = get_comm(comm)
    err = None
    ms = dms = []
    try:
        ms, dms = _as_list(m, "m"), _as_list(dm, "dm")
        if len(ms) != len(dms):
            raise ValueError(f"m and dm must have the same number of tensors, got {len(ms)} and {len(dms)}")
        for i, (a, b) in enumerate(zip(ms, dms)):
            if a.shape != b.shape:
                raise ValueError(f"dm[{i}] must have the shape of m[{i}], {tuple(a.shape)}; got {tuple(b.shape)}")
            if not a.dtype.is_floating_point or not b.dtype.is_floating_point:
                raise TypeError(f"m[{i}] and dm[{i}] must be floating point tensors")
        if not callable(J):
            raise TypeError(f"J must be callable, got {type(J).__name__}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 2:
            raise ValueError(f"steps must be an int >= 2, got {steps!r}")
        if not (isinstance(h0, (int, float)) and h0 > 0 and math.isfinite(h0)):
            raise ValueError(f"h0 must be a positive number, got {h0!r}")
    except (TypeError, ValueError) as e:
        err = e
    check_collective(comm, err, agree={"steps": repr(steps), "h0": repr(h0), "min_rate": repr(min_rate),
                                       "number of tensors in m": len(ms), "dJdm given": dJdm is not None})
    single = isinstance(m, torch.Tensor)
    base = [t.detach() for t in ms]
    dirs = [d.detach().to(t.dtype) for t, d in zip(base, dms)]

    def call(args):
        return J(args[0]) if single else J(*args)

    if dJdm is None:
        with torch.enable_grad():
            leaves = [t.clone().requires_grad_(True) for t in base]
            value = call(leaves)
            J0 = _scalar(comm, value, "J(m)")
            grads = torch.autograd.grad(value, leaves, allow_unused=True)
        local = sum(float((g.detach().to(torch.float64) * d.to(torch.float64)).sum())
                    for g, d in zip(grads, dirs) if g is not None)
        dJdm = float(allreduce_sum(comm, torch.tensor([local], dtype=torch.float64))[0])
    else:
        with torch.no_grad():
            J0 = _scalar(comm, call([t.clone() for t in base]), "J(m)")
        dJdm = float(dJdm)
    hs = [float(h0) / 2 ** i for i in range(steps)]
    r0s, r1s, Js = [], [], []
    for h in hs:
        with torch.no_grad():
            Jh = _scalar(comm, call([t + h * d for t, d in zip(base, dirs)]), "J(m + h dm)")
        Js.append(Jh)
        r0s.append(abs(Jh - J0))
        r1s.append(abs(Jh - J0 - h * dJdm))
    eps = max(torch.finfo(t.dtype).eps for t in base) if base else torch.finfo(torch.float64).eps
    floor = 64 * eps * max([abs(J0)] + [abs(v) for v in Js])
    rates = [math.log2(r1s[i - 1] / r1s[i]) for i in range(1, steps) if r1s[i] > floor and r1s[i - 1] > floor]
    if rates:
        rate = min(rates)
    elif all(r <= floor for r in r1s):
        rate = math.inf
    else:                      # remainders fall below the floor straight away: too few to measure
        rate = math.inf if max(r1s) <= 1e3 * floor else float("nan")
    result = TaylorResult(rate=rate, rates=rates, h=hs, remainders=r1s, zeroth_order=r0s, J0=J0, dJdm=dJdm,
                          floor=floor, min_rate=float(min_rate), passed=bool(rate >= min_rate))
    if verbose and comm.Get_rank() == 0:
        print(result.table(), flush=True)
    if raise_on_fail and not result.passed:
        hint = ("the remainders fall like h, not h^2: the gradient is wrong (or J is not smooth at m)"
                if rates and rate < 1.5 else
                "a rate between 1.5 and the threshold usually means noise in J (loose solver tolerances) "
                "or steps too large or too small: adjust h0 / dm" if rates else
                "too few remainders above rounding to measure a rate: raise h0 or scale dm")
        raise TaylorTestError(f"Taylor test failed: minimum rate {rate:.3f} < {min_rate} ({hint})\n"
                              + result.table())
    return result
