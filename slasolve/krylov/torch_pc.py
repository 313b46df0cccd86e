"""Preconditioner builders for the native torch Krylov kernels.

Each builder takes the rank's *local diagonal block* as CSR torch tensors
``(indptr, indices, values, n)`` — int64 ``indptr``/``indices``, square
``n x n``, local column ids — and returns a callable ``apply(r) -> z`` mapping
a tensor of shape ``(n,)`` (or ``(n, k)``) to the same shape, device and dtype.
Using the diagonal block only gives block Jacobi across ranks (PETSc's
``-pc_type bjacobi``); on one rank it is the preconditioner itself.

All builders are **local** (no communication). A bad block raises
``ValueError``; callers that build on several ranks should combine the
outcome with ``slasolve._comm.check_collective`` so every rank raises.

* :func:`jacobi` — inverse diagonal (duplicates summed).
* :func:`block_jacobi_ilu` — sparse incomplete factorisation of the block,
  ``kind="ilu0"`` (ILU(0)) or ``"ic0"`` (IC(0)), never a dense block. The
  factorisation and triangular solves run in compiled code:

  - ``factor="petsc"`` (default when petsc4py imports): PETSc's own
    ``PCILU``/``PCICC`` with 0 levels of fill and natural ordering on a
    ``SeqAIJ`` copy of the block (``PETSc.COMM_SELF``): a true ILU(0), resp.
    IC(0) (PETSc's ICC applies its default positive-definite shift on a
    non-positive pivot);
  - ``factor="scipy"`` (the fallback without petsc4py): SciPy has no ILU(0)
    or IC(0) (``spilu`` is a threshold ILU that is not symmetric, which breaks
    CG), so the block is factorised *exactly* with SuperLU's sparse LU
    (``splu``): block Jacobi with exact local solves, sparse, SPD when the
    block is.

  Factor and solves are in float64 on the CPU; ``apply`` moves the vector
  to the CPU and back to its device/dtype.
* :func:`from_callable` — wraps a user function.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

__all__ = ["jacobi", "block_jacobi_ilu", "from_callable", "local_diagonal"]

Tensor = torch.Tensor


def _check_csr(indptr, indices, values, n, who):
    for name, t in (("indptr", indptr), ("indices", indices), ("values", values)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    n = int(n)
    if indptr.ndim != 1 or indptr.numel() != n + 1:
        raise ValueError(f"{who}: indptr must have n + 1 = {n + 1} entries, got shape {tuple(indptr.shape)}")
    nnz = int(indptr[-1]) if n > 0 else 0
    if indices.ndim != 1 or indices.numel() != nnz or values.ndim != 1 or values.numel() != nnz:
        raise ValueError(f"{who}: indices/values must be 1-D with indptr[-1] = {nnz} entries, "
                         f"got {tuple(indices.shape)} and {tuple(values.shape)}")
    if nnz and (int(indices.min()) < 0 or int(indices.max()) >= n):
        raise ValueError(f"{who}: column indices must lie in [0, {n}) (local ids of the diagonal block)")
    return n


def local_diagonal(indptr: Tensor, indices: Tensor, values: Tensor, n: int,
                   who: str = "local_diagonal") -> Tensor:
    """Diagonal of a CSR block (duplicates summed). ValueError naming the first
    row whose diagonal entry is missing or zero. Local."""
    n = _check_csr(indptr, indices, values, n, who)
    indptr = indptr.to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(n, device=indptr.device), indptr[1:] - indptr[:-1])
    on = indices.to(rows.device) == rows
    diag = torch.zeros(n, dtype=values.dtype, device=values.device)
    diag.index_add_(0, rows[on].to(values.device), values[on.to(values.device)])
    present = torch.zeros(n, dtype=torch.bool, device=rows.device)
    present[rows[on]] = True
    bad = (~present) | (diag == 0).to(present.device)
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        what = "missing" if not bool(present[i]) else "zero"
        raise ValueError(f"{who}: diagonal entry of local row {i} is {what}")
    return diag


def _apply_diag(inv: Tensor) -> Callable[[Tensor], Tensor]:
    cache: dict = {}

    def inv_diag(dtype: torch.dtype, device: torch.device) -> Tensor:
        key = (dtype, device)
        d = cache.get(key)
        if d is None:
            d = cache[key] = inv.to(dtype=dtype, device=device)
        return d

    def apply(r: Tensor) -> Tensor:
        d = inv_diag(r.dtype, r.device)
        return r * (d if r.ndim == 1 else d.reshape((-1,) + (1,) * (r.ndim - 1)))

    # the Krylov kernels fuse ``z = r * inv_diag`` into preallocated storage
    apply.inv_diag = inv_diag
    return apply


def jacobi(indptr: Tensor, indices: Tensor, values: Tensor, n: int) -> Callable[[Tensor], Tensor]:
    """Point Jacobi: ``apply(r) = r / diag(A_local)``. Local."""
    diag = local_diagonal(indptr, indices, values, n, who="jacobi")
    return _apply_diag(1.0 / diag)


def _to_scipy(indptr, indices, values, n):
    import scipy.sparse as sp
    A = sp.csr_matrix((values.detach().cpu().to(torch.float64).numpy(),
                       indices.detach().cpu().numpy().astype(np.int64),
                       indptr.detach().cpu().numpy().astype(np.int64)), shape=(n, n))
    A.sum_duplicates()
    A.sort_indices()
    return A


def _petsc_factor(A, kind):
    from petsc4py import PETSc
    n = A.shape[0]
    it = PETSc.IntType
    mat = PETSc.Mat().createAIJ(size=(n, n), csr=(A.indptr.astype(it), A.indices.astype(it),
                                                   A.data.astype(PETSc.ScalarType)),
                                comm=PETSc.COMM_SELF)
    mat.assemble()
    pc = PETSc.PC().create(comm=PETSc.COMM_SELF)
    pc.setType("icc" if kind == "ic0" else "ilu")
    pc.setOperators(mat)
    pc.setFactorLevels(0)
    pc.setFactorOrdering("natural")
    try:
        pc.setUp()
    except PETSc.Error as e:  # zero pivot etc.
        raise ValueError(f"block_jacobi_ilu: PETSc {kind} factorisation of the local block failed: {e}") from None
    xv = mat.createVecRight()
    yv = mat.createVecLeft()

    def solve(rhs: np.ndarray) -> np.ndarray:
        xv.setArray(rhs)
        pc.apply(xv, yv)
        return yv.getArray().copy()

    solve._keep = (mat, pc, xv, yv)  # keep PETSc objects alive
    # PETSc may record a zero pivot instead of raising: probe the factor once
    try:
        probe = solve(np.ones(n))
    except PETSc.Error as e:
        raise ValueError(f"block_jacobi_ilu: PETSc {kind} factorisation of the local block failed: {e}") from None
    if not np.all(np.isfinite(probe)):
        raise ValueError(f"block_jacobi_ilu: PETSc {kind} factorisation of the local block has a zero pivot")
    return solve


def _scipy_factor(A, kind):
    # SciPy has no ILU(0)/IC(0) (spilu's threshold ILU is neither, and it is not
    # symmetric, so CG can fail with it): without PETSc, solve the local block
    # exactly with SuperLU's sparse LU. Still block Jacobi across ranks, still
    # sparse, and symmetric positive definite whenever the block is.
    import scipy.sparse.linalg as spla
    try:
        fac = spla.splu(A.tocsc())
    except RuntimeError as e:  # singular block
        raise ValueError(f"block_jacobi_ilu: LU of the local block failed: {e}") from None
    return fac.solve


def block_jacobi_ilu(indptr: Tensor, indices: Tensor, values: Tensor, n: int,
                     kind: str = "ilu0", factor: str = "auto") -> Callable[[Tensor], Tensor]:
    """Incomplete factorisation of the local diagonal block (block Jacobi / ILU).

    ``kind``: ``"ilu0"`` or ``"ic0"``. ``factor``: ``"auto"`` (PETSc if petsc4py
    imports, else SciPy), ``"petsc"`` or ``"scipy"`` — see the module docstring.
    Sparse throughout (no dense block). Local. ValueError if the diagonal is
    missing/zero or the factorisation hits a zero pivot.
    """
    if kind not in ("ilu0", "ic0"):
        raise ValueError(f"block_jacobi_ilu: kind must be 'ilu0' or 'ic0', got {kind!r}")
    if factor not in ("auto", "petsc", "scipy"):
        raise ValueError(f"block_jacobi_ilu: factor must be 'auto', 'petsc' or 'scipy', got {factor!r}")
    n = _check_csr(indptr, indices, values, n, "block_jacobi_ilu")
    local_diagonal(indptr, indices, values, n, who="block_jacobi_ilu")
    A = _to_scipy(indptr, indices, values, n)
    if n == 0:
        return lambda r: r.clone()
    if factor == "auto":
        try:
            import petsc4py  # noqa: F401
            from petsc4py import PETSc  # noqa: F401
            factor = "petsc" if np.dtype(PETSc.ScalarType).kind == "f" else "scipy"
        except ImportError:
            factor = "scipy"
    solve = _petsc_factor(A, kind) if factor == "petsc" else _scipy_factor(A, kind)

    def apply(r: Tensor) -> Tensor:
        rn = r.detach().to(device="cpu", dtype=torch.float64).numpy()
        if rn.ndim == 1:
            z = solve(np.ascontiguousarray(rn))
        else:
            flat = rn.reshape(rn.shape[0], -1)
            z = np.stack([solve(np.ascontiguousarray(flat[:, j])) for j in range(flat.shape[1])], axis=1)
            z = z.reshape(rn.shape)
        return torch.from_numpy(np.asarray(z)).to(device=r.device, dtype=r.dtype)

    apply.kind = kind
    apply.factor = factor
    return apply


def from_callable(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Wrap a user function ``fn(r) -> z`` as a preconditioner apply. Local.

    The result is checked to have ``r``'s shape and is moved to ``r``'s
    dtype/device. ``fn`` must act on the rank's owned rows (it may communicate
    if it is itself collective)."""
    if not callable(fn):
        raise TypeError(f"from_callable: fn must be callable, got {type(fn).__name__}")

    def apply(r: Tensor) -> Tensor:
        z = fn(r)
        if not isinstance(z, torch.Tensor):
            z = torch.as_tensor(z)
        if tuple(z.shape) != tuple(r.shape):
            raise ValueError(f"from_callable: preconditioner returned shape {tuple(z.shape)}, "
                             f"expected {tuple(r.shape)}")
        return z.to(dtype=r.dtype, device=r.device)

    apply.fn = fn
    return apply
