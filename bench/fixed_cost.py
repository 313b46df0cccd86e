"""Fixed cost per call at notebook sizes: slasolve against raw petsc4py and DOLFINx.

Run: ``python bench/fixed_cost.py`` (``mpirun -n 2 python bench/fixed_cost.py`` for 2 ranks).
DOLFINx 0.5 is optional (``apt-get install python3-dolfinx``): its rows are skipped without it.

On a tiny problem (P1 Poisson on ``2 n^2`` triangles of the unit square, ``n = 8``: 81
unknowns, Dirichlet rows, CG + GAMG, rtol 1e-8) the Krylov work is a few microseconds, so a
call's time is its fixed cost: argument checks, Allreduces, Python, PETSc object handling.
Values do not change between calls (no preconditioner set-up), except where said.

* ``solve``: ``slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-8)`` against raw petsc4py's
  ``ksp.solve(b, x)`` on the same Mat (a KSP made once, CG + GAMG, unpreconditioned norm) --
  what DOLFINx's ``LinearProblem.solve`` calls after assembling -- and DOLFINx's
  ``LinearProblem.solve()`` itself (assembly of A and b included).
* ``solve + backward``: ``x = solve(K, f)`` with ``f.requires_grad_()``, ``x.sum().backward()``
  (one adjoint solve) against raw ``ksp.solve`` twice (forward and adjoint: the matrix is
  symmetric) and against what a DOLFINx user writes for ``J = sum(u)``: ``LinearProblem.solve()``,
  then the adjoint by hand, ``dJ/du`` (ones) set into a Vec and one more ``ksp.solve`` on the
  problem's KSP (``K`` is symmetric), whose solution is ``dJ/db``. The run checks that it equals
  slasolve's ``f.grad`` (dofs matched by their coordinates) and prints the relative difference.
* ``nonlinear_solve``: ``-div((1 + u^2) grad u) = 10`` with ``NonlinearDiffusion`` +
  ``nonlinear_solve`` (GMRES + GAMG; 4 Newton steps) against DOLFINx ``NewtonSolver.solve``
  (its residual and Jacobian assembly included, as slasolve's) and against a raw petsc4py SNES
  (newtonls + bt, GMRES + GAMG, made once) whose callbacks run the same NumPy kernels
  (``NonlinearProblem.iterate_kernels``) straight into PETSc's arrays: ``sla/raw`` is then
  ``nonlinear_solve``'s own cost outside SNES's (checks, settings, the evaluations at ``u0``, the
  final residual check).

Calls alternate; each sample is the mean of ``--inner`` calls, the table shows the median
over ``--trials`` samples (slowest rank) in microseconds and the ratio.

MPI calls per call (load-independent): with the PMPI counter ``bench/mpi_counts.c`` preloaded
(``mpicc -O2 -shared -fPIC -o /tmp/libmpicounts.so bench/mpi_counts.c``, then ``mpirun -n 2 -x
LD_PRELOAD=/tmp/libmpicounts.so python bench/fixed_cost.py``) the reductions, other collectives
and point-to-point sends of one call (PETSc's included; max over ranks, mean of ``--inner``
calls) are printed for each contender and kept in the JSON.
"""
from __future__ import annotations

import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, SIZE, base_parser, compare, rprint, write_json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import slasolve  # noqa: E402
from slasolve.fem import Assembler, DirichletBC, NonlinearDiffusion, boundary_dofs, box_mesh  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402
from mpi4py.MPI import MAX as MPI_MAX  # noqa: E402

RTOL = 1e-8


