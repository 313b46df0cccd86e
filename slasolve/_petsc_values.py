"""Read-only views of an assembled AIJ Mat's value arrays, to compare new values with
the Mat itself instead of with a private copy of the values last written.

petsc4py 3.18 does not wrap ``MatSeqAIJGetArrayRead`` / ``MatMPIAIJGetSeqAIJ``; they are
called through ``ctypes`` on the ``libpetsc`` petsc4py has loaded. Anything unexpected
(another Mat type, a library that cannot be found, counts that do not match the
pattern, values that differ right after creation) makes :meth:`AIJValues.build` return
``None`` and the caller keeps its copy: this module only ever saves memory, it never
decides an answer on a guess.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
from typing import List, Optional

import numpy as np

# diagonal-block values compared this many entries at a time (bounded temporaries:
# this PETSc build keeps every freed temporary in RSS, see bench/memory_breakdown.py)
_CHUNK = 1 << 18
# up to this many entries, compared as bytes (one memcmp; a fraction of array_equal's per-call cost)
_SMALL = 1 << 14


@functools.lru_cache(maxsize=None)
def _lib():
    """Local. The ``libpetsc`` shared object of this process with the functions set up, or None."""
    try:
        from petsc4py import PETSc
        if PETSc.ScalarType != np.float64:
            return None
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libpetsc" in line and ".so" in line}
        paths = [p for p in paths if p.startswith("/") and "petsc4py" not in p]
        if len(paths) != 1:
            return None
        lib = ctypes.CDLL(paths[0])
        vp = ctypes.c_void_p
        for name, args in (("MatSeqAIJGetArrayRead", [vp, ctypes.POINTER(vp)]),
                           ("MatSeqAIJRestoreArrayRead", [vp, ctypes.POINTER(vp)]),
                           ("MatSeqAIJGetArray", [vp, ctypes.POINTER(vp)]),
                           ("MatSeqAIJRestoreArray", [vp, ctypes.POINTER(vp)]),
                           ("MatMPIAIJGetSeqAIJ", [vp, ctypes.POINTER(vp), ctypes.POINTER(vp),
                                                   ctypes.POINTER(vp)])):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        return lib
    except (OSError, AttributeError, ImportError):
        return None


def petsc_library():
    """Local. The ``libpetsc`` of this process through ``ctypes`` (``MatSeqAIJGetArray[Read]`` /
    ``RestoreArray[Read]`` and ``MatMPIAIJGetSeqAIJ`` typed), or None where it cannot be found."""
    return _lib()


@contextlib.contextmanager
def aij_array_addresses(mat, n_blocks: int, writable: bool = False):
    """Local. The addresses of a ``seqaij`` (one block) or ``mpiaij`` (diagonal, then
    off-diagonal block) Mat's value arrays, held between ``MatSeqAIJGetArray[Read]`` and its
    restore (restoring a writable array moves the block's state, so PETSc sees new values);
    None when the library is missing, PETSc refuses, or the Mat has not ``n_blocks`` blocks."""
    lib = _lib()
    got, addresses = [], None
    try:
        if lib is not None:
            get, restore = ((lib.MatSeqAIJGetArray, lib.MatSeqAIJRestoreArray) if writable else
                            (lib.MatSeqAIJGetArrayRead, lib.MatSeqAIJRestoreArrayRead))
            h = ctypes.c_void_p(mat.handle)
            blocks = [h] if mat.getType() == "seqaij" else None
            if blocks is None:
                ad, ao, colmap = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
                if not lib.MatMPIAIJGetSeqAIJ(h, ctypes.byref(ad), ctypes.byref(ao), ctypes.byref(colmap)):
                    blocks = [ad, ao]
            if blocks is not None and len(blocks) == n_blocks:
                addresses = []
                for m in blocks:
                    p = ctypes.c_void_p()
                    if get(m, ctypes.byref(p)):
                        addresses = None
                        break
                    got.append((m, p))
                    addresses.append(p.value)
        yield addresses
    finally:
        for m, p in got:
            restore(m, ctypes.byref(p))


class AIJValues:
    """Local. Compares one rank's scalar CSR values (rows sorted by global column) with
    the ``seqaij`` / ``mpiaij`` Mat that was built from that pattern.

    In an MPIAIJ Mat each owned row is split into the diagonal block (columns in the
    owned column range, a contiguous run of the sorted row) and the off-diagonal block
    (the other columns, in global order): so the diagonal block's array is the CSR
    values with the off-diagonal positions taken out, and the off-diagonal array is the
    values at those positions, both in CSR order.
    """

    def __init__(self, mat, mat_type: str, offd_pos: np.ndarray, n_diag: int, n_offd: int):
        self._mat, self._type = mat, mat_type
        self._offd_pos, self._n_diag, self._n_offd = offd_pos, n_diag, n_offd
        self._views: dict = {}   # block number -> (address, NumPy view of that address)

    @classmethod
    def build(cls, mat, indices: np.ndarray, cstart: int, cend: int,
              values: np.ndarray) -> Optional["AIJValues"]:
        """Local. A comparer for ``mat`` just filled with ``values`` on pattern ``indices``
        (global columns), or None when this Mat / library does not allow it."""
        lib = _lib()
        mat_type = mat.getType()
        if lib is None or mat_type not in ("seqaij", "mpiaij") or values.dtype.kind != "f":
            return None
        from petsc4py import PETSc
        nnz = int(indices.size)
        if int(mat.getInfo(PETSc.Mat.InfoType.LOCAL)["nz_used"]) != nnz:
            return None
        if mat_type == "seqaij":
            offd_pos = np.zeros(0, dtype=np.int64)
        else:
            offd_pos = np.flatnonzero((indices < cstart) | (indices >= cend))
            n_diag = int(mat.getDiagonalBlock().getInfo(PETSc.Mat.InfoType.LOCAL)["nz_used"])
            if n_diag != nnz - offd_pos.size:
                return None
        view = cls(mat, mat_type, offd_pos, nnz - offd_pos.size, int(offd_pos.size))
        return view if view.equal(values) else None

    def equal(self, values: np.ndarray) -> Optional[bool]:
        """Local. Whether the Mat holds exactly ``values`` (None: cannot tell; refill)."""
        if self._mat.getType() != self._type or values.size != self._n_diag + self._n_offd:
            return None
        counts = [self._n_diag] if self._type == "seqaij" else [self._n_diag, self._n_offd]
        with aij_array_addresses(self._mat, len(counts)) as addresses:
            if addresses is None:
                return None
            return self._compare(values, [self._view(i, a, c) for i, (a, c) in enumerate(zip(addresses, counts))])

    def _view(self, i: int, address: Optional[int], count: int) -> np.ndarray:
        """Local. A NumPy view of the ``count`` doubles at ``address`` (block ``i``), kept while
        PETSc hands out the same address (it is only read between Get/RestoreArrayRead)."""
        if not count or not address:
            return np.zeros(0)
        hit = self._views.get(i)
        if hit is None or hit[0] != address or hit[1].size != count:
            hit = self._views[i] = (address, np.frombuffer((ctypes.c_double * count).from_address(address),
                                                           dtype=np.float64))
        return hit[1]

    def _compare(self, values: np.ndarray, views: List[np.ndarray]) -> bool:
        diag = views[0]
        pos = self._offd_pos
        if not pos.size:
            if values.dtype == diag.dtype and values.size <= _SMALL:
                # identical bits: the Mat holds exactly these values (-0.0 against 0.0 only refills)
                return values.tobytes() == diag.tobytes()
            return bool(np.array_equal(values, diag))
        if not np.array_equal(values[pos], views[1]):
            return False
        d = 0
        for s in range(0, values.size, _CHUNK):     # chunks of entries, not rows
            e = min(values.size, s + _CHUNK)
            a, b = np.searchsorted(pos, (s, e))
            part = values[s:e]
            if a < b:
                keep = np.ones(e - s, dtype=bool)
                keep[pos[a:b] - s] = False
                part = part[keep]
            if not np.array_equal(part, diag[d:d + part.size]):
                return False
            d += part.size
        return d == diag.size
