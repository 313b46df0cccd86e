"""The test suite's matrices: small reference matrices, the named random families of the
property tests (docs/testing.md), their distribution over ranks, the SIMP topology system.
Every rank builds the same global matrix from the same seed."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["poisson_matrix", "grid_coords", "random_matrix", "block_spd_matrix", "spd_matrix",
           "nonsymmetric_matrix", "symmetric_indefinite_matrix", "graph_laplacian", "separated_spectrum_matrix",
           "repeated_spectrum_matrix", "mass_like_matrix", "random_block_matrix", "with_empty_rows",
           "random_coords", "random_partition", "MATRIX_KINDS", "case_matrix", "distribute", "distribute_or_none",
           "simp_mbb_system"]


# -- small test matrices (global, SciPy CSR; every rank builds the same one) ----

def poisson_matrix(shape: Sequence[int]):
    """Local. Finite-difference Laplacian (5-point in 2-D, 7-point in 3-D) on a grid, CSR."""
    import scipy.sparse as sp
    terms = []
    for axis, m in enumerate(shape):
        t = sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(m, m))
        mats = [sp.identity(k, format="csr") for k in shape]
        mats[axis] = t
        k = mats[0]
        for mat in mats[1:]:
            k = sp.kron(k, mat, format="csr")
        terms.append(k)
    return sum(terms).tocsr()


def grid_coords(shape: Sequence[int]) -> np.ndarray:
    """Local. Coordinates ``(prod(shape), d)`` of the grid points of :func:`poisson_matrix`."""
    axes = [np.arange(m, dtype=float) for m in shape]
    return np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1).reshape(-1, len(shape))


def random_matrix(n: int, m: Optional[int] = None, density: float = 0.05, seed: int = 0,
                  empty_rows: Sequence[int] = ()):
    """Local. A random nonsymmetric sparse matrix (CSR, float64) with a nonzero
    diagonal; the rows ``empty_rows`` are left without any stored entry."""
    import scipy.sparse as sp
    m = n if m is None else m
    rng = np.random.default_rng(seed)
    A = sp.random(n, m, density=density, random_state=rng, format="csr")
    A = (A + sp.eye(n, m, format="csr") * 4.0).tocsr()
    if len(empty_rows):
        keep = np.ones(n)
        keep[list(empty_rows)] = 0.0
        A = (sp.diags(keep) @ A).tocsr()
        A.eliminate_zeros()
    A.sort_indices()
    return A


def block_spd_matrix(shape: Sequence[int], b: int, seed: int = 0):
    """Local. An elasticity-like SPD block matrix (BSR, ``b x b`` blocks) on a grid:
    the scalar Laplacian pattern with every entry replaced by a ``b x b`` block
    (diagonal blocks SPD and dominant, off-diagonal blocks symmetric pairs)."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    L = poisson_matrix(shape).tocoo()
    n = L.shape[0]
    off = L.row != L.col
    r, c = L.row[off], L.col[off]
    upper = r < c
    ru, cu = r[upper], c[upper]
    Bu = rng.uniform(-0.5, 0.5, size=(ru.size, b, b)) - np.eye(b)
    rows = np.concatenate([ru, cu, np.arange(n)])
    cols = np.concatenate([cu, ru, np.arange(n)])
    G = rng.uniform(-0.5, 0.5, size=(n, b, b))
    D = np.einsum("kij,klj->kil", G, G) + np.eye(b) * (2.0 * b * 8)
    data = np.concatenate([Bu, np.transpose(Bu, (0, 2, 1)), D])
    order = np.lexsort((cols, rows))
    rows, cols, data = rows[order], cols[order], data[order]
    indptr = np.concatenate([[0], np.cumsum(np.bincount(rows, minlength=n))])
    return sp.bsr_matrix((data, cols, indptr), shape=(n * b, n * b))


# -- generators for property-based tests (docs/testing.md) ----------------------
# Every generator is Local and deterministic in its arguments, so every rank of an
# MPI test builds the same matrix from the same small parameter dictionary: no
# arrays travel, and a failing example prints as a few integers.

