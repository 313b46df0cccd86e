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


class AIJArrays:
    """Local. Repeated access to a ``seqaij`` / ``mpiaij`` Mat's value arrays (diagonal block,
    then off-diagonal block) as NumPy views: :func:`aij_array_addresses` with its ctypes
    out-parameters made once and the views kept while PETSc hands out the same addresses, for
    the per-solve comparison and refill of small matrices, where making those objects cost more
    than reading the values. ``acquire()`` gets the arrays (None when PETSc refuses or the Mat
    has not ``len(counts)`` blocks: nothing is then held), ``release()`` restores them (a
    writable restore moves the block's state)."""

    def __init__(self, mat, counts, writable: bool = False):
        lib = _lib()
        self._mat, self._counts, self._lib = mat, [int(c) for c in counts], lib
        self._type = mat.getType()
        vp = ctypes.c_void_p
        self._h = vp(mat.handle)
        self._mpi = [vp(), vp(), vp()]                  # diagonal block, off-diagonal block, colmap
        self._mpi_refs = [ctypes.byref(x) for x in self._mpi]
        self._ptrs = [vp() for _ in self._counts]
        self._refs = [ctypes.byref(x) for x in self._ptrs]
        self._views: dict = {}                           # block -> (address, view)
        self._held: list = []
        if lib is not None:
            self._get, self._restore = ((lib.MatSeqAIJGetArray, lib.MatSeqAIJRestoreArray) if writable else
                                        (lib.MatSeqAIJGetArrayRead, lib.MatSeqAIJRestoreArrayRead))

    def acquire(self) -> Optional[List[np.ndarray]]:
        """Local. The value arrays as NumPy views (held until :meth:`release`), or None."""
        if self._lib is None or self._mat.getType() != self._type:
            return None
        if self._type == "seqaij":
            blocks = [self._h]
        elif self._lib.MatMPIAIJGetSeqAIJ(self._h, *self._mpi_refs):
            return None
        else:
            blocks = self._mpi[:2]
        if len(blocks) != len(self._counts):
            return None
        views = []
        for i, (m, ref, ptr, count) in enumerate(zip(blocks, self._refs, self._ptrs, self._counts)):
            if self._get(m, ref):
                self.release()
                return None
            self._held.append((m, ref))
            address = ptr.value
            if count and not address:
                self.release()
                return None
            hit = self._views.get(i)
            if hit is None or hit[0] != address:
                hit = self._views[i] = (address, np.frombuffer((ctypes.c_double * count).from_address(address),
                                                               dtype=np.float64) if count else np.zeros(0))
            views.append(hit[1])
        return views

    def release(self) -> None:
        """Local. Restore what :meth:`acquire` got."""
        held, self._held = self._held, []
        for m, ref in held:
            self._restore(m, ref)


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
        self._arrays = AIJArrays(mat, [n_diag] if mat_type == "seqaij" else [n_diag, n_offd])
        # small MPIAIJ: the diagonal block's entries as positions in the CSR values (one gather
        # and a byte comparison per block instead of masks; at most 4 B per entry of _SMALL)
        self._diag_pos = None
        if offd_pos.size and n_diag + n_offd <= _SMALL:
            keep = np.ones(n_diag + n_offd, dtype=bool)
            keep[offd_pos] = False
            self._diag_pos = np.flatnonzero(keep).astype(np.int32)

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
        if values.size != self._n_diag + self._n_offd:
            return None
        views = self._arrays.acquire()
        if views is None:
            return None
        try:
            return self._compare(values, views)
        finally:
            self._arrays.release()

    def _compare(self, values: np.ndarray, views: List[np.ndarray]) -> bool:
        diag = views[0]
        pos = self._offd_pos
        if self._diag_pos is not None and values.dtype == diag.dtype:
            # identical bits in both blocks (-0.0 against 0.0 only refills)
            return values.take(pos).tobytes() == views[1].tobytes() and \
                values.take(self._diag_pos).tobytes() == diag.tobytes()
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
