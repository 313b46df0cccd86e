"""Declared per-call settings: one declaration gives both the settings every rank must agree
on (the digest :func:`slasolve._comm.check_collective` carries) and the key of the cached
backend object (a KSP, a factorisation) they select.

A solver family declares a :class:`SettingsSchema` once (which settings select its cached
object, which only have to agree); each call binds its normalised values, hands
:meth:`Settings.agree` to the collective check and looks its object up by
:meth:`Settings.key`. A setting added to the schema is then agreed and keyed alike.
"""
from __future__ import annotations

from typing import Tuple

__all__ = ["SettingsSchema", "Settings"]


class Settings:
    """Local. The normalised static settings of one call (hashable, ``repr``-stable values)."""

    __slots__ = ("values", "keyed")

    def __init__(self, values: dict, keyed: Tuple[str, ...]):
        self.values = values
        self.keyed = keyed

    def agree(self) -> dict:
        """Local. Every setting, for ``check_collective(..., agree=)``."""
        return self.values

    def key(self, **replace) -> tuple:
        """Local. The cache key of the backend object these settings select; ``replace`` gives
        keyed settings of a sibling object (the GMRES solver of a CG adjoint's fallback)."""
        if not replace:
            return tuple(map(self.values.__getitem__, self.keyed))
        return tuple(replace.get(n, self.values[n]) for n in self.keyed)


class SettingsSchema:
    """Local. The declared settings of a solver family's calls: ``keyed`` select the cached
    backend object (and must agree), ``agreed`` only have to agree across ranks."""

    def __init__(self, keyed: Tuple[str, ...], agreed: Tuple[str, ...]):
        self.keyed, self.names = tuple(keyed), frozenset(keyed) | frozenset(agreed)

    def bind(self, **values) -> Settings:
        """Local. This call's settings; every declared name given, no other."""
        if set(values) != self.names:
            raise TypeError(f"settings differ from the schema: missing {sorted(self.names - set(values))}, "
                            f"undeclared {sorted(set(values) - self.names)}")
        return Settings(values, self.keyed)
