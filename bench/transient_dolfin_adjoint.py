"""The dolfin-adjoint side of ``bench/transient.py --compare`` (legacy DOLFIN 2019.2 + dolfin-adjoint 2023.0).

Run by ``bench/transient.py`` with the peer venv's python (``bench/install_peers.sh``), alone or
under ``mpirun``; it imports neither slasolve nor torch. Prints one ``RESULT {json}`` line on rank 0.

    python bench/transient_dolfin_adjoint.py N STEPS T KAPPA [--fd] [--control conductivity]

The problem is ``transient.py``'s (see its docstring): ``UnitSquareMesh(N, N)`` (diagonal "right":
the squares cut from the low corner, as ``slasolve.fem.box_mesh(N, cell="triangle")``), P1,
backward Euler written as dolfin-adjoint's tutorials do (``solve(a == L, u)`` each step, MUMPS,
``u_old.assign(u)``), the default tape (no checkpointing: pyadjoint 2023.0 has none).
``--control conductivity``: the control is a cellwise (DG0) conductivity
``KAPPA (1 + 0.5 sin(3 x) cos(2 y))`` at the centroids, the source fixed at ``q0``.
"""
import json
import os
import resource
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_probe import from_env, status_mib  # noqa: E402  (standard library only)

probe, probe_path = from_env("dolfin-adjoint")
if probe:
    probe.mark("start")

# as dolfin-adjoint's users write it: the overloaded names (Function, solve, assemble, ...) shadow DOLFIN's
from dolfin import *  # noqa: F401,F403
from dolfin_adjoint import *  # noqa: F401,F403

# the imports' own footprint (the interpreter, DOLFIN, UFL/FFC, pyadjoint, petsc4py, ...)
imports_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
imports_anon_mib = status_mib("RssAnon")
if probe:
    probe.mark("imports")

set_log_level(LogLevel.WARNING)
parameters["std_out_all_processes"] = False

n, steps, T, kappa = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4])
by_conductivity = "--control" in sys.argv and sys.argv[sys.argv.index("--control") + 1] == "conductivity"
comm = MPI.comm_world
mesh = UnitSquareMesh(comm, n, n)
V = FunctionSpace(mesh, "P", 1)
# nodal interpolants of the same formulas transient.py evaluates at slasolve's nodes
q0 = interpolate(Expression("exp(-((x[0]-0.3)*(x[0]-0.3) + (x[1]-0.6)*(x[1]-0.6)) / 0.02)", degree=1), V)
u0 = interpolate(Expression("sin(pi*x[0]) * x[1]", degree=1), V)
d = interpolate(Expression("x[0] * x[1]", degree=1), V)
dq = interpolate(Expression("cos(3*x[0]) * x[1] + 0.5", degree=1), V)
# the cellwise conductivity and its direction (DG0 interpolation evaluates at the centroid)
W = FunctionSpace(mesh, "DG", 0)
k0 = interpolate(Expression("kappa * (1 + 0.5 * sin(3*x[0]) * cos(2*x[1]))", kappa=kappa, degree=0), W)
dk = interpolate(Expression("cos(3*x[0]) * x[1] + 0.5", degree=0), W)
m0, dm = (k0, dk) if by_conductivity else (q0, dq)


def loss(m, N):
    """The loss of control ``m``: the source (nodal) or the conductivity (cellwise)."""
    q, k = (q0, m) if by_conductivity else (m, Constant(kappa))
    dt = T / N
    v, w = TrialFunction(V), TestFunction(V)
    u_old = Function(V)
    u_old.assign(u0)
    u = Function(V)
    a = v * w * dx + Constant(dt) * k * inner(grad(v), grad(w)) * dx
    L = u_old * w * dx + Constant(dt) * q * w * dx
    for _ in range(N):
        solve(a == L, u, solver_parameters={"linear_solver": "mumps"})
        u_old.assign(u)
    return assemble(0.5 * (u - d) ** 2 * dx)


def loss_and_gradient(N):
    tape = get_working_tape()
    tape.clear_tape()
    m = m0.copy(deepcopy=True)
    comm.Barrier()
    t0 = time.perf_counter()
    J = loss(m, N)
    t1 = time.perf_counter()
    if probe:
        probe.mark(f"forward {N}")
    g = compute_gradient(J, Control(m))   # l2 representation: dJ/dm_i, what slasolve returns
    t2 = time.perf_counter()
    if probe:
        probe.mark(f"backward {N}")
    out = {"loss": float(J), "g_dot_dq": g.vector().inner(dm.vector()), "g_norm": g.vector().norm("l2"),
           "forward_s": t1 - t0, "gradient_s": t2 - t1}
    tape.clear_tape()
    return out


def max_over_ranks(x):
    from mpi4py import MPI as M
    return M.COMM_WORLD.allreduce(x, op=M.MAX)


if probe:
    probe.mark("setup")
loss_and_gradient(3)   # warm-up: form compilation (JIT, cached on disk), MUMPS, the tape's code paths
comm.Barrier()
floor = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
res = loss_and_gradient(steps)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
anon_over_imports = status_mib("RssAnon") - imports_anon_mib   # see transient.py's compare_worker
if probe:
    probe.dump(probe_path)
res["wall_s"] = max_over_ranks(res["forward_s"] + res["gradient_s"])
res["forward_s"], res["gradient_s"] = max_over_ranks(res["forward_s"]), max_over_ranks(res["gradient_s"])
res["peak_mib_max_rank"] = max_over_ranks(peak)
res["extra_peak_mib_max_rank"] = max_over_ranks(peak - floor)
res["imports_mib_max_rank"] = max_over_ranks(imports_mib)
res["over_imports_mib_max_rank"] = max_over_ranks(peak - imports_mib)
res["anon_over_imports_mib_max_rank"] = max_over_ranks(anon_over_imports)
if "--fd" in sys.argv:
    h = 1e-4
    with stop_annotating():
        vals = []
        for s in (h, -h):
            m = m0.copy(deepcopy=True)
            m.vector().axpy(s, dm.vector())
            vals.append(float(loss(m, steps)))
    res["fd"] = (vals[0] - vals[1]) / (2 * h)
if comm.rank == 0:
    import dolfin
    import pyadjoint
    res.update({"contender": "dolfin-adjoint", "ranks": comm.size, "nodes": V.dim(), "steps": steps,
                "versions": {"dolfin": dolfin.__version__, "pyadjoint": getattr(pyadjoint, "__version__", "2023.0")}})
    print("RESULT " + json.dumps(res), flush=True)