def _sym_random(n: int, density: float, rng):
    """Local. Random symmetric sparse matrix with zero diagonal, entries in (-1, 1)."""
    import scipy.sparse as sp
    S = sp.random(n, n, density=density, random_state=rng, format="csr",
                  data_rvs=lambda k: rng.uniform(-1.0, 1.0, k))
    S = sp.triu(S, 1)
    return (S + S.T).tocsr()


def _finish(A):
    import scipy.sparse as sp
    A = sp.csr_matrix(A)
    A.sum_duplicates()
    A.eliminate_zeros()
    A.sort_indices()
    return A


def spd_matrix(n: int, seed: int = 0, density: float = 0.2):
    """Local. A random sparse SPD matrix (CSR): symmetric, strictly diagonally dominant
    with margin >= 1, so its eigenvalues lie in ``[1, 2 max_i R_i + 2]`` (R_i: the
    off-diagonal absolute row sum) and it is well conditioned."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    S = _sym_random(n, density, rng)
    R = np.asarray(abs(S).sum(axis=1)).ravel()
    return _finish(S + sp.diags(R + 1.0 + rng.uniform(0.0, 1.0, n)))


def nonsymmetric_matrix(n: int, seed: int = 0, density: float = 0.2):
    """Local. A random sparse nonsymmetric matrix (CSR), strictly row and column
    diagonally dominant (margin >= 1), hence nonsingular and well conditioned."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    S = sp.random(n, n, density=density, random_state=rng, format="csr",
                  data_rvs=lambda k: rng.uniform(-1.0, 1.0, k))
    S = S - sp.diags(S.diagonal())
    R = np.maximum(np.asarray(abs(S).sum(axis=1)).ravel(), np.asarray(abs(S).sum(axis=0)).ravel())
    return _finish(S + sp.diags(R + 1.0 + rng.uniform(0.0, 1.0, n)))


def symmetric_indefinite_matrix(n: int, seed: int = 0, density: float = 0.2):
    """Local. A random sparse symmetric indefinite matrix (CSR): diagonal entries
    ``+-(R_i + 1 + u)`` with both signs present, so (Gershgorin) every eigenvalue
    has magnitude >= 1 and there are positive and negative ones."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    S = _sym_random(n, density, rng)
    R = np.asarray(abs(S).sum(axis=1)).ravel()
    sign = rng.choice([-1.0, 1.0], n)
    sign[0], sign[-1] = 1.0, -1.0
    return _finish(S + sp.diags(sign * (R + 1.0 + rng.uniform(0.0, 1.0, n))))


def graph_laplacian(n: int, seed: int = 0, density: float = 0.2):
    """Local. The weighted Laplacian ``D - W`` of a random connected graph (a path plus
    random edges, positive weights): symmetric positive semidefinite and singular,
    null space spanned by the constant vector."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    W = abs(_sym_random(n, density, rng))
    path = sp.diags(rng.uniform(0.5, 1.5, n - 1), 1, shape=(n, n))
    W = (W + path + path.T).tocsr()
    return _finish(sp.diags(np.asarray(W.sum(axis=1)).ravel()) - W)


def separated_spectrum_matrix(n: int, seed: int = 0, gap: float = 1.0, density: float = 0.2):
    """Local. A sparse symmetric matrix with well-separated eigenvalues: ``diag(d) + E``
    with ``d_{i+1} - d_i >= gap`` (shuffled) and ``||E||_2 <= gap / 4``, so (Weyl)
    neighbouring eigenvalues are at least ``gap / 2`` apart. Spectrum in roughly
    ``[1, 1 + 2 n gap]``, all positive."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    d = 1.0 + np.cumsum(gap * (1.0 + rng.uniform(0.0, 1.0, n))) - gap
    E = _sym_random(n, density, rng)
    R = float(np.asarray(abs(E).sum(axis=1)).max()) if E.nnz else 1.0
    E = E * (gap / (4.0 * max(R, 1e-300)))
    return _finish(E + sp.diags(rng.permutation(d)))


def repeated_spectrum_matrix(A, copies: int = 2, seed: int = 0):
    """Local. ``P (I_copies (x) A) P^T`` for a random permutation ``P``: every eigenvalue
    of ``A`` repeated ``copies`` times, the copies' rows interleaved (so no partition
    separates them)."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    B = sp.kron(sp.identity(copies, format="csr"), sp.csr_matrix(A), format="csr")
    p = rng.permutation(B.shape[0])
    return _finish(B[p][:, p])