def slasolve_calls(n: int, comm):
    sp = Assembler(box_mesh(n, cell="triangle", comm=comm))
    bd = boundary_dofs(sp)
    bc = DirichletBC(sp, bd, torch.zeros(len(bd), dtype=torch.float64))
    K, f = bc.apply(sp.stiffness(1.0), sp.load(1.0))
    fg = f.clone().requires_grad_(True)
    P = NonlinearDiffusion(sp, bc, source=10.0)
    u0 = sp.zeros()

    def solve():
        return slasolve.solve(K, f, "cg", pc="gamg", rtol=RTOL)

    def solve_backward():
        x = slasolve.solve(K, fg, "cg", pc="gamg", rtol=RTOL)
        slasolve.global_sum(x.sum(), comm).backward()

    def newton():
        return slasolve.nonlinear_solve(P.residual, u0, jacobian=P.jacobian, rtol=1e-10,
                                        linear_solver=dict(method="gmres", pc="gamg", rtol=1e-10))

    def adjoint_reference():
        """Collective. slasolve's ``dJ/df`` for ``J = sum(x)`` and the owned dofs' coordinates."""
        fr = f.clone().requires_grad_(True)
        slasolve.global_sum(slasolve.solve(K, fr, "cg", pc="gamg", rtol=RTOL).sum(), comm).backward()
        return fr.grad.numpy().copy(), sp.owned_dof_coords().numpy()[:, :2].copy()

    return K, f, {"solve": solve, "solve + backward": solve_backward, "nonlinear_solve": newton}, (P, u0), \
        adjoint_reference


def raw_snes(P, u0, comm):
    """Collective. A raw petsc4py SNES made once (newtonls + bt, GMRES + GAMG as ``nonlinear_solve``
    configures them) whose callbacks run the same NumPy kernels ``nonlinear_solve``'s do
    (``NonlinearProblem.iterate_kernels``), writing straight into PETSc's arrays: SNES's own cost,
    the floor of ``nonlinear_solve``'s."""
    from slasolve.petsc import create_petsc_mat
    residual_into, tangent_values = P.iterate_kernels(P.residual, P.jacobian, ())
    J0 = P.jacobian(u0)
    A = create_petsc_mat(J0, "aij")
    indptr = J0.local.indptr.numpy().astype(PETSc.IntType)
    indices = J0.local.indices.numpy().astype(PETSc.IntType)
    X = PETSc.Vec().createMPI((u0.shape[0], PETSc.DECIDE), comm=comm)
    F = X.duplicate()

    def function(snes, x, f):
        out = f.getArray()
        residual_into(x.getArray(readonly=True).copy(), out)
        del out

    def jacobian(snes, x, J, Pm):
        Pm.setValuesCSR(indptr, indices, tangent_values(x.getArray(readonly=True).copy()),
                        PETSc.InsertMode.INSERT_VALUES)
        Pm.assemble()

    snes = PETSc.SNES().create(comm=comm)
    snes.setType("newtonls")
    snes.setFunction(function, F)
    snes.setJacobian(jacobian, A)
    snes.setTolerances(rtol=1e-10, atol=0.0, stol=0.0, max_it=50)
    snes.setMaxFunctionEvaluations(-1)
    ksp = snes.getKSP()
    ksp.setType("gmres")
    ksp.setPCSide(PETSc.PC.Side.RIGHT)
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.getPC().setType("gamg")
    ksp.setTolerances(rtol=1e-10, atol=0.0, divtol=1e300, max_it=10000)
    opts = PETSc.Options()
    opts["snes_linesearch_type"] = "bt"
    snes.setFromOptions()
    opts.delValue("snes_linesearch_type")
    u0n = u0.numpy()

    def newton():
        X.setArray(u0n)
        snes.solve(None, X)
        assert snes.getConvergedReason() > 0

    return newton, (snes, A, X, F)


