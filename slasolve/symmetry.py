"""Symmetry tests of a row-sharded operator: exact (pattern mirror + multiset hash) and
randomized (two probe vectors).

The adjoint of CG / MINRES reuses the forward solver only when ``A`` is symmetric, and
:func:`slasolve.spsolve` picks Cholesky only when it is exactly symmetric. The exact test
is the cheap one (one gather over the stored entries, no halo exchange, one Allreduce of
three integers on several ranks); the randomized defect also accepts matrices that are
symmetric up to rounding.
"""
from __future__ import annotations

import functools
from typing import Optional

import numpy as np
import torch
from mpi4py import MPI

from ._comm import allreduce_sum
from ._hashing import mix64 as _mix64, mix64_inplace as _mix64_inplace

__all__ = ["exactly_symmetric", "symmetry_defect", "looks_symmetric", "SYMMETRY_RTOL", "SYMMETRY_SUMS",
           "symmetry_sums", "symmetric_from_sums"]

#: a relative defect above this (see :func:`symmetry_defect`) counts as a nonsymmetric matrix:
#: far above the rounding of the two products and reductions (~sqrt(n) eps), far below the
#: asymmetries that matter (a gradient is wrong by about the defect)
SYMMETRY_RTOL = 1e-10

_HASH_SEEDS = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xD1B54A32D192ED03))


def exactly_symmetric(dA) -> bool:
    """Collective. ``A == A^T`` exactly (pattern and values), the same answer on every rank.

    The entries whose mirror lies in the same rank's rows are compared through the
    pattern's cached mirror permutation (exact); the others, the interface between ranks'
    rows, through a multiset hash: ``sum h(i, j, v)`` and ``sum h(j, i, v)`` over them
    (64-bit, two independent hashes) are equal on the whole communicator iff the
    transposed entries are the same multiset, up to a 2**-128 chance of a collision. One
    Allreduce of nine numbers on several ranks, none on one (:func:`symmetry_sums` and
    :func:`symmetric_from_sums` split it for a caller that has a reduction of its own).
    """
    sums = symmetry_sums(dA)
    comm = dA.comm
    if comm.Get_size() > 1:
        comm.Allreduce(MPI.IN_PLACE, sums, op=MPI.SUM)
    return symmetric_from_sums(sums)


#: how many numbers :func:`symmetry_sums` gives
SYMMETRY_SUMS = 9


def symmetry_sums(dA) -> np.ndarray:
    """Local. This rank's part of :func:`exactly_symmetric`: ``SYMMETRY_SUMS`` float64 numbers
    whose sum over the ranks (an ``MPI.SUM`` reduction, exact: integers below 2**53) decides
    it (:func:`symmetric_from_sums`): whether a mirrored entry inside this rank's rows differs,
    and the two interface hash differences in 16-bit pieces."""
    L = dA._layout
    loc = dA.local
    br, bc = loc.block_shape if loc.is_block else (1, 1)
    if br != bc:   # rectangular blocks: compared entry by entry in scalar form
        loc, br, bc = loc.scalar(), 1, 1
    # block rows: the block pattern's mirror, each block against its mirror block transposed (no
    # copy of the values to scalar form: A == A^T iff A_IJ == A_JI^T for every block pair); one
    # flat gather over all entries (those mirrored on other ranks' rows map to themselves)
    inner, perm = loc.pattern.value_mirror(L.rstart if loc.is_block else L.rstart * L.br, br)
    v = loc.values.detach()
    flat = v.reshape(-1)
    out = np.zeros(SYMMETRY_SUMS)
    out[0] = perm is None or not torch.equal(flat.index_select(0, perm), flat)
    if dA.comm.Get_size() == 1:
        return out
    pos, pre = _interface(loc.pattern, inner, L.rstart * L.br, br, v.device)
    if pos.numel():
        bits = flat.index_select(0, pos).cpu().numpy()
        if bits.dtype != np.float64:
            bits = bits.astype(np.float64)
        # array arithmetic only (uint64 arrays wrap silently; NumPy scalars would warn on overflow)
        h = _mix64_inplace(pre + bits.view(np.uint64)).sum(axis=1)   # h(i, j, v), h(j, i, v) per seed
        d = h[0::2] - h[1::2]
        out[1:] = ((d[:, None] >> _PIECE_SHIFTS) & _PIECE_MASK).reshape(-1)
    return out


def symmetric_from_sums(sums: np.ndarray) -> bool:
    """Local. :func:`exactly_symmetric` from the ranks' :func:`symmetry_sums` summed: no rank
    found a differing mirror and both hash differences vanish modulo 2**64."""
    if not np.count_nonzero(sums):   # the usual answer: nothing differs, both hash differences zero
        return True
    if sums[0]:
        return False
    for k in range(2):
        pieces = sums[1 + 4 * k:5 + 4 * k]
        if sum(int(p) << (16 * i) for i, p in enumerate(pieces)) % (1 << 64):
            return False
    return True


