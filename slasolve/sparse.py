"""SparseTensor: local sparse data in CSR (scalar) or BSR (block) storage.

Shape contract: ``(*batch, M, N, *block)``. ``M`` and ``N``
count block rows and block columns (for a scalar matrix ``block == ()`` and they
are plain rows and columns); the operator that ``A @ x`` applies is
``(M * br) x (N * bc)``. All batch entries share one sparsity pattern; values have
shape ``(*batch, nnz, *block)``.

CSR is the compute format, COO the construction format (duplicates are summed),
BSR the block format. Everything here is local: no communication.
"""
from __future__ import annotations

import cmath

import os
from typing import Optional, Sequence, Tuple, Union

import numpy as np
import scipy.sparse as sp
import torch

__all__ = ["SparseTensor", "Pattern", "csr_mv", "csr_value_grad"]

Shape = Tuple[int, ...]


def _as_index_tensor(a, name: str, device=None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a
    else:
        t = torch.as_tensor(np.asarray(a))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integers, got dtype {t.dtype}")
    t = t.to(dtype=torch.int64, device=device)
    if t.dim() != 1:
        raise ValueError(f"{name} must be one-dimensional, got shape {tuple(t.shape)}")
    return t.contiguous()


def _as_values_tensor(v, name: str = "values") -> torch.Tensor:
    t = v if isinstance(v, torch.Tensor) else torch.as_tensor(np.asarray(v))
    if not (t.dtype.is_floating_point or t.dtype.is_complex):
        if t.dtype == torch.bool:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        t = t.to(torch.get_default_dtype())
    return t


_NUMPY_FLOATS = (torch.float64, torch.float32, torch.complex128, torch.complex64)


def all_finite(t: torch.Tensor) -> bool:
    """Local. Whether every entry of ``t`` is finite. A finite sum proves it (NaN and infinities
    propagate into a sum; one reduction and one scalar read instead of an entrywise test and its
    reduction); only a sum that is not finite (overflow, or a non-finite entry) is tested entrywise."""
    t = t.detach()
    if t.device.type == "cpu" and t.dtype in _NUMPY_FLOATS and not (t.is_conj() or t.is_neg()):
        return all_finite_np(t.numpy())   # NumPy: a fraction of torch's per-call cost at small sizes
    return cmath.isfinite(t.sum().item()) or bool(torch.isfinite(t).all())


def all_finite_np(a: np.ndarray) -> bool:
    """Local. :func:`all_finite` of a floating NumPy array."""
    return cmath.isfinite(a.sum()) or bool(np.isfinite(a).all())


def _check_finite(values: torch.Tensor, name: str = "values") -> None:
    if values.numel() and not all_finite(values):
        bad = int((~torch.isfinite(values.detach())).sum())
        raise ValueError(f"{name} contains {bad} NaN or Inf entr{'y' if bad == 1 else 'ies'}")


def _check_values_shape(values: torch.Tensor, shape: Shape, nbatch: int, nblock: int, nnz: int) -> None:
    """``values`` must be ``(*batch, nnz, *block)`` for ``shape == (*batch, M, N, *block)``."""
    expect = tuple(shape[:nbatch]) + (nnz,) + (tuple(shape[len(shape) - nblock:]) if nblock else ())
    if tuple(values.shape) != expect:
        raise ValueError(f"values must have shape (*batch, nnz, *block) = {expect} for shape {tuple(shape)}, "
                         f"got {tuple(values.shape)}")


class Pattern:
    """Local. An immutable CSR sparsity pattern with cached derived index arrays.

    Tensors that share a pattern (``A.with_values(v)``) share these caches, so the
    transpose permutation, COO rows and the scalar expansion of a block pattern
    are computed once per pattern.
    """

    def __init__(self, indptr: torch.Tensor, indices: torch.Tensor, M: int, N: int):
        self.indptr = indptr
        self.indices = indices
        self.M = int(M)
        self.N = int(N)
        self._rows: Optional[torch.Tensor] = None
        self._transpose: Optional[tuple] = None
        self._scalar: dict = {}
        self._csr32: Optional[tuple] = None
        self._mirror: dict = {}
        # the one-rank layout of a tensor on this pattern (krylov.operator.as_row_shard), kept so
        # repeated solves with new values reuse it and the PETSc Mat / solvers cached on it
        self.self_layout = None

    @property
    def nnz(self) -> int:
        return int(self.indices.numel())

    @property
    def device(self) -> torch.device:
        return self.indices.device

    def rows(self) -> torch.Tensor:
        """COO row index of every stored entry."""
        if self._rows is None:
            counts = self.indptr[1:] - self.indptr[:-1]
            self._rows = torch.repeat_interleave(
                torch.arange(self.M, device=self.device), counts)
        return self._rows

    def transpose(self) -> tuple:
        """``(pattern_T, perm)``: the transposed pattern and ``values_T = values[perm]``."""
        if self._transpose is None:
            rows = self.rows()
            perm = torch.argsort(self.indices * max(self.M, 1) + rows, stable=True)
            counts = torch.bincount(self.indices, minlength=self.N)
            indptr_t = torch.zeros(self.N + 1, dtype=torch.int64, device=self.device)
            indptr_t[1:] = torch.cumsum(counts, 0)
            pt = Pattern(indptr_t, rows[perm].contiguous(), self.N, self.M)
            self._transpose = (pt, perm)
        return self._transpose

    def mirror(self, offset: int) -> tuple:
        """``(inner, perm)`` for a block of rows ``offset .. offset + M`` of a larger
        matrix (``N`` global columns): ``inner`` marks the entries whose column is one of
        these rows (None when every entry is), and ``values[inner][perm]`` is each such
        entry's mirror ``(j, i)``; ``perm`` is None when a mirror is not stored (the
        pattern is not symmetric there)."""
        offset = int(offset)
        if offset not in self._mirror:
            rows, cols = self.rows(), self.indices - offset
            inner = (cols >= 0) & (cols < self.M)
            r, c = rows[inner], cols[inner]
            perm = None
            if r.numel():
                key = r * self.M + c
                order = torch.argsort(key)
                skey = key[order]
                pos = torch.searchsorted(skey, c * self.M + r).clamp_(max=skey.numel() - 1)
                if torch.equal(skey[pos], c * self.M + r):
                    perm = order[pos]
            else:
                perm = torch.zeros(0, dtype=torch.int64, device=self.device)
            self._mirror[offset] = (None if bool(inner.all()) else inner, perm)
        return self._mirror[offset]

    def value_mirror(self, offset: int, b: int = 1) -> tuple:
        """``(inner, perm)``: :meth:`mirror` over the flattened values of ``(b, b)`` blocks
        (``b = 1``: scalar entries). ``values.reshape(-1)[perm]`` puts at each scalar entry
        ``(i, j)`` of a block whose mirror block is stored here the entry ``(j, i)`` of that
        mirror block, and leaves every other entry in place (so it equals ``values`` iff those
        blocks are symmetric); int32 where it fits; None when a mirror is not stored."""
        key = ("values", int(offset), int(b))
        if key not in self._mirror:
            inner, perm = self.mirror(offset)
            full = None
            if perm is not None:
                n = self.nnz
                dt = torch.int32 if n * b * b < 2 ** 31 else torch.int64
                ij = torch.arange(b, dtype=torch.int64, device=self.device)
                swap = (ij.view(1, 1, -1) * b + ij.view(1, -1, 1)).reshape(-1)   # (i, j) -> (j, i)
                if inner is None:
                    full = perm.view(-1, 1) * (b * b) + swap
                else:
                    full = torch.arange(n * b * b, dtype=torch.int64, device=self.device).view(n, b * b)
                    full[inner] = torch.nonzero(inner).reshape(-1)[perm].view(-1, 1) * (b * b) + swap
                full = full.reshape(-1).to(dt)
            self._mirror[key] = (inner, full)
        return self._mirror[key]

    def scalar(self, br: int, bc: int) -> tuple:
        """``(pattern_s, perm)``: the scalar CSR pattern of a BSR pattern with
        ``(br, bc)`` blocks; scalar values are ``values.reshape(*batch, -1)[..., perm]``."""
        key = (br, bc)
        if key not in self._scalar:
            dev = self.device
            rows = self.rows()
            nnzb = self.nnz
            # entry (k, i, j) of block k sits at scalar (rows[k]*br + i, indices[k]*bc + j)
            k = torch.arange(nnzb, device=dev).view(-1, 1, 1)
            i = torch.arange(br, device=dev).view(1, -1, 1)
            j = torch.arange(bc, device=dev).view(1, 1, -1)
            srow = (rows.view(-1, 1, 1) * br + i).expand(nnzb, br, bc)
            scol = (self.indices.view(-1, 1, 1) * bc + j).expand(nnzb, br, bc)
            flat = (k * (br * bc) + i * bc + j).expand(nnzb, br, bc)
            srow, scol, flat = srow.reshape(-1), scol.reshape(-1), flat.reshape(-1)
            order = torch.argsort(srow * max(self.N * bc, 1) + scol)
            counts = torch.bincount(srow, minlength=self.M * br)
            indptr = torch.zeros(self.M * br + 1, dtype=torch.int64, device=dev)
            indptr[1:] = torch.cumsum(counts, 0)
            ps = Pattern(indptr, scol[order].contiguous(), self.M * br, self.N * bc)
            self._scalar[key] = (ps, flat[order].contiguous())
        return self._scalar[key]

    def csr32(self) -> tuple:
        """int32 copies of ``(indptr, indices)`` (faster in the CPU sparse kernels)."""
        if self._csr32 is None:
            if self.nnz < 2**31 - 1 and self.N < 2**31 - 1:
                self._csr32 = (self.indptr.to(torch.int32), self.indices.to(torch.int32))
            else:
                self._csr32 = (self.indptr, self.indices)
        return self._csr32

    def to(self, device) -> "Pattern":
        device = torch.device(device)
        if device == self.device:
            return self
        return Pattern(self.indptr.to(device), self.indices.to(device), self.M, self.N)


# ---------------------------------------------------------------------------
# scalar CSR kernels (no autograd; used by the autograd Functions)

def csr_mv(p: Pattern, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Local. ``y = A x`` for a scalar CSR pattern, ``x`` of shape ``(N,)`` or ``(N, k)``."""
    if p.nnz == 0 or p.M == 0:
        return x.new_zeros((p.M,) + tuple(x.shape[1:]))
    if x.device.type == "cpu" and values.dtype in (torch.float32, torch.float64):
        indptr, indices = p.csr32()
    else:
        indptr, indices = p.indptr, p.indices
    A = torch.sparse_csr_tensor(indptr, indices, values, size=(p.M, p.N),
                                check_invariants=False)
    if x.dim() == 1:
        # torch.mv is the plain SpMV kernel (MKL on CPU); ``A @ x[:, None]`` goes
        # through the SpMM path, about 1.5x slower for one vector
        return torch.mv(A, x)
    return A @ x


def _csr_rmv(p: Pattern, values: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """A^T g through the cached transposed pattern."""
    pt, perm = p.transpose()
    return csr_mv(pt, values[perm], g)


def csr_value_grad(p: Pattern, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Local. ``d<g, A x>/d values = g[row_k] * x[col_k]`` (summed over right-hand sides)."""
    prod = g[p.rows()] * x[p.indices]
    return prod if prod.dim() == 1 else prod.sum(dim=tuple(range(1, prod.dim())))


class _CSRMatVec(torch.autograd.Function):
    @staticmethod
    def forward(ctx, values, x, pattern):
        ctx.pattern = pattern
        ctx.save_for_backward(values, x)
        return csr_mv(pattern, values, x)

    @staticmethod
    def backward(ctx, g):
        values, x = ctx.saved_tensors
        p = ctx.pattern
        g = g.contiguous()
        gv = csr_value_grad(p, g, x) if ctx.needs_input_grad[0] else None
        gx = _csr_rmv(p, values, g) if ctx.needs_input_grad[1] else None
        return gv, gx, None


def csr_matvec(pattern: Pattern, values: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Local. Differentiable ``y = A x`` for a scalar CSR pattern and 1-D values."""
    return _CSRMatVec.apply(values, x, pattern)


# ---------------------------------------------------------------------------

class SparseTensor:
    """Local. A sparse matrix (or a batch of them) in CSR / BSR storage.

    Parameters
    ----------
    indptr, indices : int tensors
        CSR row pointers ``(M+1,)`` and column indices ``(nnz,)`` (block indices
        for a block tensor).
    values : tensor
        ``(*batch, nnz, *block)``; may require grad.
    shape : tuple
        ``(*batch, M, N, *block)``.
    check : bool
        Validate the arrays (ranges, monotone ``indptr``, finite values).

    Notes
    -----
    Build from COO with :meth:`from_coo` (duplicates summed, sorted columns);
    the raw constructor keeps the given order.

    Examples
    --------
    >>> import torch
    >>> from slasolve import SparseTensor
    >>> A = SparseTensor.from_coo([0, 0, 1, 2], [0, 1, 1, 2], torch.tensor([2.0, -1.0, 2.0, 3.0]), (3, 3))
    >>> A.shape, A.nnz
    ((3, 3), 4)
    >>> A.to_dense()
    tensor([[ 2., -1.,  0.],
            [ 0.,  2.,  0.],
            [ 0.,  0.,  3.]])
    >>> A @ torch.ones(3)
    tensor([1., 2., 3.])

    The values may require grad; products are differentiable in them:

    >>> v = torch.tensor([2.0, -1.0, 2.0, 3.0], requires_grad=True)
    >>> A = SparseTensor.from_coo([0, 0, 1, 2], [0, 1, 1, 2], v, (3, 3))
    >>> (A @ torch.ones(3)).sum().backward()
    >>> v.grad
    tensor([1., 1., 1., 1.])
    """

    def __init__(self, indptr, indices, values, shape: Sequence[int], *,
                 block_shape: Shape = (), check: bool = True):
        other = SparseTensor.from_csr(indptr, indices, values, shape, block_shape=block_shape,
                                      check=check)
        self.__dict__.update(other.__dict__)

    # -- shape bookkeeping --------------------------------------------------
    @staticmethod
    def _validate(indptr, indices, M, N):
        if indptr.numel() != M + 1:
            raise ValueError(f"indptr must have M+1 = {M + 1} entries, got {indptr.numel()}")
        if indptr.numel() and (int(indptr[0]) != 0 or int(indptr[-1]) != indices.numel()):
            raise ValueError("indptr must start at 0 and end at nnz")
        if M and bool((indptr[1:] < indptr[:-1]).any()):
            raise ValueError("indptr must be non-decreasing")
        if indices.numel():
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0:
                raise ValueError(f"indices contains a negative column index ({lo})")
            if hi >= N:
                raise ValueError(f"indices contains column {hi}, out of range for N = {N}")

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def block_shape(self) -> Shape:
        return self._shape[len(self._shape) - self._nblock:] if self._nblock else ()

    @property
    def batch_shape(self) -> Shape:
        return self._shape[: len(self._shape) - 2 - self._nblock]

    @property
    def M(self) -> int:
        return self._shape[len(self.batch_shape)]

    @property
    def N(self) -> int:
        return self._shape[len(self.batch_shape) + 1]

    @property
    def is_block(self) -> bool:
        return self._nblock > 0

    @property
    def matrix_shape(self) -> Tuple[int, int]:
        """Shape of the scalar operator, ``(M*br, N*bc)``."""
        br, bc = self.block_shape if self.is_block else (1, 1)
        return self.M * br, self.N * bc

    @property
    def pattern(self) -> Pattern:
        return self._pattern

    @property
    def indptr(self) -> torch.Tensor:
        return self._pattern.indptr

    @property
    def indices(self) -> torch.Tensor:
        return self._pattern.indices

    @property
    def values(self) -> torch.Tensor:
        return self._values

    @property
    def nnz(self) -> int:
        return self._pattern.nnz

    @property
    def dtype(self) -> torch.dtype:
        return self._values.dtype

    @property
    def device(self) -> torch.device:
        return self._values.device

    @property
    def requires_grad(self) -> bool:
        return self._values.requires_grad

    def row_indices(self) -> torch.Tensor:
        """Local. COO (block) row index of every stored entry."""
        return self._pattern.rows()

    def __repr__(self) -> str:
        return (f"SparseTensor(shape={self.shape}, nnz={self.nnz}, dtype={self.dtype}, "
                f"device={self.device}{', block' if self.is_block else ''})")

    # -- construction -------------------------------------------------------
    @classmethod
    def _make(cls, pattern: Pattern, values: torch.Tensor, shape: Shape, nblock: int,
              check: bool = False) -> "SparseTensor":
        obj = cls.__new__(cls)
        obj._values = values
        obj._shape = tuple(shape)
        obj._nblock = nblock
        obj._pattern = pattern
        if check:
            _check_finite(values)
        return obj

    @classmethod
    def from_csr(cls, indptr, indices, values, shape: Sequence[int], *, block_shape: Shape = (),
                 check: bool = True) -> "SparseTensor":
        """Local. Wrap CSR/BSR arrays (kept in the given order)."""
        values = _as_values_tensor(values)
        shape = tuple(int(s) for s in shape)
        nblock = len(tuple(block_shape))
        if len(shape) != values.dim() + 1:
            raise ValueError(f"shape {shape} does not match values of shape {tuple(values.shape)}")
        if nblock and tuple(shape[-nblock:]) != tuple(block_shape):
            raise ValueError(f"shape {shape} does not end with block_shape {tuple(block_shape)}")
        if nblock not in (0, 2):
            raise ValueError("block_shape must be () or (br, bc)")
        indptr = _as_index_tensor(indptr, "indptr", values.device)
        indices = _as_index_tensor(indices, "indices", values.device)
        nbatch = len(shape) - 2 - nblock
        if nbatch < 0:
            raise ValueError(f"shape {shape} is too short for (*batch, M, N, *block)")
        M, N = shape[nbatch], shape[nbatch + 1]
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must not have negative entries, got {shape}")
        if values.shape[nbatch] != indices.numel():
            raise ValueError(f"values has {values.shape[nbatch]} entries along its nnz axis, "
                             f"indices has {indices.numel()}")
        _check_values_shape(values, shape, nbatch, nblock, indices.numel())
        if check:
            cls._validate(indptr, indices, M, N)
        return cls._make(Pattern(indptr, indices, M, N), values, shape, nblock, check=check)

    @classmethod
    def from_coo(cls, row, col, values, shape: Sequence[int], *, block_shape: Shape = (),
                 check: bool = True) -> "SparseTensor":
        """Local. Build from COO triplets; duplicates are summed, columns sorted.

        ``values`` has shape ``(*batch, nnz, *block)``; ``shape`` is
        ``(*batch, M, N, *block)``. Raises ``ValueError`` for negative or
        out-of-range indices and non-finite values.
        """
        values = _as_values_tensor(values)
        shape = tuple(int(s) for s in shape)
        nblock = len(tuple(block_shape))
        if nblock not in (0, 2):
            raise ValueError("block_shape must be () or (br, bc)")
        if len(shape) != values.dim() + 1:
            raise ValueError(f"shape {shape} does not match values of shape {tuple(values.shape)}")
        if nblock and tuple(shape[-nblock:]) != tuple(block_shape):
            raise ValueError(f"shape {shape} does not end with block_shape {tuple(block_shape)}")
        nbatch = len(shape) - 2 - nblock
        if nbatch < 0:
            raise ValueError(f"shape {shape} is too short for (*batch, M, N, *block)")
        M, N = shape[nbatch], shape[nbatch + 1]
        dev = values.device
        row = _as_index_tensor(row, "row", dev)
        col = _as_index_tensor(col, "col", dev)
        if row.numel() != col.numel():
            raise ValueError(f"row and col must have the same length ({row.numel()} != {col.numel()})")
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must not have negative entries, got {shape}")
        if values.shape[nbatch] != row.numel():
            raise ValueError(f"values has {values.shape[nbatch]} entries, row/col have {row.numel()}")
        _check_values_shape(values, shape, nbatch, nblock, row.numel())
        if check:
            for name, idx, bound in (("row", row, M), ("col", col, N)):
                if idx.numel():
                    lo, hi = int(idx.min()), int(idx.max())
                    if lo < 0:
                        raise ValueError(f"{name} contains a negative index ({lo})")
                    if hi >= bound:
                        raise ValueError(f"{name} contains index {hi}, out of range for size {bound}")
            _check_finite(values)
        key = row * max(N, 1) + col
        uniq, inverse = torch.unique(key, sorted=True, return_inverse=True)
        if uniq.numel() == key.numel() and bool((key[1:] > key[:-1]).all() if key.numel() > 1 else True):
            summed = values
        else:
            out_shape = list(values.shape)
            out_shape[nbatch] = uniq.numel()
            summed = values.new_zeros(out_shape).index_add(nbatch, inverse, values)
        r = torch.div(uniq, max(N, 1), rounding_mode="floor")
        c = uniq - r * max(N, 1)
        counts = torch.bincount(r, minlength=M)
        indptr = torch.zeros(M + 1, dtype=torch.int64, device=dev)
        indptr[1:] = torch.cumsum(counts, 0)
        return cls._make(Pattern(indptr, c.contiguous(), M, N), summed, shape, nblock)

    @classmethod
    def from_scipy(cls, A, *, dtype: Optional[torch.dtype] = None, device=None,
                   blocksize: Optional[Tuple[int, int]] = None) -> "SparseTensor":
        """Local. From a ``scipy.sparse`` matrix; a BSR matrix (or ``blocksize``) gives a block tensor."""
        if not sp.issparse(A):
            raise TypeError(f"A must be a scipy.sparse matrix, got {type(A).__name__}")
        if blocksize is not None or A.format == "bsr":
            B = A.tobsr(blocksize=blocksize) if blocksize is not None else A
            B = B.copy()
            B.sort_indices()
            br, bc = B.blocksize
            vals = torch.as_tensor(np.ascontiguousarray(B.data))
            shape = (B.shape[0] // br, B.shape[1] // bc, br, bc)
            out = cls.from_csr(B.indptr, B.indices, vals, shape, block_shape=(br, bc))
        else:
            C = A.tocsr().copy()
            C.sum_duplicates()
            C.sort_indices()
            vals = torch.as_tensor(np.ascontiguousarray(C.data))
            out = cls.from_csr(C.indptr, C.indices, vals, C.shape)
        if dtype is not None or device is not None:
            out = out.to(device=device, dtype=dtype)
        return out

    def to_scipy(self, format: str = "csr"):
        """Local. To ``scipy.sparse`` (csr, or bsr for a block tensor); no batch dims."""
        if self.batch_shape:
            raise ValueError("to_scipy needs an unbatched tensor; index the batch first")
        vals = self._values.detach().cpu().numpy()
        indptr = self.indptr.cpu().numpy()
        indices = self.indices.cpu().numpy()
        if self.is_block:
            br, bc = self.block_shape
            B = sp.bsr_matrix((vals, indices, indptr), shape=(self.M * br, self.N * bc))
            return B if format == "bsr" else B.asformat(format)
        C = sp.csr_matrix((vals, indices, indptr), shape=(self.M, self.N))
        return C if format == "csr" else C.asformat(format)

    @classmethod
    def from_torch(cls, T: torch.Tensor) -> "SparseTensor":
        """Local. From a torch sparse COO / CSR / BSR tensor (2-D)."""
        if not isinstance(T, torch.Tensor):
            raise TypeError(f"expected a torch sparse tensor, got {type(T).__name__}")
        if T.layout == torch.sparse_coo:
            T = T.coalesce()
            idx = T.indices()
            if idx.shape[0] != 2:
                raise ValueError("only 2-D sparse COO tensors are supported")
            return cls.from_coo(idx[0], idx[1], T.values(), tuple(T.shape))
        if T.layout == torch.sparse_csr:
            return cls.from_csr(T.crow_indices(), T.col_indices(), T.values(), tuple(T.shape))
        if T.layout == torch.sparse_bsr:
            vals = T.values()
            br, bc = vals.shape[-2:]
            shape = (T.shape[0] // br, T.shape[1] // bc, br, bc)
            return cls.from_csr(T.crow_indices(), T.col_indices(), vals, shape, block_shape=(br, bc))
        raise TypeError(f"unsupported torch layout {T.layout}; use sparse_coo, sparse_csr or sparse_bsr")

    def to_torch(self) -> torch.Tensor:
        """Local. To ``torch.sparse_csr`` (``sparse_bsr`` for a block tensor); differentiable in values."""
        if self.batch_shape:
            raise ValueError("to_torch needs an unbatched tensor")
        if self.is_block:
            return torch.sparse_bsr_tensor(self.indptr, self.indices, self._values,
                                           size=self.matrix_shape, check_invariants=False)
        return torch.sparse_csr_tensor(self.indptr, self.indices, self._values, size=self.matrix_shape,
                                       check_invariants=False)

    @classmethod
    def from_mtx(cls, path: Union[str, os.PathLike], **kwargs) -> "SparseTensor":
        """Local. Read a Matrix Market file."""
        import scipy.io
        if not os.path.exists(path):
            raise FileNotFoundError(f"Matrix Market file not found: {path}")
        return cls.from_scipy(sp.csr_matrix(scipy.io.mmread(str(path))), **kwargs)

    def to_mtx(self, path: Union[str, os.PathLike]) -> None:
        """Local. Write a Matrix Market file (coordinate format)."""
        import scipy.io
        scipy.io.mmwrite(str(path), self.to_scipy("coo"))

    # -- values -------------------------------------------------------------
    def with_values(self, values: torch.Tensor) -> "SparseTensor":
        """Local. Same pattern, new values (shape ``(*batch, nnz, *block)``); shares pattern caches."""
        values = _as_values_tensor(values)
        nbatch = values.dim() - 1 - self._nblock
        expect = values.shape[nbatch:] == torch.Size((self.nnz,) + self.block_shape) if nbatch >= 0 else False
        if not expect:
            raise ValueError(f"values must have shape (*batch, {self.nnz}, *{self.block_shape}), "
                             f"got {tuple(values.shape)}")
        _check_finite(values)
        shape = tuple(values.shape[:nbatch]) + (self.M, self.N) + self.block_shape
        return SparseTensor._make(self._pattern.to(values.device), values, shape, self._nblock)

    def to(self, *args, **kwargs) -> "SparseTensor":
        """Local. Move/cast values (and indices, for a device move), like ``torch.Tensor.to``."""
        v = self._values.to(*args, **kwargs)
        return SparseTensor._make(self._pattern.to(v.device), v, self._shape, self._nblock)

    def double(self) -> "SparseTensor":
        """Local. The same tensor with float64 values (``self.to(torch.float64)``)."""
        return self.to(torch.float64)

    def float(self) -> "SparseTensor":
        """Local. The same tensor with float32 values (``self.to(torch.float32)``)."""
        return self.to(torch.float32)

    def detach(self) -> "SparseTensor":
        """Local. The same pattern with values detached from the autograd graph."""
        return SparseTensor._make(self._pattern, self._values.detach(), self._shape, self._nblock)

    def requires_grad_(self, flag: bool = True) -> "SparseTensor":
        """Local. Set ``values.requires_grad`` in place; returns ``self``."""
        self._values.requires_grad_(flag)
        return self

    def __getitem__(self, idx) -> "SparseTensor":
        """Local. Index the batch dimensions: ``A[b]`` is the b-th matrix of a batch."""
        if not self.batch_shape:
            raise IndexError("only batched SparseTensors can be indexed (by batch)")
        v = self._values[idx]
        nbatch = v.dim() - 1 - self._nblock
        shape = tuple(v.shape[:nbatch]) + (self.M, self.N) + self.block_shape
        return SparseTensor._make(self._pattern, v, shape, self._nblock)

    # -- algebra ------------------------------------------------------------
    def _scalar_view(self) -> Tuple[Pattern, torch.Tensor]:
        """Scalar CSR pattern and values (``(*batch, nnz_scalar)``)."""
        if not self.is_block:
            return self._pattern, self._values
        br, bc = self.block_shape
        ps, perm = self._pattern.scalar(br, bc)
        flat = self._values.reshape(*self.batch_shape, -1)
        return ps, flat[..., perm]

    def scalar(self) -> "SparseTensor":
        """Local. The same operator as a scalar CSR tensor (values differentiable)."""
        ps, vals = self._scalar_view()
        return SparseTensor._make(ps, vals, self.batch_shape + (ps.M, ps.N), 0)

    @property
    def T(self) -> "SparseTensor":
        """Local. The transpose (blocks transposed too); differentiable in values."""
        pt, perm = self._pattern.transpose()
        nb = len(self.batch_shape)
        v = self._values.index_select(nb, perm)
        if self.is_block:
            v = v.transpose(-1, -2)
            block = (self.block_shape[1], self.block_shape[0])
        else:
            block = ()
        return SparseTensor._make(pt, v, self.batch_shape + (self.N, self.M) + block, self._nblock)

    def matvec(self, x: torch.Tensor) -> torch.Tensor:
        """Local. ``A @ x`` for ``x`` of shape ``(n,)``, ``(n, k)`` or batched ``(*batch, n[, k])``.

        Differentiable with respect to the values and ``x``.
        """
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        m, n = self.matrix_shape
        ps, vals = self._scalar_view()
        if x.dtype != vals.dtype:
            raise TypeError(f"dtype mismatch: matrix is {vals.dtype}, x is {x.dtype}")
        if not self.batch_shape:
            if x.dim() not in (1, 2) or x.shape[0] != n:
                raise ValueError(f"x must have shape ({n},) or ({n}, k), got {tuple(x.shape)}")
            return csr_matvec(ps, vals, x)
        # batched values: y[b] = A_b x[b] (x broadcast over the batch when unbatched)
        nb = len(self.batch_shape)
        if x.dim() >= nb + 1 and tuple(x.shape[:nb]) == self.batch_shape and x.shape[nb] == n:
            xb = x
        elif x.dim() in (1, 2) and x.shape[0] == n:
            xb = x.expand(*self.batch_shape, *x.shape)
        else:
            raise ValueError(f"x must have shape (*{self.batch_shape}, {n}[, k]) or ({n}[, k]), "
                             f"got {tuple(x.shape)}")
        rhs_shape = tuple(xb.shape[nb + 1:])
        xg = xb.index_select(nb, ps.indices)                      # (*batch, nnz, *rhs)
        v = vals.reshape(vals.shape + (1,) * len(rhs_shape))
        prod = v * xg
        out = prod.new_zeros(self.batch_shape + (m,) + rhs_shape)
        return out.index_add(nb, ps.rows(), prod)

    def __matmul__(self, x: torch.Tensor) -> torch.Tensor:
        return self.matvec(x)

    def diagonal(self) -> torch.Tensor:
        """Local. The scalar main diagonal, ``(*batch, min(m, n))`` (zeros where not stored)."""
        ps, vals = self._scalar_view()
        rows = ps.rows()
        mask = rows == ps.indices
        k = min(ps.M, ps.N)
        out = vals.new_zeros(self.batch_shape + (k,))
        return out.index_add(len(self.batch_shape), rows[mask], vals[..., mask])

    def to_dense(self) -> torch.Tensor:
        """Local. Dense ``(*batch, m, n)`` copy (for tests and tiny problems only)."""
        ps, vals = self._scalar_view()
        m, n = ps.M, ps.N
        out = vals.new_zeros(self.batch_shape + (m * n,))
        return out.index_add(len(self.batch_shape), ps.rows() * n + ps.indices, vals).reshape(
            self.batch_shape + (m, n))
