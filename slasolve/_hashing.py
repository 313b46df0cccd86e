"""SplitMix64's finaliser on uint64 arrays (Steele, Lea, Flood 2014): the one 64-bit mixing
function behind slasolve's order-free digests (exact symmetry, mesh numberings) and its
id-keyed random numbers. uint64 array arithmetic wraps modulo 2**64 without warnings."""
from __future__ import annotations

import numpy as np

__all__ = ["mix64", "mix64_inplace"]

_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def mix64(x: np.ndarray) -> np.ndarray:
    """Local. SplitMix64's finaliser of a uint64 array (a new array)."""
    x = (x ^ (x >> _S30)) * _M1
    x = (x ^ (x >> _S27)) * _M2
    return x ^ (x >> _S31)


def mix64_inplace(x: np.ndarray) -> np.ndarray:
    """Local. :func:`mix64` of a uint64 array the caller owns, computed in its storage (half the
    temporaries: on a few hundred entries NumPy's per-call cost dominates)."""
    x ^= x >> _S30
    x *= _M1
    x ^= x >> _S27
    x *= _M2
    x ^= x >> _S31
    return x