def mass_like_matrix(A, seed: int = 0):
    """Local. An SPD "mass matrix" with the pattern of ``A``'s symmetric part: positive
    off-diagonal entries and a dominant diagonal (eigenvalues in about ``[1, 3]``),
    as a P1 mass matrix, for generalized problems ``A v = w M v``; BSR with ``A``'s
    block size when ``A`` is BSR."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    P = abs(sp.csr_matrix(A)) + abs(sp.csr_matrix(A)).T
    P = sp.triu(P, 1).tocoo()
    U = sp.coo_matrix((rng.uniform(0.1, 1.0, P.nnz), (P.row, P.col)), shape=A.shape)
    S = (U + U.T).tocsr()
    R = np.asarray(S.sum(axis=1)).ravel()
    scale = 1.0 / max(float(R.max()), 1.0)
    S = S * scale
    M = _finish(S + sp.diags(np.asarray(S.sum(axis=1)).ravel() + 1.0 + rng.uniform(0.0, 0.5, A.shape[0])))
    if sp.isspmatrix_bsr(A) and A.blocksize != (1, 1):
        return sp.bsr_matrix(M, blocksize=A.blocksize)  # same (block) layout as A
    return M


def random_block_matrix(nb: int, b: int, seed: int = 0, symmetric: bool = True, density: float = 0.3):
    """Local. A random BSR matrix of ``nb x nb`` dense ``b x b`` blocks (scalar size
    ``nb*b``) on a random node graph, strictly diagonally dominant with margin >= 1:
    SPD when ``symmetric``, else nonsymmetric (and nonsingular)."""
    import scipy.sparse as sp
    rng = np.random.default_rng(seed)
    G = sp.random(nb, nb, density=density, random_state=rng, format="coo")
    keep = G.row != G.col
    r, c = G.row[keep], G.col[keep]
    if symmetric:
        up = r < c
        r, c = r[up], c[up]
    blocks = rng.uniform(-1.0, 1.0, (r.size, b, b))
    if symmetric:
        r, c = np.concatenate([r, c]), np.concatenate([c, r])
        blocks = np.concatenate([blocks, np.transpose(blocks, (0, 2, 1))])
    rows = (r[:, None, None] * b + np.arange(b)[None, :, None] + 0 * blocks).ravel()
    cols = (c[:, None, None] * b + np.arange(b)[None, None, :] + 0 * blocks).ravel()
    S = sp.coo_matrix((blocks.ravel(), (rows.astype(np.int64), cols.astype(np.int64))),
                      shape=(nb * b, nb * b)).tocsr()
    D = rng.uniform(-1.0, 1.0, (nb, b, b))
    if symmetric:
        D = 0.5 * (D + np.transpose(D, (0, 2, 1)))
    D = sp.block_diag(list(D), format="csr")
    S = S + D - sp.diags(D.diagonal())
    R = np.maximum(np.asarray(abs(S).sum(axis=1)).ravel(), np.asarray(abs(S).sum(axis=0)).ravel())
    A = S + sp.diags(R + 1.0 + rng.uniform(0.0, 1.0, nb * b))
    return sp.bsr_matrix(_finish(A), blocksize=(b, b))


def with_empty_rows(A, rows: Sequence[int], keep_diagonal: bool = False):
    """Local. ``A`` (CSR) with the rows ``rows`` emptied. ``keep_diagonal=False``: no
    stored entry is left in those rows (the matrix is singular). ``keep_diagonal=True``:
    the rows *and columns* keep only their diagonal entry (symmetry and definiteness
    of ``A`` are kept: the operator stays nonsingular; such rows have no ghosts)."""
    import scipy.sparse as sp
    A = sp.csr_matrix(A, copy=True)
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    mask = np.zeros(A.shape[0], dtype=bool)
    mask[rows] = True
    C = A.tocoo()
    if keep_diagonal:
        drop = (mask[C.row] | mask[C.col]) & (C.row != C.col)
    else:
        drop = mask[C.row]
    B = sp.coo_matrix((C.data[~drop], (C.row[~drop], C.col[~drop])), shape=A.shape).tocsr()
    B.sort_indices()
    return B


def random_coords(n: int, d: int = 2, seed: int = 0) -> np.ndarray:
    """Local. ``(n, d)`` random points in the unit cube (for rcb / hilbert)."""
    return np.random.default_rng(seed).uniform(0.0, 1.0, (n, d))


def random_partition(n: int, nparts: int, seed: int = 0):
    """Local. A random :class:`slasolve.partition.Partition` of ``n`` rows into
    ``nparts`` non-empty parts (rows scattered across parts, not contiguous)."""
    from ..partition import Partition
    if not 1 <= nparts <= n:
        raise ValueError(f"need 1 <= nparts <= n, got nparts={nparts}, n={n}")
    rng = np.random.default_rng(seed)
    parts = rng.integers(0, nparts, n)
    parts[rng.permutation(n)[:nparts]] = np.arange(nparts)
    return Partition.from_parts(parts, nparts, method="random")


# -- named matrix families for property tests ------------------------------------------

#: kind -> (symmetric, definite, singular): what a solver may assume about each family
MATRIX_KINDS = {
    "spd": (True, True, False),            # random, diagonally dominant
    "nonsym": (False, False, False),       # random, row/column diagonally dominant
    "symindef": (True, False, False),      # random symmetric indefinite, |eigenvalues| >= 1
    "grid2d": (True, True, False),         # square-grid Laplacian: repeated eigenvalues
    "grid3d": (True, True, False),         # cube-grid Laplacian: eigenvalues of multiplicity 3
    "block2": (True, True, False),         # BSR 2x2, SPD
    "block3": (True, True, False),         # BSR 3x3, SPD
    "block2ns": (False, False, False),     # BSR 2x2, nonsymmetric
    "elastic2": (True, True, False),       # BSR 2x2 on a grid (block_spd_matrix)
    "diagrows": (True, True, False),       # SPD with some rows/columns holding only the diagonal
    "repeated": (True, True, False),       # every eigenvalue twice or three times
    "separated": (True, True, False),      # eigenvalues at least `gap / 2` apart
    "laplacian": (True, False, True),      # graph Laplacian: singular (constants)
    "emptyrows": (False, False, True),     # SPD with some rows stored empty: singular, nonsymmetric
    "emptyrows_ns": (False, False, True),  # nonsymmetric with some empty rows: singular
}


def case_matrix(kind: str, n: int, seed: int = 0):
    """Local. ``(A, coords, block)`` for a named matrix family (:data:`MATRIX_KINDS`) of
    about ``n`` scalar unknowns: ``A`` SciPy CSR (BSR for block kinds), ``coords``
    ``(block rows, d)`` for geometric partitioners, ``block`` the block size (1 scalar).
    Deterministic in ``(kind, n, seed)``; at least 4 block rows."""
    rng = np.random.default_rng(seed + 7919)
    n = max(int(n), 8)
    if kind in ("grid2d", "elastic2"):
        m = max(3, int(round(np.sqrt(n / (2 if kind == "elastic2" else 1)))))
        coords = grid_coords((m, m))
        if kind == "grid2d":
            return poisson_matrix((m, m)), coords, 1
        return block_spd_matrix((m, m), 2, seed=seed), coords, 2
    if kind == "grid3d":
        m = min(max(2, int(round(n ** (1 / 3)))), 4)
        return poisson_matrix((m, m, m)), grid_coords((m, m, m)), 1
    if kind.startswith("block"):
        b = int(kind[5])
        nb = max(4, n // b)
        return random_block_matrix(nb, b, seed, symmetric=not kind.endswith("ns")), random_coords(nb, 2, seed), b
    if kind == "repeated":
        copies = 2 + seed % 2
        base = spd_matrix(max(4, n // copies), seed)
        A = repeated_spectrum_matrix(base, copies, seed)
        return A, random_coords(A.shape[0], 2, seed), 1
    makers = {"spd": spd_matrix, "nonsym": nonsymmetric_matrix, "symindef": symmetric_indefinite_matrix,
              "laplacian": graph_laplacian, "separated": separated_spectrum_matrix,
              "diagrows": spd_matrix, "emptyrows": spd_matrix, "emptyrows_ns": nonsymmetric_matrix}
    if kind not in makers:
        raise ValueError(f"unknown matrix kind {kind!r}; expected one of {sorted(MATRIX_KINDS)}")
    A = makers[kind](n, seed)
    if kind in ("diagrows", "emptyrows", "emptyrows_ns"):
        rows = rng.choice(n, size=max(1, n // 6), replace=False)
        A = with_empty_rows(A, rows, keep_diagonal=(kind == "diagrows"))
    return A, random_coords(n, 2, seed), 1


def distribute(A, comm, partition: str = "contiguous", coords=None, seed: int = 0):
    """Collective. ``DSparseTensor.from_global(A, comm, ...)`` with a named partition:
    ``contiguous``, ``metis``, ``rcb``, ``hilbert`` (with ``coords``) or ``random``
    (:func:`random_partition` of the block rows, seeded)."""
    from ..dsparse import DSparseTensor
    if partition == "random":
        nb = A.shape[0] // (A.blocksize[0] if hasattr(A, "blocksize") else 1)
        part = random_partition(nb, comm.Get_size(), seed)
        return DSparseTensor.from_global(A, comm, partition=part)
    if partition in ("rcb", "hilbert"):
        return DSparseTensor.from_global(A, comm, partition=partition, coords=coords)
    return DSparseTensor.from_global(A, comm, partition=partition)


def distribute_or_none(A, comm, partition: str = "contiguous", coords=None, seed: int = 0):
    """Collective. :func:`distribute`, or ``None`` on every rank when the partitioner
    leaves a rank without rows and ``from_global`` refuses it (a clear ValueError raised
    on every rank: a limitation, not a wrong answer). Other errors propagate."""
    try:
        return distribute(A, comm, partition, coords, seed)
    except ValueError as e:
        msg = str(e)
        if any(w in msg for w in ("empty", "no rows", "fewer than", "nparts <= n", "exceeds the number of rows")):
            return None
        raise


def simp_mbb_system(comm, nelx: int, nely: int):
    """Collective. The SIMP plane-stress MBB beam of ``examples/topology_optimisation.py``:
    ``(system, mesh)`` with ``system(rho) -> (K_bc, f_bc)`` for per-cell densities ``rho``
    (this rank's cells of the ``nelx x nely`` quad mesh)."""
    from ..fem import Assembler, DirichletBC, boundary_dofs, box_mesh
    mesh = box_mesh((nelx, nely), upper=(nelx, nely), cell="quad", comm=comm)
    space = Assembler(mesh, block_size=2)
    left = boundary_dofs(space, lambda x: x[:, 0] < 1e-9, components=[0])
    roller = boundary_dofs(space, lambda x: (x[:, 0] > nelx - 1e-9) & (x[:, 1] < 1e-9), components=[1])
    bc = DirichletBC(space, torch.sort(torch.cat([left, roller])).values, 0.0)
    f = space.zeros()
    dof = 2 * (nely * (nelx + 1)) + 1
    d0, d1 = space.dof_range
    if d0 <= dof < d1:
        f[dof - d0] = -1.0

    def system(rho):
        K = space.elasticity(1e-9 + rho ** 3 * (1.0 - 1e-9), 0.3, kind="plane_stress")
        return bc.apply(K, f)
    return system, mesh
