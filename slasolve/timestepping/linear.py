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
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .._comm import check_collective, user_code
from ..autograd import matvec_value_grad
from ..dsparse import DSparseTensor
from .schemes import Scheme, scheme as make_scheme

__all__ = ["LinearTimeProblem"]


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
        :func:`slasolve.solve` keyword arguments. ``backend`` also picks the direct solver.

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
        self.source = None if source is None else user_code(M.comm, self._checked_source(source, M.n_local), "source")
        self.method, self.pc, self.rtol, self.backend = method, pc, float(rtol), backend
        self.solver_options = dict(solver_options or {})
        self.comm = M.comm
        self.n_local = M.n_local
        self.dtype = M.dtype
        self._ops: Dict[tuple, tuple] = {}
        self.linear_solves = 0
        self.transposed_solves = 0

    # -- the interface the trajectory uses (slasolve.timestepping.trajectory) --------------
    @property
    def history(self) -> int:
        """Local. Past states a step reads (1; BDF2: 2)."""
        return self.scheme.history

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
        for n in range(len(self.scheme.starters) + 1):
            alpha, beta = self.scheme.coefficients(n)
            key = (alpha[0], beta[0])
            if key not in st._ops:
                st._ops[key] = st._operator(alpha[0], beta[0] * st._dt, first=not st._ops)
        return st

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
            return F(rhs)
        from ..krylov.solve import solve
        return solve(A, rhs, self.method, pc=self.pc, rtol=self.rtol, backend=self.backend, x0=x0,
                     **self.solver_options)

    def _solve_transposed(self, n: int, g: torch.Tensor) -> torch.Tensor:
        alpha, beta = self.scheme.coefficients(n)
        A, F = self._ops[(alpha[0], beta[0])]
        self.transposed_solves += 1
        if F is not None:
            return F.solve(g, transpose=True)
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
        return None if self.source is None else self.source(t, *params)

    def advance(self, state: Tuple[torch.Tensor, ...], n: int, t0: float, params) -> torch.Tensor:
        """Collective. ``u_{n+1}`` from ``state = (u_n, u_{n-1}, ...)`` (no autograd)."""
        dt = self._dt
        alpha, beta = self.scheme.coefficients(n)
        with torch.no_grad():
            VM = sum(alpha[j] * state[j - 1] for j in range(1, len(alpha)) if alpha[j] != 0.0)
            VK = [dt * beta[j] * state[j - 1] for j in range(1, len(beta)) if beta[j] != 0.0]
            rhs = -(self._Md @ VM)
            if VK:
                rhs = rhs - self._Kd @ sum(VK)
            for j, bj in enumerate(beta):
                if bj != 0.0:
                    f = self._f(t0 + (n + 1 - j) * dt, params)
                    if f is not None:
                        rhs = rhs + (dt * bj) * f
            return self._solve(n, rhs, state[0])

    def adjoint(self, state, u_new, n: int, t0: float, lam: torch.Tensor, params, want_inputs, want_params):
        """Collective. The adjoint of step ``n``: given ``lam = dL/du_{n+1}``, return
        ``(dL/dstate, dL/d(M.values, K.values), dL/dparams)`` of this step (None where not wanted)."""
        dt = self._dt
        alpha, beta = self.scheme.coefficients(n)
        mu = self._solve_transposed(n, lam)
        k = len(alpha) - 1
        d_state = [None] * len(state)
        need_K = any(beta[j] != 0.0 for j in range(1, k + 1))
        MTmu = self._Md.rmatvec(mu)
        KTmu = self._Kd.rmatvec(mu) if need_K else None
        for j in range(1, k + 1):
            g = None
            if alpha[j] != 0.0:
                g = -alpha[j] * MTmu
            if beta[j] != 0.0:
                g = -(dt * beta[j]) * KTmu if g is None else g - (dt * beta[j]) * KTmu
            d_state[j - 1] = g
        d_inputs = [None, None]
        if want_inputs[0]:
            UM = alpha[0] * u_new + sum(alpha[j] * state[j - 1] for j in range(1, k + 1) if alpha[j] != 0.0)
            d_inputs[0] = matvec_value_grad(self._Md, -mu, UM)
        if want_inputs[1]:
            UK = dt * (beta[0] * u_new + sum(beta[j] * state[j - 1] for j in range(1, k + 1) if beta[j] != 0.0))
            d_inputs[1] = matvec_value_grad(self._Kd, -mu, UK)
        d_params = [None] * len(params)
        if self.source is not None and any(want_params):
            with torch.enable_grad():
                ps = [p.detach().requires_grad_(True) if w else p for p, w in zip(params, want_params)]
                s = None
                for j, bj in enumerate(beta):
                    if bj != 0.0:
                        term = (dt * bj) * (self._f(t0 + (n + 1 - j) * dt, ps) * mu).sum()
                        s = term if s is None else s + term
                leaves = [p for p, w in zip(ps, want_params) if w]
                grads = torch.autograd.grad(s, leaves, allow_unused=True) if s is not None else [None] * len(leaves)
            it = iter(grads)
            d_params = [next(it) if w else None for w in want_params]
        return d_state, d_inputs, d_params
