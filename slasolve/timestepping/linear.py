"""``M du/dt + K u = f(t, *params)``: linear time steps with the step matrix set up once.

Every step of a scheme (:mod:`slasolve.timestepping.schemes`) solves

    (alpha_0 M + dt beta_0 K) u_{n+1} = -sum_{j>=1} (alpha_j M + dt beta_j K) u_{n+1-j}
                                        + dt sum_j beta_j f(t_{n+1-j}),

with one matrix ``A = alpha_0 M + dt beta_0 K`` for all steps (BDF2: one more for its
backward Euler start). ``A`` is formed once per integration; its factorisation
(``method="direct"``: :func:`slasolve.factorized`) or Krylov solver and preconditioner
(:func:`slasolve.solve`'s cache: the values do not change, so nothing is set up again) serve
every step, forward and adjoint. The adjoint of a step is one transposed solve with the same
``A`` and products with ``M^T``, ``K^T``: no forward solve is repeated.

Per step, one halo exchange serves both matrices: ``M`` and ``K`` share a pattern, so their
rows are stacked into one ``2N x N`` row shard whose product is ``(M u, K u)`` (and
``(M^T mu, K^T mu)`` when both are exactly symmetric), and ``(M u_n, K u_n)``, computed after
the solve for ``u_n``, serve the next step's right-hand side. With
``method="direct"`` the factors are those of values this problem owns (formed in
``LinearTimeProblem.begin``), so a step calls the backend's solve alone; its backward-error
check (:data:`slasolve.direct.BACKWARD_ERROR_TOL`, as every direct solve) uses those products,
and the checks of up to ``CHECK_BATCH`` solves share one reduction (at the latest at the end
of each sweep, before anything is returned). The source's errors ride on the same reduction
(every rank calls the source at the same points; a rank where it raised goes on with a zero
source until then), so a source call costs no collective of its own.

The adjoint batches what the forward does not pay: the source's vector-Jacobian products are
summed per time level (Crank-Nicolson reads ``f(t_m)`` in steps ``m - 1`` and ``m``) and made
``ADJOINT_BATCH`` levels per autograd call (fewer where the pending cotangents would pass
``SOURCE_VJP_ENTRIES`` entries per rank: 512 KiB), and the gradients of ``M``'s and ``K``'s values
``ADJOINT_BATCH`` steps per halo exchange. ``backend="scipy"`` on several ranks factorises the
gathered step matrix on every rank (small problems): the forward and adjoint steps run on whole
vectors, the source gathered ``ADJOINT_BATCH`` levels at a time, instead of a distributed
factorisation's ~100 collectives per solve.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from mpi4py import MPI

from .._comm import allreduce_int, allreduce_max, check_collective, raise_collected
from ..autograd import matvec_value_grad
from ..dsparse import DSparseTensor
from ..layout import forward_product
from .schemes import Scheme, scheme as make_scheme

__all__ = ["LinearTimeProblem", "CHECK_BATCH", "ADJOINT_BATCH"]

#: direct solves (and source calls) whose backward-error checks (and errors) share one Allreduce
CHECK_BATCH = 256
#: adjoint steps whose source vector-Jacobian products (one autograd call) and value gradients of
#: ``M`` and ``K`` (one halo exchange) are made together
ADJOINT_BATCH = 32
#: the most ``batch x nnz`` entries of the batched value gradients' temporaries (32 MiB of float64)
VALUE_GRAD_ENTRIES = 1 << 22
#: about the most ``batch x rows`` entries of a rank's pending source cotangents (512 KiB of float64:
#: the batch pays where a step is cheap, on small vectors; a large step's VJP call costs little)
SOURCE_VJP_ENTRIES = 1 << 16


class _SolveChecks:
    """Collective (:meth:`add` and guarded source calls every ``CHECK_BATCH`` records,
    :meth:`flush`). The normwise backward errors ``max|r| / (||A|| max|x| + max|b|)`` of direct
    solves, as ``slasolve.direct`` checks every solve, and whether the source raised on this
    rank, reduced in batches: every rank records the same number of solves and source calls, so
    every rank reduces (and raises) at the same calls. ``what``: the factorisation, or None when
    the solves are Krylov solves (they check themselves; only the source's errors are kept).

    The maxima go into one buffer made once: a small tensor kept per solve until the flush
    would sit between the steps' freed vectors in the heap (which this PETSc build never trims:
    ``bench/memory_probe.py``), so a step's vectors could not reuse the space of the last step's:
    up to ``CHECK_BATCH`` states' worth of heap (17 MiB at 4,225 unknowns) for 24 bytes a solve."""

    def __init__(self, comm, what: Optional[str]):
        self.comm, self.what = comm, what
        self.batch = CHECK_BATCH
        self.local = torch.zeros((self.batch, 3), dtype=torch.float64)
        self._rows = self.local.unbind(0)   # views made once: no indexing per solve
        self.norms = [0.0] * self.batch
        self.n = 0             # solves recorded since the last flush (<= records)
        self.error: Optional[BaseException] = None
        self.records = 0       # solves and source calls since the last flush (the same on every rank)

    def add(self, r: torch.Tensor, x: torch.Tensor, b: torch.Tensor, anorm: float) -> None:
        with torch.no_grad():
            if r.numel():
                # NaN propagates through amax, inf through abs: a non-finite vector gives a non-finite maximum
                self._rows[self.n].copy_(torch.stack([r, x, b]).abs_().amax(1))
            else:
                self._rows[self.n].zero_()
        self.norms[self.n] = anorm
        self.n += 1
        self._count()

    def _count(self) -> None:
        self.records += 1
        if self.records >= self.batch:
            self.flush()

    def guarded(self, fn: Callable) -> Callable:
        """Local (the returned function is Collective every ``CHECK_BATCH`` calls). ``fn`` with its
        exceptions kept for the next :meth:`flush` (which raises on every rank): a failed call
        returns None, and the sweep goes on with the same calls on every rank until then. One rank:
        ``fn`` itself (its errors raised at once)."""
        if self.comm.Get_size() == 1:
            return fn

        def call(*args):
            out = None
            try:
                out = fn(*args)
            except Exception as e:  # noqa: BLE001 - user code: raised on every rank at the next flush
                self.keep(e)
            self._count()
            return out
        return call

    def keep(self, e: Exception) -> None:
        """Local. Keep ``e`` (the first one) for the next :meth:`flush`, or raise it now where every
        rank raises at this point anyway (one rank; a collective failure inside user code)."""
        if self.comm.Get_size() == 1 or getattr(e, "raised_on_every_rank", False):
            raise e
        if self.error is None:
            self.error = e

    def flush(self) -> None:
        if not self.records:
            return
        self.records = 0
        from ..direct import BACKWARD_ERROR_TOL, FactorizationError
        n, self.n = self.n, 0
        loc = torch.nan_to_num(self.local[:n], nan=math.inf)
        shape = loc.shape
        # the source's failure flag rides on the same reduction
        flat = torch.cat([loc.reshape(-1), torch.tensor([0.0 if self.error is None else 1.0], dtype=torch.float64)])
        glob = allreduce_max(self.comm, flat)
        anorm = torch.tensor(self.norms[:n], dtype=torch.float64)
        if float(glob[-1]) > 0:
            err, self.error = self.error, None
            raise_collected(self.comm, err, allreduce_int(self.comm, 0 if err is None else 1))
        if not shape[0]:
            return
        glob = glob[:-1].reshape(shape)
        rn, xn, bn = glob[:, 0], glob[:, 1], glob[:, 2]
        denom = anorm * xn + bn
        berr = torch.where(denom > 0, rn / torch.where(denom > 0, denom, torch.ones_like(denom)),
                           torch.where(rn > 0, torch.full_like(rn, math.inf), torch.zeros_like(rn)))
        worst = float(berr.max())
        if not bool(torch.isfinite(bn).all()):
            raise ValueError("time step solve: the right-hand side has NaN or infinite entries (from the "
                             "source, the state or the adjoint's loss gradient)")
        nonfinite = not bool(torch.isfinite(xn).all())
        if nonfinite or not worst <= BACKWARD_ERROR_TOL:
            what = "non-finite entries" if nonfinite else f"backward error {worst:.3e}"
            # every rank holds the same reduced numbers: every rank raises
            raise FactorizationError(f"time step solve: the {self.what} gave a solution with {what} "
                                     f"(> {BACKWARD_ERROR_TOL:.1e}): the step matrix is singular or too "
                                     "ill-conditioned for this factorisation")


