"""Normalise SciPy-style arguments (``A``, ``b``, ``x0``, ``M``) into one :class:`System`.

Three modes, decided from ``A`` and ``comm`` (see :mod:`slasolve.linalg`):

* ``"serial"``: no communicator with more than one rank. Everything is global and
  lives in this process, exactly as in SciPy.
* ``"replicated"``: ``comm`` has more than one rank and ``A`` is a scipy.sparse
  matrix, a NumPy array, a ``LinearOperator`` or a callable given *in full on every
  rank*, ``b``/``x0`` too. A matrix is distributed (each rank keeps its contiguous
  block of rows, PETSc's split); the result ``x`` is gathered and returned in full on
  every rank. A ``LinearOperator`` is applied to the gathered vector on every rank.
* ``"rows"``: ``A`` is a row-sharded :class:`~slasolve.DSparseTensor`, or
  ``local=True`` with a ``LinearOperator``/callable that maps this rank's rows of
  ``x`` to this rank's rows of ``A x`` (collective: it does its own communication).
  ``b``, ``x0``, ``M``'s input and output, ``x`` and the callback's ``xk`` are this
  rank's rows. This is the scalable mode.

Everything here is local except :meth:`System.build` and the products, which are
collective over ``System.comm``.
"""
from __future__ import annotations

import hashlib
from typing import Callable, Optional

import numpy as np
import scipy.sparse as sp
import torch
from mpi4py import MPI
from scipy.sparse.linalg import aslinearoperator

from .._comm import allreduce_sum, user_code
from ..dsparse import DSparseTensor, split_offsets
from ..sparse import SparseTensor

__all__ = ["System", "result_char", "digest", "row_block", "split_rows", "gather_rows"]

_COERCE = {"f": {"f": "f", "d": "d"}, "d": {"f": "d", "d": "d"}}
_TORCH = {"f": torch.float32, "d": torch.float64}


def result_char(a_char: str, b_char: str) -> str:
    """Local. SciPy's ``coerce``: the result dtype character of ``A``/``b``
    (integers and others count as ``'d'``; complex is refused before this)."""
    a = a_char if a_char in "fd" else "d"
    b = b_char if b_char in "fd" else "d"
    return _COERCE[a][b]


def digest(*arrays) -> str:
    """Local. A short digest of array contents (to check replicated input agrees)."""
    h = hashlib.blake2b(digest_size=8)
    for a in arrays:
        if a is None:
            h.update(b"none")
            continue
        a = np.ascontiguousarray(a)
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _is_complex_dtype(dt) -> bool:
    try:
        return np.dtype(dt).kind == "c"
    except TypeError:
        return False


def _complex_error(what: str, dt) -> TypeError:
    return TypeError(f"slasolve.linalg: complex {what} (dtype {dt}) is not supported: slasolve's "
                     "solvers are real; solve the equivalent real system of twice the size")


def _is_matrix(A) -> bool:
    return sp.issparse(A) or isinstance(A, (np.ndarray, SparseTensor)) or \
        (isinstance(A, torch.Tensor) and A.layout in (torch.sparse_coo, torch.sparse_csr))


def _as_scipy(A):
    """Local. A scipy.sparse CSR matrix for a matrix input (dense arrays become sparse:
    explicit zeros dropped, never the other way round)."""
    if isinstance(A, SparseTensor):
        return A.to_scipy("csr")
    if isinstance(A, torch.Tensor):
        return SparseTensor.from_torch(A).to_scipy("csr")
    if sp.issparse(A):
        return A.tocsr()
    return sp.csr_matrix(np.asarray(A))


def row_block(S, r0: int, r1: int, comm) -> DSparseTensor:
    """Collective. A row-sharded DSparseTensor from this rank's rows ``[r0, r1)`` of a
    scipy.sparse matrix every rank holds in full (the replicated mode)."""
    blk = S.tocsr()[r0:r1]
    blk.sum_duplicates()
    return DSparseTensor.from_local_rows(
        torch.as_tensor(blk.indptr.astype(np.int64)), torch.as_tensor(blk.indices.astype(np.int64)),
        torch.as_tensor(blk.data), S.shape, comm)