_PIECE_SHIFTS = np.array([0, 16, 32, 48], dtype=np.uint64)
_PIECE_MASK = np.uint64(0xFFFF)


def _interface(pattern, inner, roff: int, br: int, device) -> tuple:
    """Local. ``(positions, pre)`` for the entries whose mirror lies on other ranks' rows: their
    positions in the flattened values, and for each the value-independent part of its two hashes
    per seed, ``(4, m)`` uint64 (seed 0 ``(i, j)``, ``(j, i)``, then seed 1). The 64-bit hash of an
    entry ``(i, j, v)`` is ``mix(mix(mix(i ^ seed) + j) + bits(v))`` (SplitMix64's finaliser, order-
    sensitive in ``(i, j)``): the caller adds the value bits and mixes once. Made once per pattern,
    row offset and block size."""
    key = ("interface hash", int(roff), int(br))
    hit = pattern._mirror.get(key)
    if hit is None:
        outer = torch.zeros(pattern.nnz, dtype=torch.bool) if inner is None else ~inner.cpu()
        rows = pattern.rows().cpu()[outer].numpy().astype(np.uint64)
        cols = pattern.indices.cpu()[outer].numpy().astype(np.uint64)
        nb = torch.nonzero(outer).reshape(-1)
        if br > 1:   # the scalar entries of the interface blocks only: (block row, i) and (block col, j)
            ij = np.arange(br, dtype=np.uint64)
            rows = (rows[:, None, None] * np.uint64(br) + ij[None, :, None]).repeat(br, 2).reshape(-1)
            cols = (cols[:, None, None] * np.uint64(br) + ij[None, None, :]).repeat(br, 1).reshape(-1)
            nb = (nb[:, None] * (br * br) + torch.arange(br * br)).reshape(-1)
        rows = rows + np.uint64(roff)
        with np.errstate(over="ignore"):
            pre = np.stack([_mix64(_mix64(a ^ seed) + b) for seed in _HASH_SEEDS
                            for a, b in ((rows, cols), (cols, rows))])
        hit = pattern._mirror[key] = (nb.to(device), pre)
    return hit


def symmetry_defect(dA) -> float:
    """Collective. A randomized estimate of how far ``A`` is from symmetric:
    ``|y.(A x) - x.(A y)| / (||A x|| ||y|| + ||A y|| ||x||)`` for two fixed pseudo-random
    vectors that depend only on the global row index (the same value at every rank
    count, up to rounding). 0 for a symmetric matrix up to rounding; one product with
    two columns and one reduction."""
    r0, r1 = dA.row_range
    X = _probe_vectors(r0, r1, dA.dtype, dA.device)
    with torch.no_grad():
        AX = dA.detach() @ X
    x, y, ax, ay = X[:, 0], X[:, 1], AX[:, 0], AX[:, 1]
    s = allreduce_sum(dA.comm, torch.stack([(y * ax).sum(), (x * ay).sum(), (ax * ax).sum(), (ay * ay).sum(),
                                            (x * x).sum(), (y * y).sum()]).to(torch.float64).cpu())
    s = s.tolist()
    scale = (s[2] * s[5]) ** 0.5 + (s[3] * s[4]) ** 0.5
    return abs(s[0] - s[1]) / scale if scale > 0 else 0.0


@functools.lru_cache(maxsize=4)
def _probe_vectors(r0: int, r1: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Local. The two probe columns of :func:`symmetry_defect` for global rows ``[r0, r1)``
    (read only; made once per row range, as every backward of a loop checks the same rows)."""
    gid = torch.arange(r0, r1, dtype=torch.float64)
    X = torch.stack([torch.frac(torch.sin(gid * 12.9898 + s) * 43758.5453) - 0.5 for s in (0.0, 1.0)], 1)
    return X.to(dtype=dtype, device=device)


def looks_symmetric(dA, sums: Optional[np.ndarray] = None) -> bool:
    """Collective. True on every rank when ``A`` is exactly symmetric (:func:`exactly_symmetric`,
    the cheap test, first; ``sums``: the ranks' :func:`symmetry_sums` already summed by the
    caller) or its :func:`symmetry_defect` is below ``max(SYMMETRY_RTOL, 1000 eps)`` of ``A``'s
    dtype (symmetric up to rounding). The same decision on every rank: both are made from
    reduced numbers."""
    if exactly_symmetric(dA) if sums is None else symmetric_from_sums(sums):
        return True
    return symmetry_defect(dA) <= max(SYMMETRY_RTOL, 1000 * torch.finfo(dA.dtype).eps)
