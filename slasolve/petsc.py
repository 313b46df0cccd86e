"""PETSc bridge: DSparseTensor <-> PETSc.Mat, torch tensors <-> PETSc.Vec.

petsc4py is optional for the rest of slasolve; importing this module needs it.
A Mat built from a DSparseTensor has the same ownership ranges (MPIAIJ, or
MPIBAIJ for block tensors). The Mat is cached on the tensor's layout (shared by
every ``with_values`` copy), so new values are written into the same Mat.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import numpy as np
import torch

from . import _log

try:
    from petsc4py import PETSc
except ImportError as e:  # pragma: no cover - exercised on machines without PETSc
    raise ImportError("slasolve.petsc needs petsc4py: install your PETSc's petsc4py "
                      "(Debian/Ubuntu: apt install python3-petsc4py), see README") from e

__all__ = ["PETSc", "to_petsc_mat", "cached_mat", "create_petsc_mat", "fill_petsc_mat", "aij_value_writer", "garbage_cleanup",
           "tensor_to_vec", "vec_to_tensor", "set_options", "temporary_options", "option_entries"]

_IntType = PETSc.IntType
_ScalarType = PETSc.ScalarType


def _np_values(t: torch.Tensor) -> np.ndarray:
    v = t.detach()
    if v.device.type != "cpu":
        v = v.cpu()
    a = v.numpy()
    if a.dtype != _ScalarType:
        a = a.astype(_ScalarType)
    return np.ascontiguousarray(a)


def _local_csr(dA, scalar: bool = False):
    """Owned rows as int32/float64 CSR with global columns (block CSR for a block
    tensor unless ``scalar``)."""
    loc = dA.local.scalar() if scalar and dA.local.is_block else dA.local
    indptr = loc.indptr.cpu().numpy().astype(_IntType)
    indices = loc.indices.cpu().numpy().astype(_IntType)
    return indptr, indices, _np_values(loc.values).reshape(-1)


def _default_type(dA) -> str:
    return "baij" if dA.local.is_block else "aij"


def create_petsc_mat(dA, mat_type: str, bsize: Optional[int] = None):
    """Collective. A new PETSc Mat (``"aij"``, or ``"baij"`` for block tensors) holding ``dA``'s
    current values, with new nonzero locations forbidden (the pattern is fixed). ``bsize``: the
    block size of an AIJ Mat of a scalar tensor (block tensors: their block's)."""
    L = dA._need_row_shard("to_petsc")
    comm = dA.comm
    m, n = (L.rend - L.rstart) * L.br, (L.cend - L.cstart) * L.bc
    Mg, Ng = dA.global_shape[0] * L.br, dA.global_shape[1] * L.bc
    if L.block and L.br != L.bc:
        raise ValueError(f"PETSc block matrices need square blocks, got {L.block}")
    if mat_type == "baij" and L.block:
        indptr, indices, vals = _local_csr(dA)
        mat = PETSc.Mat().createBAIJ(size=((m, Mg), (n, Ng)), bsize=L.br, csr=(indptr, indices, vals),
                                     comm=comm)
    elif mat_type == "aij":
        indptr, indices, vals = _local_csr(dA, scalar=True)
        mat = PETSc.Mat().createAIJ(size=((m, Mg), (n, Ng)), bsize=L.br if L.block else bsize,
                                    csr=(indptr, indices, vals), comm=comm)
    else:
        raise ValueError(f"mat_type must be 'aij' or 'baij' (block tensors), got {mat_type!r}")
    mat.setOption(PETSc.Mat.Option.NEW_NONZERO_ALLOCATION_ERR, True)
    mat.assemble()
    return mat


def garbage_cleanup(comm) -> None:
    """Collective. Destroy PETSc objects whose Python owners are gone (petsc4py >= 3.18 defers
    destroying parallel objects to this collective point; a no-op before)."""
    cleanup = getattr(PETSc, "garbage_cleanup", None)
    if cleanup is not None:
        cleanup(comm)


def fill_petsc_mat(mat, dA) -> None:
    """Collective. Write ``dA``'s values into ``mat`` (same pattern, AIJ or BAIJ) in place."""
    mat.zeroEntries()
    if dA.local.is_block and "baij" in mat.getType():
        indptr, indices, vals = _local_csr(dA)
        # block CSR insertion: values row-major within each block
        mat.setValuesBlockedCSR(indptr, indices, vals, PETSc.InsertMode.INSERT_VALUES)
    else:
        indptr, indices, vals = _local_csr(dA, scalar=True)
        mat.setValuesCSR(indptr, indices, vals, PETSc.InsertMode.INSERT_VALUES)
    mat.assemble()


def values_differ(dA, mat_type: Optional[str] = None) -> Optional[bool]:
    """Local. Whether this rank's values of ``dA`` differ from those its cached PETSc Mat of
    ``mat_type`` holds (the comparison :func:`to_petsc_mat` makes), or None when no such Mat
    is cached yet. A caller that combines the answers over the ranks in one of its own
    reductions passes the result to ``to_petsc_mat(..., changed=)``."""
    L = dA._need_row_shard("to_petsc")
    entry = L.cache("petsc_mats").get(_default_type(dA) if mat_type is None else mat_type)
    return None if entry is None else _differs_here(entry, dA.values.detach())


def cached_mat(dA, mat_type: Optional[str] = None):
    """Local. The PETSc Mat of ``mat_type`` cached on ``dA``'s layout (what :func:`to_petsc_mat`
    returns), or None when none was made yet; nothing is compared or refilled."""
    L = dA._need_row_shard("to_petsc")
    entry = L.cache("petsc_mats").get(_default_type(dA) if mat_type is None else mat_type)
    return None if entry is None else entry[0]


def to_petsc_mat(dA, *, refill: bool = True, mat_type: Optional[str] = None, changed: Optional[bool] = None):
    """Collective. The cached PETSc Mat of ``dA``, created on first use and refilled in place
    when ``dA``'s values differ from the values last written into it.

    ``mat_type``: ``"aij"`` (default for scalar tensors; for block tensors an AIJ Mat
    with the block size set, which every PETSc preconditioner accepts, GAMG included)
    or ``"baij"`` (default for block tensors). One Mat per type is cached.

    Whether to refill is decided by comparing the values with those the Mat holds (an
    O(nnz) read of the Mat's own arrays for scalar CPU tensors in an AIJ Mat, see
    ``slasolve/_petsc_values.py``; otherwise with a private copy of the values last
    written, ``torch.equal``), not by a tensor stamp
    (id / ``_version`` / data pointer): writes through ``.data``, NumPy views or
    ``torch.no_grad`` in-place ops do not all bump ``_version``, and a Mat that
    silently kept old values would give wrong solves and wrong gradients. Only a
    refill changes the Mat's state, so an unchanged matrix keeps its preconditioner.
    Each rank compares its own rows; since the refill is collective, the answers are
    combined with one Allreduce(MAX) (only when the communicator has several ranks), or
    ``changed`` is that combined answer already (``values_differ`` on every rank, reduced
    by the caller; ignored when the Mat is created now).
    """
    L = dA._need_row_shard("to_petsc")
    mat_type = _default_type(dA) if mat_type is None else mat_type
    mats = L.cache("petsc_mats")
    vals = dA.values.detach()
    entry = mats.get(mat_type)
    if entry is None:
        with _log.phase("setup", _log.event("slaMatCreate")):
            mat = create_petsc_mat(dA, mat_type)
            view = _values_view(dA, L, mat)
            # [Mat, private copy of the values written (None: compared with the Mat's own arrays), view]
            entry = mats[mat_type] = [mat, None if view is not None else vals.clone(), view]
    elif refill:
        with _log.phase("refill", _log.event("slaMatRefill")):
            if _changed_anywhere(dA.comm, entry, vals) if changed is None else changed:
                _refill(entry, dA, L)
                snap = entry[1]
                if snap is None:
                    pass
                elif snap.shape == vals.shape and snap.dtype == vals.dtype and snap.device == vals.device:
                    snap.copy_(vals)  # the private snapshot's own storage: no new allocation
                else:
                    entry[1] = vals.clone()
    if mat_type == _default_type(dA):
        L.petsc_mat = entry[0]
    return entry[0]


def _refill(entry, dA, L) -> None:
    """Collective. :func:`fill_petsc_mat` for a cached Mat: the values written straight into its
    AIJ arrays where that is possible (:class:`_AIJWriter`, made on the first refill), else
    through ``MatSetValuesCSR``. Both end in one ``MatAssembly`` (the Mat's state moves, so
    PETSc rebuilds what depends on the values)."""
    mat = entry[0]
    if len(entry) < 4:
        entry.append(_AIJWriter.build(mat, dA, L))
    writer = entry[3]
    if writer is None or not writer.write(dA.values.detach()):
        fill_petsc_mat(mat, dA)
        return
    mat.assemble()


def aij_value_writer(mat, dA):
    """Collective (one ``MatAssembly`` on every rank, whatever each decides). A writer of ``dA``'s
    values straight into the AIJ arrays of ``mat``, a Mat made from ``dA``'s pattern
    (:func:`create_petsc_mat`): ``writer.write(values)`` (local; CPU float64 values of that pattern)
    returns False when it could not write, and the caller then fills ``mat`` through
    ``MatSetValuesCSR``; either way ``mat.assemble()`` follows (collective). None on a rank where
    the mapping cannot be proven (see ``_AIJWriter``). ``mat``'s values are left undefined
    until the caller writes them."""
    return _AIJWriter.build(mat, dA, dA._need_row_shard("to_petsc"))


class _AIJWriter:
    """Local. Writes a CPU float64 tensor's values (scalar or block, the pattern the cached AIJ Mat
    was made from) straight into the Mat's value arrays: one gather per block (diagonal and
    off-diagonal block of an MPIAIJ Mat), where ``MatSetValuesCSR`` would zero the Mat and search
    every row for every column. The mapping is derived from the pattern (rows sorted by global
    column, as ``_petsc_values.AIJValues`` explains) and proven at build time by writing distinct
    values through ``MatSetValuesCSR`` and reading them back at the derived positions; anything
    unexpected makes :meth:`build` return None (``MatSetValuesCSR`` it is)."""

    def __init__(self, mat, sources):
        self._mat = mat
        self._sources = sources                   # per AIJ block: flat value index of each array entry
        self._counts = [int(x.size) for x in sources]
        self._access = None                       # the writable AIJArrays, made on first use

    @classmethod
    def build(cls, mat, dA, L) -> Optional["_AIJWriter"]:
        """Collective (one ``MatAssembly`` on every rank, whatever each decides). The writer for
        ``mat``, or None on this rank."""
        try:
            made = cls._probe(mat, dA, L)
        except Exception:   # local: the caller falls back to MatSetValuesCSR (same collectives)
            made = None
        mat.assemble()
        if made is None:
            return None
        w, probe = made
        try:
            seen = w._arrays(lambda views: [v.copy() for v in views])
            if seen is None or not all(a.size == s.size and np.array_equal(a, probe[s])
                                       for a, s in zip(seen, w._sources)):
                return None
        except Exception:
            return None
        if len(w._sources) == 1 and np.array_equal(w._sources[0], np.arange(probe.size)):
            w._sources = [None]   # the array is the values, in order: a copy
        return w

    @classmethod
    def _probe(cls, mat, dA, L):
        """Local. ``(writer, probe)`` with the distinct ``probe`` values written into ``mat`` through
        ``MatSetValuesCSR`` (not yet assembled), or None where this cannot apply."""
        from ._petsc_values import petsc_library
        lib = petsc_library()
        kind = mat.getType()
        vals = dA.values
        if lib is None or kind not in ("seqaij", "mpiaij") or vals.device.type != "cpu" \
                or vals.dtype != torch.float64 or _ScalarType != np.float64:
            return None
        loc = dA.local
        n = vals.numel()
        if loc.is_block:
            ps, perm = loc.pattern.scalar(*loc.block_shape)
            indptr, cols, src = ps.indptr, ps.indices.cpu().numpy(), perm.cpu().numpy()
        else:
            indptr, cols, src = loc.indptr, loc.indices.cpu().numpy(), np.arange(n)
        if cols.size != n:
            return None
        dt = np.int32 if n < 2 ** 31 else np.int64
        if kind == "seqaij":
            sources = [src.astype(dt)]
        else:
            c0, c1 = L.cstart * L.bc, L.cend * L.bc
            off = (cols < c0) | (cols >= c1)
            sources = [src[~off].astype(dt), src[off].astype(dt)]
        probe = np.arange(1.0, n + 1.0)
        mat.zeroEntries()
        mat.setValuesCSR(indptr.cpu().numpy().astype(_IntType), cols.astype(_IntType), probe[src],
                         PETSc.InsertMode.INSERT_VALUES)
        return cls(mat, sources), probe

    def _arrays(self, fn):
        """Local. ``fn(views)`` on writable NumPy views of the Mat's AIJ value arrays (diagonal block,
        then off-diagonal block; ``self._counts`` entries each), between Get/RestoreArray (the
        restore moves the blocks' state); None when PETSc refuses."""
        from ._petsc_values import AIJArrays
        arrays = self._access
        if arrays is None:
            arrays = self._access = AIJArrays(self._mat, self._counts, writable=True)
        views = arrays.acquire()
        if views is None:
            return None
        try:
            return fn(views)
        finally:
            arrays.release()

    def write(self, values: torch.Tensor) -> bool:
        """Local. Write ``values`` (the tensor's, CPU float64) into the Mat's arrays; False when
        that could not be done (then nothing is promised about the arrays: refill them)."""
        if self._mat.getType() not in ("seqaij", "mpiaij") or values.dtype != torch.float64 \
                or values.device.type != "cpu":
            return False
        flat = values.reshape(-1).numpy()
        # the Mat's arrays must still have the entries the mapping was proven on
        if flat.size != sum(self._counts) or \
                int(self._mat.getInfo(PETSc.Mat.InfoType.LOCAL)["nz_used"]) != flat.size:
            return False

        def put(views):
            for v, s in zip(views, self._sources):
                if s is None:
                    np.copyto(v, flat)
                else:
                    np.take(flat, s, out=v)
            return True
        try:
            return bool(self._arrays(put))
        except Exception:
            return False


def _values_view(dA, L, mat):
    """Local. An ``AIJValues`` (``slasolve/_petsc_values.py``) comparing ``dA``'s values with
    ``mat``'s own arrays (scalar CPU tensors in an AIJ Mat), or None: keep a copy."""
    if dA.local.is_block or dA.values.device.type != "cpu" or dA.values.dtype not in (torch.float32,
                                                                                      torch.float64):
        return None
    from ._petsc_values import AIJValues
    loc = dA.local
    try:  # local: a failure here must not leave the cache on some ranks only (the next call is collective)
        return AIJValues.build(mat, loc.indices.cpu().numpy(), L.cstart, L.cend, loc.values.detach().numpy())
    except Exception:
        return None


def _changed_anywhere(comm, entry, vals: torch.Tensor) -> bool:
    """Collective. True on every rank when any rank's values differ from what its Mat holds."""
    from mpi4py import MPI
    from ._comm import allreduce_int
    return bool(allreduce_int(comm, int(_differs_here(entry, vals)), MPI.MAX))


def _differs_here(entry, vals: torch.Tensor) -> bool:
    """Local. Whether ``vals`` differ from what this rank's Mat of the cache ``entry`` holds
    (True when that cannot be told: refill)."""
    snapshot, view = entry[1], entry[2]
    if view is not None:
        try:  # local, before the Allreduce: never raise on one rank here
            same = view.equal(vals.numpy()) if vals.device.type == "cpu" and vals.dim() == 1 else None
        except Exception:
            same = None
        mine = not same     # None (cannot tell): refill
    else:
        mine = not (snapshot.shape == vals.shape and snapshot.dtype == vals.dtype
                    and snapshot.device == vals.device and torch.equal(snapshot, vals))
    return bool(mine)


def tensor_to_vec(x: torch.Tensor, comm=None, *, global_size: Optional[int] = None, bsize: int = 1):
    """Collective. A ``PETSc.Vec`` over ``x``'s owned rows.

    Shares ``x``'s memory when it is a contiguous float64 CPU tensor (keep ``x``
    alive while the Vec is used); copies otherwise. A bad ``x`` (not a 1-D
    tensor) on any rank raises ``TypeError``/``ValueError`` on every rank: the
    check rides on the one Allreduce that sums the global size.
    """
    from ._comm import get_comm
    comm = get_comm(comm)
    err = None
    if not isinstance(x, torch.Tensor):
        err = TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    elif x.dim() != 1:
        err = ValueError(f"x must be 1-D (owned rows), got shape {tuple(x.shape)}")
    n = int(x.shape[0]) if err is None else 0
    if comm.Get_size() > 1:
        from mpi4py import MPI
        buf = np.array([n, 1 if err is not None else 0], dtype=np.int64)
        comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        total, nbad = int(buf[0]), int(buf[1])
    else:
        total, nbad = n, int(err is not None)
    if nbad:
        from ._comm import check_collective
        check_collective(comm, err)
    if global_size is not None and int(global_size) != total:
        raise ValueError(f"global_size = {global_size}, but the ranks' x add up to {total} rows")
    a = x.detach()
    if a.device.type != "cpu" or a.dtype != torch.float64 or not a.is_contiguous():
        a = a.to(device="cpu", dtype=torch.float64).contiguous()
    arr = a.numpy()
    return PETSc.Vec().createWithArray(arr, size=(arr.shape[0], total), bsize=bsize, comm=comm)


def vec_to_tensor(vec, *, copy: bool = True, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """Local. The Vec's owned entries as a torch tensor (a copy unless ``copy=False``,
    in which case the tensor aliases the Vec's array and must not outlive it)."""
    if copy:
        t = torch.from_numpy(np.array(vec.getArray(readonly=True), copy=True))
    else:
        t = torch.from_numpy(vec.getArray())  # writable view: no read-only warning from torch
    return t if dtype is None else t.to(dtype)


def set_options(options: Optional[dict], prefix: Optional[str] = None) -> None:
    """Local. Put ``{name: value}`` into the PETSc options database under ``prefix``
    *permanently* (every later ``setFromOptions`` sees them). Solvers use
    :func:`temporary_options` instead."""
    if not options:
        return
    opts = PETSc.Options(prefix)
    for k, v in options.items():
        key = k.lstrip("-")
        if v is None or v is True:
            opts[key] = ""
        elif v is False:
            opts[key] = "false"
        else:
            opts[key] = v


def option_entries(options: Optional[dict]) -> dict:
    """Local. ``{name: string value}`` as written into the options database
    (``None``/``True`` -> ``""``, ``False`` -> ``"false"``, leading dashes dropped)."""
    out = {}
    for k, v in (options or {}).items():
        key = str(k).lstrip("-")
        out[key] = "" if v is None or v is True else ("false" if v is False else str(v))
    return out


@contextlib.contextmanager
def temporary_options(options: Optional[dict], prefix: Optional[str] = None) -> Iterator[None]:
    """Local. Put ``options`` into the PETSc options database under ``prefix`` for the
    duration of the block, then restore what was there before (earlier values,
    command-line options included, come back; new names are deleted), so one call's
    ``petsc_options`` never reach a later call.

    Use it around ``setFromOptions()`` (and anything else that reads the database).
    """
    entries = option_entries(options)
    if not entries:
        yield
        return
    opts = PETSc.Options(prefix)
    saved = {}
    try:
        for key, val in entries.items():
            if key not in saved:
                saved[key] = opts.getString(key) if opts.hasName(key) else None
            opts[key] = val
        yield
    finally:
        for key, old in saved.items():
            if old is None:
                opts.delValue(key)
            else:
                opts[key] = old