def split_rows(n: int, comm):
    """Local. This rank's contiguous rows ``(r0, r1)`` and every rank's count (PETSc's split)."""
    offs = split_offsets(n, comm.Get_size())
    r = comm.Get_rank()
    return int(offs[r]), int(offs[r + 1]), [int(c) for c in np.diff(offs)]


def gather_rows(x: np.ndarray, counts, comm) -> np.ndarray:
    """Collective. Concatenate every rank's rows (``x``: ``(n_local,)`` or ``(n_local, k)``)."""
    x = np.ascontiguousarray(x)
    if comm.Get_size() == 1:
        return x
    k = int(np.prod(x.shape[1:])) if x.ndim > 1 else 1
    out = np.empty((sum(counts),) + x.shape[1:], dtype=x.dtype)
    comm.Allgatherv(x, [out, [c * k for c in counts]])
    return out


class System:
    """Local (construction). The normalised linear system; see the module docstring.

    Attributes set by :meth:`check` (local) and :meth:`build` (collective): ``mode``,
    ``comm``, ``n`` (global size), ``r0, r1`` (owned rows), ``char`` (result dtype
    character), ``dtype`` (torch), ``dA`` (a DSparseTensor or None for matrix-free),
    ``op`` (local rows -> local rows product), ``M`` (same, or None).
    """

    def __init__(self, name: str, A, b, x0, M, *, comm: Optional[MPI.Comm], local: bool = False,
                 shift: float = 0.0, rows_M_ok: bool = True):
        self.name = name
        self.A_in, self.b_in, self.x0_in, self.M_in = A, b, x0, M
        self.comm_in, self.local, self.shift = comm, bool(local), float(shift)
        self.dA = None
        self.M = None
        self.error: Optional[BaseException] = None
        self.settings: dict = {}
        try:
            self._check()
        except (TypeError, ValueError) as e:
            self.error = e

    # ------------------------------------------------------------------ local checks
    def _check(self) -> None:
        A, b, comm = self.A_in, self.b_in, self.comm_in
        if comm is not None and not isinstance(comm, MPI.Comm):
            raise TypeError(f"{self.name}: comm must be an mpi4py communicator or None, got {type(comm).__name__}")
        if isinstance(A, DSparseTensor):
            self.comm = A.comm
            if comm is not None and MPI.Comm.Compare(comm, A.comm) not in (MPI.IDENT, MPI.CONGRUENT):
                raise ValueError(f"{self.name}: comm differs from the DSparseTensor's communicator")
            self.mode = "rows"  # b, x0, x: this rank's rows (all of them on one rank)
        else:
            self.comm = MPI.COMM_SELF if comm is None else comm
            if self.local and self.comm.Get_size() > 1:
                self.mode = "rows"
            else:
                self.mode = "serial" if self.comm.Get_size() == 1 else "replicated"
        # the operator's kind and dtype
        if isinstance(A, DSparseTensor):
            if A.dtype.is_complex:
                raise _complex_error("A", A.dtype)
            self.kind = "dsparse"
            self.a_char = "f" if A.dtype == torch.float32 else "d"
            self.n = int(A.global_shape[0])
            if A.global_shape[0] != A.global_shape[1]:
                raise ValueError(f"{self.name}: expected square matrix, but got shape={tuple(A.global_shape)}")
        elif _is_matrix(A):
            dt = A.dtype
            if isinstance(A, (SparseTensor, torch.Tensor)):
                if A.dtype.is_complex:
                    raise _complex_error("A", A.dtype)
                dt = np.float32 if A.dtype == torch.float32 else np.float64
            if _is_complex_dtype(dt):
                raise _complex_error("A", dt)
            if isinstance(A, np.ndarray) and A.ndim > 2:
                raise ValueError(f"{self.name}: A must be 2-D, got shape {A.shape}")
            if isinstance(A, np.ndarray) and A.ndim < 2:  # as SciPy's aslinearoperator
                A = self.A_in = np.atleast_2d(A)
            shape = A.shape if not isinstance(A, SparseTensor) else A.matrix_shape
            if len(shape) != 2 or shape[0] != shape[1]:
                raise ValueError(f"{self.name}: expected square matrix, but got shape={(tuple(shape),)}")
            self.kind = "matrix"
            self.a_char = np.dtype(dt).char
            self.n = int(shape[0])
        else:
            self.kind = "operator"
            self.n = None
            if callable(A) and not hasattr(A, "matvec"):
                self.kind = "callable"
            elif not (hasattr(A, "shape") and hasattr(A, "matvec")):
                raise TypeError(f"{self.name}: A must be a matrix (scipy.sparse, NumPy array, DSparseTensor), "
                                f"a LinearOperator or a callable, got {type(A).__name__}")
            else:
                if A.shape[0] != A.shape[1]:
                    raise ValueError(f"{self.name}: expected square matrix, but got shape={(A.shape,)}")
            dt = getattr(A, "dtype", None)
            if dt is not None and _is_complex_dtype(dt):
                raise _complex_error("A", dt)
            self.a_char = np.dtype(dt).char if dt is not None else None
        # b
        b = self.b_in
        if isinstance(b, torch.Tensor):
            b = b.detach().cpu().numpy()
        b = np.asanyarray(b)
        if _is_complex_dtype(b.dtype):
            raise _complex_error("b", b.dtype)
        if self.mode == "rows":
            self.n_local = int(A.n_local) if self.kind == "dsparse" else int(b.shape[0]) if b.ndim else -1
            n_expect = self.n_local
        else:
            if self.n is None:
                if self.kind == "callable":
                    self.n = int(b.shape[0]) if b.ndim >= 1 else 0
                else:
                    self.n = int(self.A_in.shape[0])
            n_expect = self.n
        if not (b.shape == (n_expect, 1) or b.shape == (n_expect,)):
            raise ValueError(f"{self.name}: shapes of A and b {b.shape} are incompatible "
                             f"(expected ({n_expect},) or ({n_expect}, 1)"
                             + (": this rank's rows)" if self.mode == "rows" else ")"))
        if b.dtype.char not in "fdFD":
            b = b.astype("d")
        self.b_np = np.asarray(b).ravel()
        # x0
        x0 = self.x0_in
        if isinstance(x0, torch.Tensor):
            x0 = x0.detach().cpu().numpy()
        if isinstance(x0, str):
            if x0 != "Mb":
                raise ValueError(f"{self.name}: x0 must be an array, None or 'Mb', got {x0!r}")
        elif x0 is not None:
            x0 = np.asarray(x0)
            if _is_complex_dtype(x0.dtype):
                raise _complex_error("x0", x0.dtype)
            if not (x0.shape == (n_expect, 1) or x0.shape == (n_expect,)):
                raise ValueError(f"{self.name}: shapes of A and x0 {x0.shape} are incompatible")
            x0 = x0.ravel()
        self.x0_np = x0
        # M (A.psolve when M is None, as SciPy's make_system)
        M = self.M_in
        if M is None and hasattr(self.A_in, "psolve"):
            M = self.A_in.psolve
        if M is not None:
            dt = getattr(M, "dtype", None)
            if isinstance(M, DSparseTensor):
                dt = None if not M.dtype.is_complex else M.dtype
            if dt is not None and _is_complex_dtype(dt):
                raise _complex_error("M", dt)
            if isinstance(M, DSparseTensor):
                if self.mode != "rows":
                    raise TypeError(f"{self.name}: a DSparseTensor M needs a DSparseTensor A (or local=True)")
            elif not (callable(M) or sp.issparse(M) or isinstance(M, np.ndarray) or hasattr(M, "matvec")):
                raise TypeError(f"{self.name}: M must be a matrix, a LinearOperator or a callable, "
                                f"got {type(M).__name__}")
            shape = getattr(M, "shape", None)
            if shape is not None and self.mode != "rows" and not isinstance(M, DSparseTensor) and \
                    tuple(shape) != (self.n, self.n):
                raise ValueError(f"{self.name}: matrix and preconditioner have different shapes")
        self.M_spec = M
        if self.a_char is None:
            self.a_char = "d"  # decided by a product in build() (SciPy probes A.matvec(b))
            self.probe = True
        else:
            self.probe = False
        self.char = result_char(self.a_char, self.b_np.dtype.char)
        self.settings = {"A kind": self.kind, "mode": self.mode, "n": self.n if self.mode != "rows" else None,
                         "M given": M is not None, "x0": "Mb" if isinstance(x0, str) else x0 is not None}
        if self.mode == "replicated":
            a = self.A_in
            if self.kind == "matrix" and sp.issparse(a):
                c = a.tocsr()
                self.settings["A digest"] = digest(c.indptr, c.indices, c.data)
            elif self.kind == "matrix":
                self.settings["A digest"] = digest(np.asarray(a))
            self.settings["b digest"] = digest(self.b_np)
            self.settings["x0 digest"] = digest(None if isinstance(x0, str) else x0)

    # ------------------------------------------------------------------ collective build
    def build(self, need_matrix: bool = False) -> None:
        """Collective. Distribute the matrix (replicated mode), make the products."""
        comm = self.comm
        size = comm.Get_size()
        if self.mode == "rows":
            if self.kind == "dsparse":
                self.r0, self.r1 = self.A_in.row_range
            else:
                offs = np.concatenate([[0], np.cumsum(comm.allgather(int(self.n_local)))])
                self.r0, self.r1 = int(offs[comm.Get_rank()]), int(offs[comm.Get_rank() + 1])
                self.n = int(offs[-1])
        elif self.mode == "replicated":
            offs = split_offsets(self.n, size)
            self.r0, self.r1 = int(offs[comm.Get_rank()]), int(offs[comm.Get_rank() + 1])
        else:
            self.r0, self.r1 = 0, self.n
        self.counts = comm.allgather(self.r1 - self.r0) if size > 1 else [self.n]
        if self.probe:  # a LinearOperator without dtype: SciPy's make_system probes A.matvec(b)
            y = user_code(comm, self._apply_np, "operator")(self.A_in, self.b_np)
            if _is_complex_dtype(y.dtype):
                raise _complex_error("A (its products)", y.dtype)
            self.char = result_char(y.dtype.char, self.b_np.dtype.char)
        self.dtype = _TORCH[self.char]
        if self.kind == "dsparse":
            self.dA = self.A_in if self.A_in.dtype == self.dtype else None
            if self.dA is None:
                raise TypeError(f"{self.name}: b has dtype {self.b_np.dtype}, A {self.A_in.dtype}")
        elif self.kind == "matrix":
            S = _as_scipy(self.A_in).astype(self.char)
            if self.shift != 0.0:
                S = (S - self.shift * sp.identity(self.n, dtype=self.char, format="csr")).tocsr()
            if self.mode == "serial":
                from ..krylov.operator import as_row_shard
                self.dA = as_row_shard(SparseTensor.from_scipy(S))
            else:
                self.dA = row_block(S, self.r0, self.r1, comm)
        if self.dA is not None and self.kind == "dsparse" and self.shift != 0.0:
            dA, s = self.dA, self.shift
            self.dA = None  # A - shift I matrix-free
            self.op = lambda x: dA.matvec(x) - s * x
        elif self.dA is not None:
            dA = self.dA
            self.op = lambda x: dA.matvec(x)
        else:
            op = self._torch_op(self.A_in)
            if self.shift != 0.0:
                s = self.shift
                self.op = lambda x: op(x) - s * x
            else:
                self.op = op
        self.M = None if self.M_spec is None else self._torch_op(self.M_spec)

    def _check_same_operator(self, what: str, y: torch.Tensor) -> None:
        """Collective (replicated mode). A LinearOperator / callable given on every rank must
        be the same operator: its first product with a nonzero vector (the same gathered
        vector on every rank: no extra product) is compared across ranks, one Allreduce of
        ``2 n`` numbers (matrices are digest-checked instead). ValueError on every rank when
        the products differ by more than rounding."""
        yn = np.asarray(y.detach().cpu().numpy(), dtype=np.float64)
        yn = np.where(np.isfinite(yn), yn, 0.0)   # non-finite products are the solver's to report
        both = np.concatenate([yn, -yn])
        self.comm.Allreduce(MPI.IN_PLACE, both, op=MPI.MAX)
        spread = both[:self.n] + both[self.n:]           # max - min per entry
        scale = np.abs(both).max(initial=0.0)
        if spread.max(initial=0.0) > 1e-10 * max(scale, 1e-300):
            raise ValueError(f"{self.name}: {what} is a LinearOperator/callable given on every rank "
                             f"(replicated mode), but it is not the same operator on every rank (its "
                             f"products with one vector differ by up to {spread.max(initial=0.0):.3e} of "
                             f"{scale:.3e}); pass the same operator everywhere, or local=True with each "
                             "rank's rows")

    # ------------------------------------------------------------------ products
    def _apply_np(self, F, v: np.ndarray) -> np.ndarray:
        if hasattr(F, "matvec"):
            y = F.matvec(v)
        elif sp.issparse(F) or isinstance(F, np.ndarray):
            y = F @ v
        else:
            y = F(v)
        return np.asarray(y).ravel()

    def _torch_op(self, F) -> Callable[[torch.Tensor], torch.Tensor]:
        """Local rows -> local rows, for a matrix / LinearOperator / callable ``F``."""
        dtype = self.dtype
        if isinstance(F, DSparseTensor):
            return lambda x: F.matvec(x)
        apply_np = self._apply_np
        if not (sp.issparse(F) or isinstance(F, np.ndarray)):  # user code: a raise on one rank ends it everywhere
            apply_np = user_code(self.comm, self._apply_np, "operator")
        if sp.issparse(F) and self.mode != "rows":
            F = aslinearoperator(F)
        if isinstance(F, np.ndarray) and self.mode != "rows":
            F = aslinearoperator(F)

        def local(x) -> torch.Tensor:
            y = apply_np(F, x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else x)
            if _is_complex_dtype(y.dtype):
                raise _complex_error("operator output", y.dtype)
            return torch.as_tensor(y, dtype=dtype)

        if self.mode != "replicated":
            return local
        r0, r1 = self.r0, self.r1
        unchecked = [not (sp.issparse(F) or isinstance(F, np.ndarray)) and F is not None]
        what = "A" if F is self.A_in else "M"

        def replicated(x: torch.Tensor) -> torch.Tensor:
            xg = self.gather(x)
            y = local(xg)
            if unchecked[0] and np.any(xg):   # the same gathered x everywhere: the same decision
                unchecked[0] = False
                self._check_same_operator(what, y)
            return y[r0:r1]
        return replicated

    # ------------------------------------------------------------------ vectors
    def local_rows(self, v: np.ndarray) -> torch.Tensor:
        """Local. This rank's rows of a vector given as SciPy would (global except in rows mode)."""
        if self.mode == "rows":
            return torch.as_tensor(np.array(v, dtype=self.char))
        return torch.as_tensor(np.array(v[self.r0:self.r1], dtype=self.char))

    def gather(self, x: torch.Tensor) -> np.ndarray:
        """Collective (replicated mode). The full vector from every rank's rows."""
        xn = np.ascontiguousarray(x.detach().cpu().numpy())
        if self.comm.Get_size() == 1 or self.mode == "rows":
            return xn
        out = np.empty(self.n, dtype=xn.dtype)
        self.comm.Allgatherv(xn, [out, self.counts])
        return out

    def output(self, x: torch.Tensor) -> np.ndarray:
        """Collective (replicated mode). ``x`` as SciPy returns it: a NumPy array of the
        result dtype, global (serial/replicated) or this rank's rows (rows mode)."""
        return np.asarray(self.gather(x), dtype=self.char)

    def reduce_sum(self):
        comm = self.comm
        return None if comm.Get_size() == 1 else (lambda t: allreduce_sum(comm, t))