def raw_calls(K, f, comm):
    A = K.to_petsc(mat_type="aij").duplicate(copy=True)
    ksp = PETSc.KSP().create(comm)
    ksp.setOperators(A)
    ksp.setType("cg")
    ksp.getPC().setType("gamg")
    ksp.setNormType(PETSc.KSP.NormType.UNPRECONDITIONED)
    ksp.setTolerances(rtol=RTOL, atol=0.0)
    ksp.setFromOptions()
    x, b = A.createVecs()
    b.setArray(f.detach().numpy())
    lam = x.duplicate()
    ksp.solve(b, x)

    def solve():
        ksp.solve(b, x)

    def solve_backward():
        ksp.solve(b, x)
        ksp.solve(b, lam)

    return {"solve": solve, "solve + backward": solve_backward}, (ksp, A, x, b, lam)


def dolfinx_calls(n: int, comm):
    """Collective. DOLFINx's calls (an empty dict without DOLFINx) and ``adjoint_check(grad, coords)``:
    the relative 2-norm difference between the hand adjoint's ``dJ/db`` and ``grad`` (slasolve's
    ``f.grad``, this rank's owned dofs at ``coords``), matched by dof coordinates."""
    try:
        import ufl
        from dolfinx import fem, mesh
        from dolfinx.fem import petsc as fpetsc
        from dolfinx.nls.petsc import NewtonSolver
    except ImportError:
        return {}, None
    logging.disable(logging.INFO)   # FFCx and the C compiler log every JIT build at INFO
    msh = mesh.create_unit_square(comm, n, n, mesh.CellType.triangle, diagonal=mesh.DiagonalType.right)
    V = fem.FunctionSpace(msh, ("Lagrange", 1))
    u, v = ufl.TrialFunction(V), ufl.TestFunction(V)
    msh.topology.create_connectivity(1, 2)
    facets = mesh.exterior_facet_indices(msh.topology)
    bc = fem.dirichletbc(PETSc.ScalarType(0.0), fem.locate_dofs_topological(V, 1, facets), V)
    one = fem.Constant(msh, PETSc.ScalarType(1.0))
    lp = fpetsc.LinearProblem(ufl.inner(ufl.grad(u), ufl.grad(v)) * ufl.dx, one * v * ufl.dx, bcs=[bc],
                              petsc_options={"ksp_type": "cg", "pc_type": "gamg", "ksp_rtol": RTOL})
    uh = fem.Function(V)
    F = (1 + uh ** 2) * ufl.inner(ufl.grad(uh), ufl.grad(v)) * ufl.dx - 10.0 * one * v * ufl.dx
    newton = NewtonSolver(comm, fpetsc.NonlinearProblem(F, uh, bcs=[bc]))
    newton.rtol, newton.atol, newton.convergence_criterion = 1e-10, 0.0, "residual"
    ksp = newton.krylov_solver
    prefix = ksp.getOptionsPrefix() or ""
    opts = PETSc.Options()
    for k, val in {"ksp_type": "gmres", "pc_type": "gamg", "ksp_rtol": 1e-10}.items():
        opts[prefix + k] = val
    ksp.setFromOptions()

    def nl():
        uh.x.array[:] = 0.0
        newton.solve(uh)

    # the hand adjoint of J = sum(u): K^T lam = dJ/du = 1 with the forward's KSP (K symmetric, its
    # Dirichlet rows and columns eliminated alike), lam = dJ/db
    g, lam = lp.b.duplicate(), lp.b.duplicate()

    def solve_adjoint():
        lp.solve()
        g.set(1.0)
        lp.solver.solve(g, lam)

    def adjoint_check(grad: np.ndarray, coords: np.ndarray) -> float:
        solve_adjoint()
        n_owned = V.dofmap.index_map.size_local
        mine = (np.asarray(lam.getArray(readonly=True))[:n_owned].copy(),
                V.tabulate_dof_coordinates()[:n_owned, :2].copy())
        parts = comm.allgather((mine, (grad, coords)))
        out = []
        for k in range(2):
            v = np.concatenate([p[k][0] for p in parts])
            xy = np.round(np.concatenate([p[k][1] for p in parts]), 10)
            out.append(v[np.lexsort((xy[:, 1], xy[:, 0]))])
        return float(np.linalg.norm(out[0] - out[1]) / np.linalg.norm(out[1]))

    return {"solve": lp.solve, "solve + backward": solve_adjoint, "nonlinear_solve": nl}, adjoint_check