class _Paired:
    """Collective (constructor). ``M`` and ``K`` (one pattern, scalar entries) as one
    ``2N x N`` row shard ``W``: each rank's ``n`` rows of ``M`` then its ``n`` rows of ``K``
    (rank ``r``'s block of ``W``'s rows is ``[2 r0, 2 r1)``), so ``W u`` is ``(M u, K u)``, one
    halo exchange and one CSR product for both. ``W``'s local arrays are those of ``M`` twice,
    concatenated: no position arrays are kept, and a refill is one concatenation."""

    def __init__(self, Md: DSparseTensor, Kd: DSparseTensor):
        indptr, indices, _ = Md.local_rows_csr()
        nnz = indices.numel()
        wptr = torch.cat([indptr, indptr[1:] + nnz])
        widx = torch.cat([indices, indices])
        N = Md.global_shape[0]
        # rows already sorted per row (those of M): from_local_rows keeps the arrays as given
        self.W = DSparseTensor.from_local_rows(wptr, widx, self._values(Md, Kd), (2 * N, N), Md.comm,
                                               n_local_cols=Md.n_local)

    @staticmethod
    def _values(Md: DSparseTensor, Kd: DSparseTensor) -> torch.Tensor:
        return torch.cat([Md.values, Kd.values])

    def refilled(self, Md: DSparseTensor, Kd: DSparseTensor) -> "_Paired":
        """Collective. The same pairing with new values (same patterns)."""
        import copy
        new = copy.copy(self)
        new.W = self.W.with_values(self._values(Md, Kd))
        new._rows = None
        return new

    _rows = None

    def product_full(self, u_full: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Local. ``(M u, K u)`` on the owned rows from the whole vector ``u`` (no exchange)."""
        wptr, widx, wv = self.W.local_rows_csr()
        n = (wptr.numel() - 1) // 2
        if wv.numel() == 0:
            z = u_full.new_zeros(n, dtype=self.W.dtype)
            return z, z.clone()
        if self._rows is None:
            self._rows = torch.sparse_csr_tensor(wptr, widx, wv, size=(wptr.numel() - 1, self.W.global_shape[1]),
                                                 check_invariants=False)
        y = torch.mv(self._rows, u_full.to(self.W.dtype))
        return y[:n], y[n:]

    def product(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collective. ``(M u, K u)`` (no autograd: the steps run under no_grad)."""
        if self.W.comm.Get_size() == 1:
            return self.product_full(u)      # no halo: the cached CSR tensor
        # the states are integrate's (u0 checked there) or the solves': no check, no exchange to poison
        y, _ = forward_product(self.W._layout, self.W.values, u.detach().to(self.W.dtype))
        n = y.shape[0] // 2
        return y[:n], y[n:]


def _gather_csr(A: DSparseTensor):
    """Collective (one allgather). ``A`` whole, as a SciPy CSR matrix on every rank, and the
    row counts per rank."""
    import numpy as np
    import scipy.sparse as sp
    indptr, indices, values = A.local_rows_csr()
    parts = A.comm.allgather((indptr.cpu().numpy(), indices.cpu().numpy(),
                              values.detach().to(torch.float64).cpu().numpy()))
    counts = np.array([p[0].size - 1 for p in parts], dtype=np.int64)
    ptr = np.concatenate([[0], np.cumsum(np.concatenate([np.diff(p[0]) for p in parts]))])
    N = int(counts.sum())
    G = sp.csr_matrix((np.concatenate([p[2][p[0][0]:p[0][-1]] for p in parts]),
                       np.concatenate([p[1][p[0][0]:p[0][-1]] for p in parts]), ptr), shape=(N, N))
    return G, counts


class _Redundant:
    """Collective (constructor, :meth:`solve_unchecked`, :meth:`gather`). A small step matrix
    gathered whole on every rank and factorised there (SuperLU, :func:`slasolve.factorized` on
    ``COMM_SELF``): a solve is one Allgatherv of the right-hand side and the same local solve on
    every rank, whose whole solution (:attr:`last_full`) also gives the products with ``M`` and
    ``K`` without a halo exchange; :meth:`solve_full` solves with a whole right-hand side and no
    communication. A distributed (MUMPS) solve makes ~100 collectives at 2 ranks."""

    def __init__(self, A: DSparseTensor):
        import numpy as np
        from ..direct import factorized
        self.comm = A.comm
        G, self.counts = _gather_csr(A)
        self.offsets = np.concatenate([[0], np.cumsum(self.counts)[:-1]])
        self.r0 = int(self.offsets[self.comm.Get_rank()])
        self.r1 = self.r0 + int(self.counts[self.comm.Get_rank()])
        err = F = None
        try:
            F = factorized(DSparseTensor.from_global(G, MPI.COMM_SELF), backend="scipy")
        except Exception as e:  # noqa: BLE001 - the same matrix everywhere; combined to be sure
            err = e
        check_collective(self.comm, err)
        self.F, self.info, self.operator_norms = F, F.info, F.operator_norms
        self.dtype = A.dtype
        self.last_full: Optional[torch.Tensor] = None

    def gather(self, v: torch.Tensor) -> torch.Tensor:
        """Collective (one Allgatherv). The whole vector from every rank's owned rows; ``v`` may
        also be ``(k, n_local)``: ``(k, N)``, one message for all ``k``."""
        import numpy as np
        k = 1 if v.dim() == 1 else int(v.shape[0])
        buf = np.empty(int(self.counts.sum()) * k, dtype=np.float64)
        self.comm.Allgatherv(np.ascontiguousarray(v.detach().to(torch.float64).cpu().numpy()).reshape(-1),
                             [buf, self.counts * k, self.offsets * k, MPI.DOUBLE])
        if v.dim() == 1:
            return torch.from_numpy(buf).to(self.dtype)
        # rank r's block is (k, n_r): put its columns in place
        blocks = np.split(buf, np.cumsum(self.counts * k)[:-1])
        return torch.from_numpy(np.concatenate([b.reshape(k, -1) for b in blocks], axis=1)).to(self.dtype)

    def solve_full(self, b_full: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        """Local. ``A^{-1} b`` (``A^{-T} b``) for the whole ``b`` (the same on every rank)."""
        x = self.F.solve_unchecked(b_full, transpose=transpose).to(self.dtype)
        self.last_full = x
        return x

    def solve_unchecked(self, b: torch.Tensor, transpose: bool = False) -> torch.Tensor:
        x = self.solve_full(self.gather(b), transpose)
        return x[self.r0:self.r1].to(b.device)


def _same_pattern(M: DSparseTensor, K: DSparseTensor) -> bool:
    if M._layout is K._layout:
        return True
    a, b = M.local_rows_csr(), K.local_rows_csr()
    return (M.global_shape == K.global_shape and M.row_range == K.row_range and a[0].shape == b[0].shape
            and a[1].shape == b[1].shape and bool(torch.equal(a[0].cpu(), b[0].cpu()))
            and bool(torch.equal(a[1].cpu(), b[1].cpu())))


class LinearTimeProblem:
    """Collective (constructor). The linear ODE ``M du/dt + K u = f(t, *params)`` on a row shard.

    Parameters
    ----------
    M, K : DSparseTensor
        Square row-shard matrices with the same sparsity pattern and row distribution (e.g.
        an :class:`slasolve.fem.Assembler`'s ``mass()`` and ``stiffness(kappa)``). Their
        values may require grad (a conductivity behind ``K``): gradients reach them.
        Homogeneous Dirichlet conditions: eliminate them from both (``DirichletBC.apply``)
        and keep ``u0`` and ``f`` zero on the constrained rows.
    source : callable ``f(t, *params) -> tensor``, optional
        This rank's owned rows of ``f`` at time ``t`` (a float); differentiable in the
        tensor ``params`` given to :func:`integrate`. Called collectively (it may
        communicate). Default: no source.
    scheme : str or float
        ``"crank_nicolson"`` (``"cn"``, default), ``"backward_euler"`` (``"be"``), ``"bdf2"``
        or a theta in ``[0.5, 1]``.
    method : str
        ``"direct"`` (default: one sparse LU / Cholesky for all steps, :func:`slasolve.factorized`)
        or a Krylov method of :func:`slasolve.solve` (``"cg"`` for symmetric ``M``, ``K``).
    pc, rtol, backend, solver_options
        For Krylov methods: the preconditioner, the relative tolerance of every solve
        (forward and adjoint; default ``1e-10``), the backend, and further
        :func:`slasolve.solve` keyword arguments. ``backend`` also picks the direct solver:
        ``"petsc"`` (MUMPS, distributed) or ``"scipy"`` (SuperLU; on several ranks every rank
        gathers the whole step matrices once and factorises the step matrix: the forward steps
        run on whole vectors, the same on every rank, with one Allgatherv per 32 source levels,
        and so do the adjoint steps (an Allgatherv only where the loss adds a gradient, or for
        BDF2). For small problems, where a distributed solve's ~100 collectives per call at 2
        ranks dominate a step; every rank holds the whole matrices and factors).

    Raises ValueError / TypeError on every rank for matrices of different patterns, shapes
    or distributions, or bad settings.
    """

    def __init__(self, M: DSparseTensor, K: DSparseTensor, source: Optional[Callable] = None, *,
                 scheme: Union[str, float, Scheme] = "crank_nicolson", method: str = "direct",
                 pc: Optional[str] = None, rtol: float = 1e-10, backend: Optional[str] = None,
                 solver_options: Optional[dict] = None):
        err = None
        comm = M.comm if isinstance(M, DSparseTensor) else None
        try:
            if not isinstance(M, DSparseTensor) or not isinstance(K, DSparseTensor):
                raise TypeError(f"M and K must be DSparseTensors, got {type(M).__name__} and {type(K).__name__}")
            if not (M.is_row_shard and K.is_row_shard):
                raise ValueError("M and K must be row shards")
            if M.global_shape[0] != M.global_shape[1]:
                raise ValueError(f"M and K must be square, got {M.global_shape}")
            if not _same_pattern(M, K):
                raise ValueError("M and K must have the same sparsity pattern and row distribution (assemble "
                                 "both with the same Assembler, or store explicit zeros)")
            if M.dtype != K.dtype:
                raise TypeError(f"M and K must have the same dtype, got {M.dtype} and {K.dtype}")
            if source is not None and not callable(source):
                raise TypeError(f"source must be callable f(t, *params), got {type(source).__name__}")
            self.scheme = make_scheme(scheme)
            if not isinstance(method, str):
                raise TypeError(f"method must be a string, got {type(method).__name__}")
            if not (isinstance(rtol, (int, float)) and 0 < rtol < 1):
                raise ValueError(f"rtol must be in (0, 1), got {rtol!r}")
        except (TypeError, ValueError) as e:
            err = e
        if comm is None:
            raise err
        check_collective(comm, err, agree={"scheme": repr(scheme), "method": method, "pc": repr(pc),
                                           "rtol": repr(rtol), "backend": repr(backend),
                                           "source given": source is not None})
        self.M, self.K = M, K
        # its errors are combined over the ranks in each integration's batched checks (begin)
        self.source = None if source is None else self._checked_source(source, M.n_local)
        self.method, self.pc, self.rtol, self.backend = method, pc, float(rtol), backend
        self.solver_options = dict(solver_options or {})
        self.comm = M.comm
        self.n_local = M.n_local
        self.dtype = M.dtype
        self._ops: Dict[tuple, tuple] = {}
        self._pairs = None   # ((M's layout, K's layout), the _Paired of the last begin)
        self.linear_solves = 0
        self.transposed_solves = 0

    # -- the interface the trajectory uses (slasolve.timestepping.trajectory) --------------
    @property
    def history(self) -> int:
        """Local. Past states a step reads (1; BDF2: 2)."""
        return self.scheme.history

    def adjoint_needs_states(self, want_inputs) -> bool:
        """Local. Whether :meth:`adjoint` reads the states: only for the gradients of ``M``'s or
        ``K``'s values (``want_inputs``); ``u0``'s and the source params' need ``mu`` alone (the
        source does not depend on the state)."""
        return any(want_inputs)

    def inputs(self) -> Tuple[torch.Tensor, ...]:
        """Local. The tensors besides ``u0`` and ``params`` that the trajectory depends on."""
        return (self.M.values, self.K.values)

    def begin(self, dt: float) -> "LinearTimeProblem":
        """Collective. A copy of this problem that integrates with step ``dt``: the step
        matrices formed (and factorised) from the current values, its own counters."""
        import copy
        st = copy.copy(self)
        st._dt = float(dt)
        st._Md, st._Kd = self.M.detach(), self.K.detach()
        st._ops = {}
        st.linear_solves = st.transposed_solves = 0
        # the pairing before the factorisations: the heap space its temporaries leave (never given
        # back in this PETSc build) serves the factorisations' allocations instead of adding to them
        st._MK = None
        if not self.M.block_shape:
            key = (self.M._layout, self.K._layout)
            same = self._pairs is not None and self._pairs[0][0] is key[0] and self._pairs[0][1] is key[1]
            st._MK = self._pairs[1].refilled(st._Md, st._Kd) if same else _Paired(st._Md, st._Kd)
            self._pairs = (key, st._MK)
        for n in range(len(self.scheme.starters) + 1):
            alpha, beta = self.scheme.coefficients(n)
            key = (alpha[0], beta[0])
            if key not in st._ops:
                st._ops[key] = st._operator(alpha[0], beta[0] * st._dt, first=not st._ops)
        # symmetric M and K: (M^T mu, K^T mu) is the paired product too
        from ..symmetry import exactly_symmetric
        st._symmetric = st._MK is not None and exactly_symmetric(st._Md) and exactly_symmetric(st._Kd)
        st._products = []     # [(u, M u, K u)] of the latest states (the next step's right-hand side)
        F = next(iter(st._ops.values()))[1]
        st._checks = _SolveChecks(self.comm, None if F is None else
                                  f"{F.info.factorization or ''} factorisation ({F.info.backend})")
        st._src = None if self.source is None else st._checks.guarded(self.source)
        st._fcache = {}  # time level -> f(t_m) of the latest forward steps (no autograd)
        # the redundant forward (backend="scipy" on several ranks): M and K whole and their owned rows
        # (no autograd), the latest states whole, f(t_m) whole for a batch of levels
        st._full_M = st._full_K = None
        st._wholes, st._fwhole, st._adj_wholes = [], {}, []
        if st._MK is not None and all(isinstance(F, _Redundant) for _, F in st._ops.values()):
            (st._full_M, st._full_K, st._full_M_rows, st._full_K_rows, st._full_MT,
             st._full_KT) = st._whole_matrices()
        st._cot = {}     # time level -> the source's pending cotangent (the adjoint's batched VJPs)
        # levels per source VJP: their cotangents (vectors of owned rows) are held until the batch is
        # full (and the VJP's temporaries are as many), so about SOURCE_VJP_ENTRIES entries per rank;
        # from global sizes alone: the same on every rank without a collective (the source is
        # called collectively)
        N, P = self.M.global_shape[0], self.comm.Get_size()
        st._src_batch = max(1, min(ADJOINT_BATCH, (SOURCE_VJP_ENTRIES * P) // max(1, N)))
        st._vg = ([], [], [])   # the adjoint's pending (mu, M's U, K's U) for the values' gradients
        st._vg_batch = None     # set (collectively) by the first adjoint step that needs it
        return st

    def _whole_matrices(self):
        """Collective (two allgathers). ``M``, ``K`` whole, their owned rows, and ``M^T``, ``K^T``
        whole, torch CSR."""
        out = []
        for D in (self._Md, self._Kd):
            G, counts = _gather_csr(D)
            r0 = int(counts[:self.comm.Get_rank()].sum())
            for part in (G, G[r0:r0 + D.n_local], G.T):
                part = part.tocsr()
                out.append(torch.sparse_csr_tensor(torch.from_numpy(part.indptr.astype("int64")),
                                                   torch.from_numpy(part.indices.astype("int64")),
                                                   torch.from_numpy(part.data).to(self.dtype), size=part.shape,
                                                   check_invariants=False))
        return out[0], out[3], out[1], out[4], out[2], out[5]

    def _pair(self, u: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collective (one halo exchange; none when ``u`` is one of the latest states).
        ``(M u, K u)``."""
        for v, Mu, Ku in self._products:
            if v is u:
                return Mu, Ku
        Mu, Ku = self._paired_product(u, False)
        self._remember(u, Mu, Ku)
        return Mu, Ku

    def _remember(self, u: torch.Tensor, Mu: torch.Tensor, Ku: torch.Tensor) -> None:
        self._products.append((u, Mu, Ku))
        if len(self._products) > self.scheme.history + 1:
            self._products.pop(0)

    def _paired_product(self, v: torch.Tensor, transpose: bool) -> Tuple[torch.Tensor, torch.Tensor]:
        """Collective (one halo exchange when paired, else two). ``(M v, K v)``, or
        ``(M^T v, K^T v)``."""
        if self._MK is not None and (self._symmetric or not transpose):
            return self._MK.product(v)
        if transpose:
            return self._Md.rmatvec(v), self._Kd.rmatvec(v)
        return self._Md.matvec(v), self._Kd.matvec(v)

    def flush(self) -> None:
        """Collective. Raise :class:`slasolve.direct.FactorizationError` on every rank when a
        direct solve since the last flush failed its backward-error check."""
        if getattr(self, "_checks", None) is not None:
            self._checks.flush()

    def _operator(self, a: float, b: float, first: bool):
        """Collective. ``A = a M + b K`` and what solves with it: a Factorization, or the
        matrix for slasolve.solve (a layout of its own when it is not the first matrix, so
        that each keeps its own cached Krylov solver and preconditioner)."""
        with torch.no_grad():
            vals = a * self._Md.values + b * self._Kd.values
        if first:
            A = self._Md.with_values(vals)
        else:
            indptr, indices, _ = self._Md.local_rows_csr()
            A = DSparseTensor.from_local_rows(indptr.clone(), indices.clone(), vals, self._Md.global_shape,
                                              self.comm, block_shape=tuple(self._Md.block_shape))
        if self.method == "direct":
            if self.backend == "scipy" and self.comm.Get_size() > 1 and not self._Md.block_shape:
                return A, _Redundant(A)
            from ..direct import factorized
            return A, factorized(A, backend=self.backend)
        return A, None

    def factorizations(self) -> int:
        """Local. Numeric factorisations made for this integration's step matrices."""
        return sum(F.info.numeric_factorizations for _, F in getattr(self, "_ops", {}).values() if F is not None)

    def _solve(self, n: int, rhs: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.scheme.coefficients(n)
        A, F = self._ops[(alpha[0], beta[0])]
        self.linear_solves += 1
        if F is not None:
            x = F.solve_unchecked(rhs)
            if isinstance(F, _Redundant):   # the whole x is on every rank: no exchange
                Mx, Kx = self._MK.product_full(F.last_full)
                self._remember(x, Mx, Kx)
            else:
                Mx, Kx = self._pair(x)   # the check's A x, and the next step's right-hand side
            self._checks.add(rhs - (alpha[0] * Mx + (self._dt * beta[0]) * Kx), x, rhs, F.operator_norms[0])
            return x
        from ..krylov.solve import solve
        return solve(A, rhs, self.method, pc=self.pc, rtol=self.rtol, backend=self.backend, x0=x0,
                     **self.solver_options)

    def _solve_transposed(self, n: int, g: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.scheme.coefficients(n)
        A, F = self._ops[(alpha[0], beta[0])]
        self.transposed_solves += 1
        if F is not None:
            return F.solve_unchecked(g, transpose=True)
        from ..krylov.solve import solve
        # A^{-T} g is the adjoint of x = A^{-1} b at b = 0, which costs nothing (b == 0 returns
        # x = 0 at once): slasolve.solve's own transposed solve with the forward's cached solver
        with torch.enable_grad():
            b = torch.zeros_like(g).requires_grad_(True)
            x = solve(A, b, self.method, pc=self.pc, rtol=self.rtol, backend=self.backend, **self.solver_options)
            (mu,) = torch.autograd.grad(x, b, g)
        return mu

    @staticmethod
    def _checked_source(source: Callable, n_local: int) -> Callable:
        def f(t, *params):
            out = source(t, *params)
            if not isinstance(out, torch.Tensor) or out.shape != (n_local,):
                raise ValueError(f"source(t, *params) must return this rank's {n_local} owned rows, got "
                                 f"{tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__}")
            return out
        return f

    def _f(self, t: float, params) -> Optional[torch.Tensor]:
        # None also where the source raised on this rank (every rank raises at the next flush)
        return None if self._src is None else self._src(t, *params)

    def set_steps(self, n_steps: int) -> None:
        """Local. The number of steps of this integration (the last time level the source is
        evaluated at: the redundant forward gathers the source a batch of levels ahead)."""
        self._n_steps = int(n_steps)

    def advance(self, state: Tuple[torch.Tensor, ...], n: int, t0: float, params) -> torch.Tensor:
        """Collective. ``u_{n+1}`` from ``state = (u_n, u_{n-1}, ...)`` (no autograd)."""
        dt = self._dt
        alpha, beta = self.scheme.coefficients(n)
        F = self._ops[(alpha[0], beta[0])][1]
        if isinstance(F, _Redundant) and self._full_M is not None:
            return self._advance_redundant(F, state, n, t0, params)
        with torch.no_grad():
            rhs = torch.zeros_like(state[0])
            for j in range(1, len(alpha)):
                if alpha[j] != 0.0 or beta[j] != 0.0:
                    Mu, Ku = self._pair(state[j - 1])
                    if alpha[j] != 0.0:
                        rhs = rhs - alpha[j] * Mu
                    if beta[j] != 0.0:
                        rhs = rhs - (dt * beta[j]) * Ku
            for j, bj in enumerate(beta):
                if bj != 0.0:
                    f = self._f_level(n + 1 - j, t0, params)
                    if f is not None:
                        rhs = rhs + (dt * bj) * f
            return self._solve(n, rhs, state[0])

    def _advance_redundant(self, F: "_Redundant", state, n: int, t0: float, params) -> torch.Tensor:
        """Collective (an Allgatherv for a state this rank holds only its rows of, and one per
        ``ADJOINT_BATCH`` source levels). The step on whole vectors, the same on every rank: the
        right-hand side from the whole states and source, the solve local, this rank's rows kept."""
        dt = self._dt
        alpha, beta = self.scheme.coefficients(n)
        with torch.no_grad():
            rhs = None
            for j in range(1, len(alpha)):
                if alpha[j] != 0.0 or beta[j] != 0.0:
                    uf = self._whole(F, state[j - 1])
                    term = alpha[j] * torch.mv(self._full_M, uf) + (dt * beta[j]) * torch.mv(self._full_K, uf)
                    rhs = -term if rhs is None else rhs - term
            if rhs is None:
                rhs = torch.zeros(int(F.counts.sum()), dtype=self.dtype)
            for j, bj in enumerate(beta):
                if bj != 0.0 and self._src is not None:
                    rhs = rhs + (dt * bj) * self._f_whole(F, n + 1 - j, t0, params)
            xf = F.solve_full(rhs)
            self.linear_solves += 1
            r0, r1 = F.r0, F.r1
            x = xf[r0:r1].clone()
            Ax = alpha[0] * torch.mv(self._full_M_rows, xf) + (dt * beta[0]) * torch.mv(self._full_K_rows, xf)
            b = rhs[r0:r1]
            self._checks.add(b - Ax, x, b, F.operator_norms[0])
            self._wholes.append((x, xf))
            if len(self._wholes) > self.scheme.history + 1:
                self._wholes.pop(0)
            return x

    def _whole_adjoint(self, F: "_Redundant", lam: torch.Tensor) -> torch.Tensor:
        """Collective (an Allgatherv unless ``lam`` is a ``d_state`` the last adjoint step returned,
        as it is with one history state and no loss gradient at this step)."""
        for v, vf in self._adj_wholes:
            if v is lam:
                return vf
        return F.gather(lam)

    def _whole(self, F: "_Redundant", u: torch.Tensor) -> torch.Tensor:
        """Collective (an Allgatherv unless ``u`` is one of the latest solutions)."""
        for v, vf in self._wholes:
            if v is u:
                return vf
        uf = F.gather(u)
        self._wholes.append((u, uf))
        if len(self._wholes) > self.scheme.history + 1:
            self._wholes.pop(0)
        return uf

    def _f_whole(self, F: "_Redundant", m: int, t0: float, params) -> torch.Tensor:
        """Collective (one Allgatherv per batch). ``f(t_m)`` on all rows: the source is evaluated
        at up to ``ADJOINT_BATCH`` levels from ``m`` on (not past the last step) and gathered in one
        message. Which levels are evaluated depends on ``m`` alone: the same calls on every rank."""
        cache = self._fwhole
        if m not in cache:
            last = max(m, min(m + ADJOINT_BATCH - 1, getattr(self, "_n_steps", m)))
            levels = list(range(m, last + 1))
            rows = []
            for level in levels:
                f = self._src(t0 + level * self._dt, *params)
                # a rank where the source raised sends zeros (every rank raises at the next flush)
                rows.append(torch.zeros(self.n_local, dtype=self.dtype) if f is None
                            else f.detach().to(self.dtype))
            whole = F.gather(torch.stack(rows))
            cache.clear()
            for i, level in enumerate(levels):
                cache[level] = whole[i]
        return cache[m]

    def _f_level(self, m: int, t0: float, params) -> Optional[torch.Tensor]:
        """Collective (the source's call). ``f(t_m)``, kept for the next steps that read it
        (Crank-Nicolson: step ``m`` reads the ``f(t_m)`` of step ``m - 1``); the params do not
        change within an integration. Whether the source runs depends on ``m`` alone, so
        every rank calls it equally often."""
        if self._src is None:
            return None
        cache = self._fcache
        if m not in cache:
            f = self._src(t0 + m * self._dt, *params)
            # a copy: a source may return a buffer it overwrites at its next call
            cache[m] = None if f is None else f.clone()
            if len(cache) > self.scheme.history + 2:
                del cache[next(iter(cache))]
        return cache[m]

    def adjoint(self, state, u_new, n: int, t0: float, lam: torch.Tensor, params, want_inputs, want_params):
        """Collective. The adjoint of step ``n``: given ``lam = dL/du_{n+1}``, return
        ``(dL/dstate, dL/d(M.values, K.values), dL/dparams)`` of this step (None where not wanted).
        ``state`` and ``u_new`` may be None when the values' gradients are not wanted
        (:meth:`adjoint_needs_states`)."""
        dt = self._dt
        alpha, beta = self.scheme.coefficients(n)
        k = len(alpha) - 1
        d_state = [None] * k
        F = self._ops[(alpha[0], beta[0])][1]
        whole = isinstance(F, _Redundant) and self._full_M is not None
        if whole:
            # on whole vectors, the same on every rank: lam whole (known when it is the last step's
            # d_state, else one Allgatherv), the transposed solve local, the products local
            lam_f = self._whole_adjoint(F, lam)
            mu_f = F.solve_full(lam_f, transpose=True)
            self.transposed_solves += 1
            mu = mu_f[F.r0:F.r1].clone()
            MTmu_f, KTmu_f = torch.mv(self._full_MT, mu_f), torch.mv(self._full_KT, mu_f)
            MTmu, KTmu = MTmu_f[F.r0:F.r1], KTmu_f[F.r0:F.r1]
        else:
            mu = self._solve_transposed(n, lam)
            if isinstance(F, _Redundant) and self._symmetric:
                MTmu, KTmu = self._MK.product_full(F.last_full)
            else:
                MTmu, KTmu = self._paired_product(mu, True)
        if F is not None:
            self._checks.add(lam - (alpha[0] * MTmu + (dt * beta[0]) * KTmu), mu, lam, F.operator_norms[1])
        for j in range(1, k + 1):
            g = None
            if alpha[j] != 0.0:
                g = -alpha[j] * (MTmu_f if whole else MTmu)
            if beta[j] != 0.0:
                term = (dt * beta[j]) * (KTmu_f if whole else KTmu)
                g = -term if g is None else g - term
            if whole and g is not None:
                gf, g = g, g[F.r0:F.r1].clone()
                self._adj_wholes.append((g, gf))
                if len(self._adj_wholes) > k + 1:
                    self._adj_wholes.pop(0)
            d_state[j - 1] = g
        d_inputs = [None, None]
        if any(want_inputs):
            # d<-mu, M UM + K UK>/d values, summed over the steps: the steps' (mu, U) pairs are kept and
            # reduced together (one halo exchange and one pass over the entries per batch)
            if self._vg_batch is None:
                # batch x nnz temporaries: at most VALUE_GRAD_ENTRIES on the rank with the most entries
                # (the same batch on every rank: each batch makes one halo exchange)
                nnz = allreduce_int(self.comm, int(self._Md.values.numel()), MPI.MAX)
                self._vg_batch = max(1, min(ADJOINT_BATCH, VALUE_GRAD_ENTRIES // max(1, nnz)))
            self._vg[0].append(mu)
            if want_inputs[0]:
                self._vg[1].append(alpha[0] * u_new + sum(alpha[j] * state[j - 1] for j in range(1, k + 1)
                                                          if alpha[j] != 0.0))
            if want_inputs[1]:
                self._vg[2].append(dt * (beta[0] * u_new + sum(beta[j] * state[j - 1] for j in range(1, k + 1)
                                                               if beta[j] != 0.0)))
            if len(self._vg[0]) >= self._vg_batch:
                d_inputs = self._value_grads()
        d_params = [None] * len(params)
        if self.source is not None and any(want_params):
            # f(t_m) enters the steps m - 1 (j = 0) and m (j = 1, Crank-Nicolson): its cotangents are
            # summed per time level, and the levels no later step reaches (m > n) are differentiated
            # _src_batch (ADJOINT_BATCH, fewer for large vectors) at a time, in one autograd call
            for j, bj in enumerate(beta):
                if bj != 0.0:
                    c = (dt * bj) * mu
                    m = n + 1 - j
                    self._cot[m] = c if m not in self._cot else self._cot[m] + c
            if len(self._cot) > self._src_batch + self.scheme.history:
                done = [m for m in self._cot if m > n]
                if len(done) >= self._src_batch:
                    d_params = self._source_vjp(done, t0, params, want_params)
        return d_state, d_inputs, d_params

    def adjoint_finish(self, t0: float, params, want_params) -> tuple:
        """Collective. ``(d_inputs, d_params)``: the gradients still pending in :meth:`adjoint`'s
        batches (the backward calls it once, after the last adjoint step); None where there are none."""
        d_inputs = self._value_grads() if self._vg[0] else [None, None]
        if self.source is None or not self._cot or not any(want_params):
            self._cot = {}
            return d_inputs, [None] * len(params)
        return d_inputs, self._source_vjp(list(self._cot), t0, params, want_params)

    def _value_grads(self) -> list:
        """Collective (one halo exchange per matrix). The pending steps' parts of the gradients of
        ``M``'s and ``K``'s values."""
        G = -torch.stack(self._vg[0], 1)
        out = [None if not U else matvec_value_grad(D, G, torch.stack(U, 1))
               for D, U in ((self._Md, self._vg[1]), (self._Kd, self._vg[2]))]
        self._vg = ([], [], [])
        return out

    def _source_vjp(self, levels, t0: float, params, want_params) -> list:
        """Collective (the source's calls). ``sum_m f_params(t_m)^T c_m`` over ``levels``, their
        cotangents removed from the pending ones; None entries where this rank's source raised
        (raised on every rank at the next flush) or a param is unused."""
        cots = [self._cot.pop(m) for m in levels]
        dt = self._dt
        with torch.enable_grad():
            ps = [p.detach().requires_grad_(True) if w else p for p, w in zip(params, want_params)]
            # each f(t_m) dropped once dotted (the dot keeps c_m, not f): one vector live, not a batch
            dots, failed = [], False
            for m, c in zip(levels, cots):
                f = self._f(t0 + m * dt, ps)
                if f is None:
                    failed = True
                elif not failed:
                    dots.append(torch.dot(f, c.to(f.dtype)))
            leaves = [p for p, w in zip(ps, want_params) if w]
            grads = [None] * len(leaves)
            if not failed:
                s = torch.stack(dots).sum()
                if s.requires_grad:
                    try:
                        grads = torch.autograd.grad(s, leaves, allow_unused=True)
                    except Exception as e:  # noqa: BLE001 - the user's source: raised on every rank at the flush
                        self._checks.keep(e)
        it = iter(grads)
        return [next(it) if w else None for w in want_params]
