"""Ready-made problems: Poisson and linear elasticity with manufactured solutions.

:func:`manufactured_solve` (collective) builds a :func:`~slasolve.fem.box_mesh`,
assembles, applies homogeneous Dirichlet conditions on the whole boundary,
solves with :func:`slasolve.solve` and measures the L2 error against the exact
solution. It is what ``examples/fem_solve.py``, the convergence tests and
``bench/fem.py`` run.

* Poisson: ``-Δu = f`` on the unit square/cube, ``u = Π_k sin(π x_k)``,
  ``f = d π² u``.
* Elasticity (2-D plane strain, or 3-D): ``-div σ(u) = f`` with every component
  ``u_i = Π_k sin(π x_k)``; ``f_i = μ d π² S - (λ+μ) Σ_k ∂_i ∂_k S``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import numpy as np
import torch
from mpi4py import MPI

from .._comm import check_collective, get_comm
from . import elements as _el
from .assembly import Assembler
from .bc import DirichletBC, boundary_dofs
from .mesh import Mesh, box_mesh

__all__ = ["exact_poisson", "poisson_rhs", "exact_elasticity", "elasticity_rhs", "lame",
           "l2_error", "FemResult", "manufactured_solve", "assemble_manufactured", "DEFAULT_CELL"]

DEFAULT_CELL = {2: "triangle", 3: "tetra"}
PI = math.pi


def exact_poisson(x: torch.Tensor) -> torch.Tensor:
    """Local. ``u(x) = Π_k sin(π x_k)`` at ``(n, dim)`` points."""
    return torch.sin(PI * x).prod(-1)


def poisson_rhs(x: torch.Tensor) -> torch.Tensor:
    """Local. ``f = -Δu = d π² u``."""
    return x.shape[-1] * PI ** 2 * exact_poisson(x)


def exact_elasticity(x: torch.Tensor) -> torch.Tensor:
    """Local. Displacement ``(n, dim)``, every component ``Π_k sin(π x_k)``."""
    S = exact_poisson(x)
    return S[:, None].expand(-1, x.shape[-1]).contiguous()


def lame(young: float, nu: float, kind: str):
    """Local. Lamé parameters ``(λ, μ)`` (as :func:`elements.elasticity_stiffness` uses them)."""
    mu = young / (2 * (1 + nu))
    lam = young * nu / (1 - nu * nu) if kind == "plane_stress" else young * nu / ((1 + nu) * (1 - 2 * nu))
    return lam, mu


def elasticity_rhs(x: torch.Tensor, lam: float, mu: float) -> torch.Tensor:
    """Local. Body force ``-div σ`` of :func:`exact_elasticity`, shape ``(n, dim)``."""
    d = x.shape[-1]
    s, c = torch.sin(PI * x), torch.cos(PI * x)
    S = s.prod(-1)
    out = []
    for i in range(d):
        hess_sum = -PI ** 2 * S                                  # ∂_i∂_i S
        for k in range(d):
            if k != i:
                others = [s[:, m] for m in range(d) if m not in (i, k)]
                t = c[:, i] * c[:, k]
                for o in others:
                    t = t * o
                hess_sum = hess_sum + PI ** 2 * t
        out.append(mu * d * PI ** 2 * S - (lam + mu) * hess_sum)
    return torch.stack(out, -1)


def l2_error(space: Assembler, u_owned: torch.Tensor, exact: Optional[Callable] = None) -> float:
    """Collective. ``||u_h - u||_{L2}`` (``||u_h||`` without ``exact``), by quadrature on every
    cell (the element's mass rule); ghost values of ``u_h`` are fetched by the halo."""
    cell = space.cell
    X = space.cell_coords
    w, N, _, _ = _el._reference(cell, "mass", X.dtype, X.device)
    wdet, _, _ = _el._geometry(X, cell, "mass")                    # (E, nq)
    uloc = space.fetch_ghosts(u_owned.detach()).reshape(-1, space.bs)
    uc = uloc[space.local_cells]                                    # (E, nv, bs)
    uq = torch.einsum("qv,evc->eqc", N, uc)
    if exact is not None:
        xq = torch.einsum("qv,evd->eqd", N, X)
        ue = exact(xq.reshape(-1, space.dim)).reshape(uq.shape)
        uq = uq - ue
    local = (wdet[:, :, None] * uq ** 2).sum().reshape(1)
    comm = space.comm
    tot = float(local) if comm.Get_size() == 1 else comm.allreduce(float(local), op=MPI.SUM)
    return math.sqrt(tot)


@dataclass
class FemResult:
    """What :func:`manufactured_solve` returns (identical scalars on every rank)."""
    problem: str
    dim: int
    cell: str
    n: int
    h: float
    n_dofs: int
    error_l2: float
    iterations: int
    converged: bool
    timings: Dict[str, float] = field(default_factory=dict)
    space: Optional[Assembler] = field(default=None, repr=False)
    u: Optional[torch.Tensor] = field(default=None, repr=False)
    info: object = field(default=None, repr=False)
    mesh: Optional[Mesh] = field(default=None, repr=False)


class _Clock:
    """Wall time per phase, synchronised with a barrier so it is the slowest rank's time."""

    def __init__(self, comm):
        self.comm, self.t, self.times = comm, None, {}

    def start(self):
        if self.comm.Get_size() > 1:
            self.comm.Barrier()
        self.t = time.perf_counter()

    def stop(self, name: str):
        if self.comm.Get_size() > 1:
            self.comm.Barrier()
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self.t
        self.t = now


def assemble_manufactured(problem: str, mesh: Mesh, *, young: float = 1.0, nu: float = 0.3,
                          kind: Optional[str] = None, kappa=1.0, clock=None):
    """Collective. ``(space, A, b, exact)`` of a manufactured problem on ``mesh``, with the
    homogeneous Dirichlet condition on the whole boundary already applied. A bad or
    differing ``problem`` raises ``ValueError`` on every rank."""
    dim = mesh.dim
    err = None if problem in ("poisson", "elasticity") else ValueError(
        f"problem must be 'poisson' or 'elasticity', got {problem!r}")
    check_collective(mesh.comm, err, agree={"problem": problem})
    if problem == "poisson":
        space = Assembler(mesh, 1)
        if clock is not None:
            clock.stop("setup")
        A = space.stiffness(kappa)
        b = space.load(poisson_rhs)
        exact = exact_poisson
    elif problem == "elasticity":
        kind = kind or ("plane_strain" if dim == 2 else "3d")
        lam, mu = lame(young, nu, kind)
        space = Assembler(mesh, dim)
        if clock is not None:
            clock.stop("setup")
        A = space.elasticity(young, nu, kind)
        b = space.load(lambda x: elasticity_rhs(x, lam, mu))
        exact = exact_elasticity
    else:
        raise ValueError(f"problem must be 'poisson' or 'elasticity', got {problem!r}")
    bc = DirichletBC(space, boundary_dofs(space), 0.0)
    A, b = bc.apply(A, b)
    return space, A, b, exact


def manufactured_solve(problem: str = "poisson", n: int = 16, dim: int = 2, cell: Optional[str] = None,
                       comm: Optional[MPI.Comm] = None, *, method: str = "cg", pc: Optional[str] = "gamg",
                       rtol: float = 1e-10, backend: Optional[str] = None, young: float = 1.0,
                       nu: float = 0.3, kind: Optional[str] = None, kappa=1.0) -> FemResult:
    """Collective. Mesh, assemble, solve and measure the L2 error of a manufactured problem.

    ``problem``: ``"poisson"`` or ``"elasticity"``; ``cell`` defaults to triangles (2-D) or
    tetrahedra (3-D); ``n`` cells per side of the unit box. 2-D elasticity is plane strain
    unless ``kind`` says otherwise. Homogeneous Dirichlet conditions on the whole boundary.
    """
    from .. import solve

    comm = get_comm(comm)
    err = None
    try:
        if problem not in ("poisson", "elasticity"):
            raise ValueError(f"problem must be 'poisson' or 'elasticity', got {problem!r}")
        if dim not in (2, 3):
            raise ValueError(f"dim must be 2 or 3, got {dim!r}")
        cell = DEFAULT_CELL[dim] if cell is None else cell
        if _el.cell_dim(cell) != dim:
            raise ValueError(f"cell {cell!r} is not a {dim}-D cell")
    except (ValueError, TypeError) as e:   # raised on every rank (one rank alone would hang the rest)
        err = e
    check_collective(comm, err, agree={"problem": problem, "dim": dim, "cell": cell, "young": young, "nu": nu,
                                       "kind": kind})
    clock = _Clock(comm)
    clock.start()
    mesh = box_mesh(n, cell=cell, comm=comm)
    clock.stop("mesh")
    space, A, b, exact = assemble_manufactured(problem, mesh, young=young, nu=nu, kind=kind, kappa=kappa,
                                               clock=clock)
    clock.stop("assemble")
    kw = {}
    if backend is not None:
        kw["backend"] = backend
    u, info = solve(A, b, method, rtol=rtol, pc=pc, return_info=True, **kw)
    clock.stop("solve")
    err = l2_error(space, u, exact)
    clock.stop("error")
    return FemResult(problem=problem, dim=dim, cell=cell, n=int(n), h=1.0 / n, n_dofs=space.n_global_dofs,
                     error_l2=err, iterations=int(getattr(info, "iterations", -1)),
                     converged=bool(getattr(info, "converged", True)), timings=clock.times, space=space,
                     u=u, info=info, mesh=mesh)


def convergence_rates(errors, hs) -> np.ndarray:
    """Local. Log-log slopes between successive refinements."""
    e, h = np.asarray(errors, dtype=float), np.asarray(hs, dtype=float)
    return np.log(e[1:] / e[:-1]) / np.log(h[1:] / h[:-1])


__all__ += ["convergence_rates"]