def mpi_counts(fn, inner: int):
    """Collective. ``[reductions, other collectives, sends]`` per call of ``fn`` (max over ranks),
    or None without the preloaded counter."""
    import ctypes
    try:
        lib = ctypes.CDLL(None)
        get, reset = lib.mpi_counts_get, lib.mpi_counts_reset
    except AttributeError:
        return None
    fn()
    COMM.Barrier()
    reset()
    for _ in range(inner):
        fn()
    out = (ctypes.c_longlong * 4)()
    get(out)
    return [COMM.allreduce(int(out[i]), op=MPI_MAX) / inner for i in range(3)]


def main(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--inner", type=int, default=20)
    p.add_argument("--calls", nargs="*", default=None,
                   help="only these rows (e.g. nonlinear_solve); default: all")
    args = p.parse_args(argv)
    trials = args.trials or (5 if args.quick else 15)
    K, f, sla, (P, u0), adjoint_reference = slasolve_calls(args.n, COMM)
    raw, _keep = raw_calls(K, f, COMM)
    raw["nonlinear_solve"], _keep_snes = raw_snes(P, u0, COMM)
    dfx, adjoint_check = dolfinx_calls(args.n, COMM)
    if adjoint_check is not None and (args.calls is None or "solve + backward" in args.calls):
        diff = adjoint_check(*adjoint_reference())
        rprint(f"DOLFINx hand adjoint dJ/db against slasolve's f.grad: relative difference {diff:.1e}")
        if not diff < 1e-6:
            raise SystemExit(f"the DOLFINx hand adjoint differs from slasolve's gradient ({diff:.1e})")
    out = {"n": args.n, "unknowns": K.global_shape[0], "ranks": SIZE, "rows": []}
    if adjoint_check is not None and (args.calls is None or "solve + backward" in args.calls):
        out["dolfinx hand adjoint vs slasolve f.grad (relative 2-norm difference)"] = diff
    rprint(f"fixed cost per call, {K.global_shape[0]} unknowns, {SIZE} rank(s), median of {trials} x "
           f"{args.inner} calls (us)")
    rprint(f"{'call':>18} {'slasolve':>10} {'raw petsc4py':>13} {'DOLFINx':>10} {'sla/raw':>8} {'sla/dfx':>8}")
    for name, fn in sla.items():
        if args.calls is not None and name not in args.calls:
            continue
        contenders = {"slasolve": fn}
        if name in raw:
            contenders["raw"] = raw[name]
        if name in dfx:
            contenders["dolfinx"] = dfx[name]
        res = compare(contenders, trials=trials, warmup=2, inner=args.inner)
        t = {k: v["median"] * 1e6 for k, v in res.items()}
        row = {"call": name, "us": t}
        counts = {k: mpi_counts(c, args.inner) for k, c in contenders.items()}
        if all(v is not None for v in counts.values()):
            row["mpi calls per call [reductions, other collectives, sends]"] = counts
        out["rows"].append(row)
        rprint(f"{name:>18} {t['slasolve']:10.0f} {t.get('raw', float('nan')):13.0f} "
               f"{t.get('dolfinx', float('nan')):10.0f} {t['slasolve'] / t.get('raw', np.nan):8.2f} "
               f"{t['slasolve'] / t.get('dolfinx', np.nan):8.2f}")
    for row in out["rows"]:
        counts = row.get("mpi calls per call [reductions, other collectives, sends]")
        if counts:
            rprint(f"{row['call']:>18} MPI per call [reductions, other collectives, sends]: " +
                   ", ".join(f"{k} {v}" for k, v in counts.items()))
    write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"fixed_cost_n{SIZE}.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
