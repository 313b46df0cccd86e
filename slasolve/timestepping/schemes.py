"""Time discretisations of ``M du/dt + F(u, t) = 0`` as linear multistep coefficients.

A step from ``t_n`` to ``t_{n+1} = t_n + dt`` solves

    sum_j alpha_j M u_{n+1-j} + dt sum_j beta_j F(u_{n+1-j}, t_{n+1-j}) = 0,   j = 0 .. k,

(``alpha``, ``beta`` scaled so that the equation is ``dt`` times the discrete ODE). The
theta-methods (backward Euler ``theta = 1``, Crank-Nicolson ``theta = 1/2``) have ``k = 1``;
BDF2 has ``k = 2`` and starts with one backward Euler step (second order overall).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple, Union

__all__ = ["Scheme", "scheme"]


@dataclass(frozen=True)
class Scheme:
    """Local. A linear multistep scheme: ``alpha``, ``beta`` per history depth (``k + 1``
    entries), the number of past states it needs (``history = k``), and the coefficients of
    the first ``k - 1`` steps (lower-order starters with the same ``history``)."""
    name: str
    alpha: Tuple[float, ...]
    beta: Tuple[float, ...]
    starters: Tuple[Tuple[Tuple[float, ...], Tuple[float, ...]], ...] = ()

    @property
    def history(self) -> int:
        """Local. The number of past states a step reads."""
        return len(self.alpha) - 1

    def coefficients(self, n: int) -> Tuple[Tuple[float, ...], Tuple[float, ...]]:
        """Local. ``(alpha, beta)`` of step ``n`` (from ``t_n`` to ``t_{n+1}``)."""
        return self.starters[n] if n < len(self.starters) else (self.alpha, self.beta)


_NAMES = {"backward_euler": 1.0, "be": 1.0, "implicit_euler": 1.0, "crank_nicolson": 0.5, "cn": 0.5}


def scheme(spec: Union[str, float, Scheme]) -> Scheme:
    """Local. A :class:`Scheme` from a name (``"backward_euler"``/``"be"``,
    ``"crank_nicolson"``/``"cn"``, ``"bdf2"``), a theta in ``[0.5, 1]`` (theta-method) or a
    Scheme. Raises ValueError for anything else (explicit or unstable ``theta < 1/2`` included)."""
    if isinstance(spec, Scheme):
        return spec
    if isinstance(spec, str):
        key = spec.lower()
        if key == "bdf2":
            be = ((1.0, -1.0, 0.0), (1.0, 0.0, 0.0))
            return Scheme("bdf2", (1.5, -2.0, 0.5), (1.0, 0.0, 0.0), (be,))
        if key not in _NAMES:
            raise ValueError(f"scheme must be 'backward_euler', 'crank_nicolson', 'bdf2' or a theta in "
                             f"[0.5, 1], got {spec!r}")
        theta = _NAMES[key]
    elif isinstance(spec, (int, float)) and not isinstance(spec, bool):
        theta = float(spec)
        if not 0.5 <= theta <= 1.0:
            raise ValueError(f"theta must be in [0.5, 1] (A-stable theta-methods), got {theta}")
    else:
        raise ValueError(f"scheme must be a name or a theta in [0.5, 1], got {spec!r}")
    name = {1.0: "backward_euler", 0.5: "crank_nicolson"}.get(theta, f"theta={theta}")
    return Scheme(name, (1.0, -1.0), (theta, 1.0 - theta))
