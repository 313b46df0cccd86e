"""Observability (issue 11): PETSc log stages/events, per-phase times, eigsh progress,
the residual-history plot, ParaView output that reads back as one dataset.

MPI tests (marked ``mpi``) run at any size; the -log_view, no-PETSc and plot tests
run serially (they start their own processes / need no communicator).
"""
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
import torch
from mpi4py import MPI

import slasolve
from slasolve import _log
from slasolve.fem import Assembler, box_mesh, read_pvtu, write_mesh
from slasolve.testing import distribute, poisson_matrix

COMM = MPI.COMM_WORLD
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_PETSC = _log.enabled()
MPIRUN = shutil.which("mpirun")

needs_petsc = pytest.mark.skipif(not HAS_PETSC, reason="needs petsc4py")


def _dist_poisson(m=12):
    A = poisson_matrix((m, m)).tocsr()
    return A, distribute(A, COMM)


def _phase_sum(times, skip=("total", "adjoint")):
    return sum(v for k, v in times.items() if k not in skip)


# --------------------------------------------------------------------------- PETSc events
def _close_left_open(event, stage):
    """Local. Close ``event`` where an earlier exception inside it left it open in ``stage``.

    A Python exception raised inside KSPSolve (a user preconditioner or operator raising, as
    test_spmd_user_code's do) returns through PETSc's error path, which skips the event's end:
    the event stays open in that stage for the rest of the process, and PETSc counts no nested
    begin/end of an open event. So whether KSPSolve counted here depended on which tests the
    process had run before (an xdist worker). Each probe pair below counts only once the event
    is closed; until then one end() closes one level left open.
    """
    stage.push()
    try:
        for _ in range(100000):
            count = event.getPerfInfo(stage.id)["count"]
            event.begin()
            event.end()
            if event.getPerfInfo(stage.id)["count"] > count:
                return
            event.end()
        raise AssertionError(f"{event.name} still open in stage {stage.name}")
    finally:
        stage.pop()


@needs_petsc
@pytest.mark.mpi
def test_events_counted_in_their_stages():
    from petsc4py import PETSc
    PETSc.Log.begin()           # what -log_view does at start-up (idempotent)

    def count(ev, stage=None):
        return int(_log.event(ev).perf_info(stage).get("count", 0)) if stage else \
            int(_log.event(ev).perf_info().get("count", 0))

    ksp_solve = PETSc.Log.Event("KSPSolve")     # PETSc's own event, looked up by name

    def ksp_count(stage):
        return int(ksp_solve.getPerfInfo(_log.stage(stage).petsc.id)["count"])

    for stage in ("slaSolve", "slaAdjoint"):
        _close_left_open(ksp_solve, _log.stage(stage).petsc)

    names = [("slaSolve", "slaSolve"), ("slaSolverSetup", "slaSolve"), ("slaPCSetUp", "slaSolve"),
             ("slaSolveVerify", "slaSolve"), ("slaMatRefill", "slaSolve"), ("slaAdjoint", "slaAdjoint"),
             ("slaEigsh", "slaEigsh"), ("slaEigSetup", "slaEigsh"), ("slaEigSolve", "slaEigsh"),
             ("slaEigVerify", "slaEigsh"), ("slaAssembleMat", "slaAssembly"),
             ("slaAssembleVec", "slaAssembly"), ("slaAsmSetup", "slaAssembly"),
             ("slaHaloStart", "slaAssembly"), ("slaHaloFinish", "slaAssembly"),
             ("slaEigBackward", "slaAdjoint")]
    before = {n: count(n, s) for n, s in names}
    ksp_before = {s: ksp_count(s) for s in ("slaSolve", "slaAdjoint")}

    A, dA = _dist_poisson()
    v = dA.values.clone().requires_grad_()
    b = torch.ones(dA.n_local)
    x = slasolve.solve(dA.with_values(v), b, "gmres", pc="jacobi", rtol=1e-8, petsc_options={"ksp_type": "gmres"})
    x.sum().backward()
    slasolve.solve(dA.with_values(2 * v.detach()), b, "gmres", pc="jacobi", rtol=1e-8,
                   petsc_options={"ksp_type": "gmres"})      # same solver, new values: refill
    dE = distribute(poisson_matrix((12, 11)).tocsr(), COMM)     # simple extreme eigenvalues
    w, _, einfo = slasolve.eigsh(dE.with_values(dE.values.clone().requires_grad_()), k=2, which="LA",
                                 backend="slepc", return_info=True)
    assert "backward" not in einfo.times
    t0 = time.perf_counter()
    w.sum().backward()
    assert 0 < einfo.times["backward"] <= time.perf_counter() - t0
    mesh = box_mesh(6, cell="triangle", comm=COMM)
    V = Assembler(mesh)
    V.stiffness()
    V.load(1.0)

    after = {n: count(n, s) for n, s in names}
    grew = {n: after[n] - before[n] for n, _ in names}
    assert grew["slaSolve"] == 2 and grew["slaAdjoint"] == 1 and grew["slaEigsh"] == 1, grew
    assert grew["slaSolverSetup"] == 1, grew          # the second solve hit the cache
    assert grew["slaPCSetUp"] >= 2 and grew["slaSolveVerify"] >= 2 and grew["slaMatRefill"] >= 1, grew
    assert grew["slaEigBackward"] == 1, grew
    assert grew["slaEigSetup"] == 1 and grew["slaEigSolve"] == 1 and grew["slaEigVerify"] == 1, grew
    assert grew["slaAsmSetup"] == 1 and grew["slaAssembleMat"] == 1 and grew["slaAssembleVec"] == 1, grew
    halo = grew["slaHaloStart"], grew["slaHaloFinish"]
    assert halo[0] == halo[1] and (halo[0] >= 1 if COMM.size > 1 else halo[0] >= 0), halo
    # PETSc's own KSPSolve was logged inside slasolve's stages
    assert ksp_count("slaSolve") - ksp_before["slaSolve"] == 2
    assert ksp_count("slaAdjoint") - ksp_before["slaAdjoint"] == 1


@needs_petsc
@pytest.mark.mpi
def test_direct_and_nonlinear_solves_have_their_events():
    from petsc4py import PETSc
    PETSc.Log.begin()
    ev_direct, ev_nl = _log.event("slaDirect"), _log.event("slaNonlinear")
    d0 = int(ev_direct.perf_info("slaSolve")["count"])
    n0 = int(ev_nl.perf_info("slaNonlinear")["count"])
    A, dA = _dist_poisson(8)
    b = torch.ones(dA.n_local, dtype=torch.float64)
    x = slasolve.spsolve(dA, b)
    F = slasolve.factorized(dA)
    F.solve(b, transpose=True)
    c = torch.tensor(0.1, dtype=torch.float64)
    u = slasolve.nonlinear_solve(lambda u, c: dA @ u + c * u ** 3 - b, torch.zeros_like(b), c,
                                 linear_solver={"method": "gmres"})
    assert int(ev_direct.perf_info("slaSolve")["count"]) - d0 == 3   # spsolve, factorized, F.solve
    assert int(ev_nl.perf_info("slaNonlinear")["count"]) - n0 == 1
    ref = np.linalg.solve(A.toarray(), np.ones(A.shape[0]))
    assert np.allclose(dA.gather(x, root=None).numpy(), ref)
    r = dA @ u + c * u ** 3 - b
    assert float(slasolve.global_sum((r * r).sum())) ** 0.5 < 1e-7


@needs_petsc
def test_stage_only_pushed_by_the_outermost_call():
    from petsc4py import PETSc
    PETSc.Log.begin()
    inner = _log.event("slaSolve")
    n0 = int(inner.perf_info("slaSolve")["count"]), int(inner.perf_info("slaEigsh")["count"])
    A = slasolve.SparseTensor.from_scipy(poisson_matrix((8, 8)).tocsr())
    # torch shift-invert runs slasolve.solve inside eigsh: those solves stay in slaEigsh
    slasolve.eigsh(A, k=2, sigma=0.0, backend="torch")
    n1 = int(inner.perf_info("slaSolve")["count"]), int(inner.perf_info("slaEigsh")["count"])
    assert n1[0] == n0[0] and n1[1] > n0[1], (n0, n1)
    assert _log._depth[0] == 0 and not _log._open and not _log._collections


def test_phase_times_are_exclusive():
    with _log.collect() as times:
        with _log.phase("outer"):
            time.sleep(0.02)
            with _log.phase("inner"):
                time.sleep(0.03)
            with _log.collect() as nested:      # a nested collection keeps its own phases
                with _log.phase("other"):
                    time.sleep(0.01)
    assert set(times) == {"outer", "inner", "total"} and set(nested) == {"other", "total"}
    assert 0.03 <= times["inner"] < 0.03 + 0.02
    assert 0.03 <= times["outer"] < 0.03 + 0.03     # 0.02 + the nested collection, not inner
    assert times["inner"] + times["outer"] <= times["total"]


# --------------------------------------------------------------------------- times fields
@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_solve_times(backend):
    if backend == "petsc" and not HAS_PETSC:
        pytest.skip("needs petsc4py")
    A, dA = _dist_poisson()
    v = dA.values.clone().requires_grad_()
    b = torch.ones(dA.n_local, 2)
    t0 = time.perf_counter()
    x, info = slasolve.solve(dA.with_values(v), b, "cg", pc="jacobi", rtol=1e-9, backend=backend,
                             return_info=True)
    wall = time.perf_counter() - t0
    t = info.times
    assert {"check", "setup", "solve", "total"} <= set(t), t
    if backend == "petsc":
        assert {"refill", "verify"} <= set(t), t
    assert all(val >= 0 for val in t.values()), t
    assert t["solve"] > 0 and t["total"] <= wall
    assert _phase_sum(t) <= t["total"] * (1 + 1e-9)
    assert "adjoint" not in t and info.adjoint is None
    t1 = time.perf_counter()
    (x * x).sum().backward()
    bwall = time.perf_counter() - t1
    adj = info.adjoint
    assert isinstance(adj, slasolve.SolveInfo) and adj.converged
    assert 0 < t["adjoint"] == adj.times["total"] <= bwall
    assert _phase_sum(adj.times) <= adj.times["total"] * (1 + 1e-9) and adj.times["solve"] > 0
    if backend == "torch" and COMM.size > 1:
        assert t.get("halo", 0.0) > 0          # the native kernels' products exchange halos


@pytest.mark.mpi
@pytest.mark.parametrize("backend,kw", [("slepc", {}), ("slepc", {"sigma": 0.1}), ("torch", {"which": "SA"}),
                                        ("torch", {"which": "LA"})])
def test_eigsh_times(backend, kw):
    if backend == "slepc" and not HAS_PETSC:
        pytest.skip("needs slepc4py")
    A, dA = _dist_poisson(10)
    t0 = time.perf_counter()
    w, V, info = slasolve.eigsh(dA, k=3, backend=backend, return_info=True, **kw)
    wall = time.perf_counter() - t0
    ref = np.linalg.eigvalsh(A.toarray())
    want = (np.sort(ref[np.argsort(np.abs(ref - kw["sigma"]))[:3]]) if "sigma" in kw else
            ref[:3] if kw.get("which") == "SA" else ref[-3:])
    assert np.allclose(w.numpy(), want, rtol=1e-6)
    t = info.times
    assert {"check", "setup", "solve", "post", "total"} <= set(t), t
    assert all(val >= 0 for val in t.values()) and t["solve"] > 0
    assert _phase_sum(t) <= t["total"] * (1 + 1e-9) and t["total"] <= wall
    assert ("verify" in t) == (info.verify_rounds > 0)
    assert "backward" not in t
    if backend == "slepc":
        assert "refill" in t or "setup" in t


# --------------------------------------------------------------------------- eigsh progress
@pytest.mark.mpi
@pytest.mark.parametrize("backend,kw", [("slepc", {}), ("torch", {"which": "SA"}), ("torch", {"which": "LM"})])
def test_eigsh_progress_prints_on_rank0_only(backend, kw, capsys):
    if backend == "slepc" and not HAS_PETSC:
        pytest.skip("needs slepc4py")
    A, dA = _dist_poisson(10)
    capsys.readouterr()
    w, V, info = slasolve.eigsh(dA, k=2, backend=backend, progress=1, return_info=True, **kw)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "iteration" in ln]
    got = COMM.allgather(len(lines))
    assert got[0] > 0 and all(c == 0 for c in got[1:]), got
    first = COMM.bcast(lines, root=0)
    assert all(ln.strip().startswith("eigsh") and "converged" in ln and "residual" in ln for ln in first)
    # every iteration printed with progress=1, fewer with progress=3
    capsys.readouterr()
    slasolve.eigsh(dA, k=2, backend=backend, progress=3, **kw)
    lines3 = [ln for ln in capsys.readouterr().out.splitlines() if "iteration" in ln]
    its3 = [int(ln.split("iteration")[1].split()[0]) for ln in lines3]
    assert all(i % 3 == 0 for i in its3)
    assert COMM.bcast(len(lines3), root=0) < COMM.bcast(len(lines), root=0) or len(first) <= 2


@pytest.mark.mpi
def test_eigsh_progress_must_agree():
    A, dA = _dist_poisson(8)
    with pytest.raises(ValueError, match="progress"):
        slasolve.eigsh(dA, k=2, backend="torch", progress=-1)
    if COMM.size > 1:
        with pytest.raises(ValueError, match="progress"):
            slasolve.eigsh(dA, k=2, backend="torch", progress=(COMM.rank == 0))


# --------------------------------------------------------------------------- plot helper
def test_plot_residual_history():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    A = slasolve.SparseTensor.from_scipy(poisson_matrix((10, 10)).tocsr())
    b = torch.ones(100)
    _, i1 = slasolve.cg(A, b, rtol=1e-8, backend="torch", record_history=True)
    _, i2 = slasolve.cg(A, b, rtol=1e-8, backend="torch", pc="jacobi", record_history=True)
    ax = slasolve.plot_residual_history(i1)
    assert ax.get_yscale() == "log" and len(ax.lines) == 1
    assert np.allclose(ax.lines[0].get_ydata(), i1.residual_history)
    assert list(ax.lines[0].get_xdata()) == list(range(len(i1.residual_history)))
    plt.close(ax.figure)
    fig, ax = plt.subplots()
    out = slasolve.plot_residual_history([i1, i2], ax=ax, labels=["plain", "jacobi"], relative=True, rtol=True)
    assert out is ax and [t.get_text() for t in ax.get_legend().get_texts()] == ["plain", "jacobi"]
    data = [ln for ln in ax.lines if len(ln.get_xdata()) > 2]
    assert len(data) == 2 and all(abs(ln.get_ydata()[0] - 1.0) < 1e-15 for ln in data)
    assert np.allclose(data[1].get_ydata(), np.array(i2.residual_history) / i2.residual_history[0])
    tol_lines = [ln for ln in ax.lines if list(ln.get_ydata()) == [1e-8, 1e-8]]
    assert len(tol_lines) == 2
    fig.savefig(os.path.join(tempfile.gettempdir(), f"slasolve_plot_{os.getpid()}.png"))
    plt.close(fig)
    _, multi = slasolve.cg(A, torch.ones(100, 2), rtol=1e-8, backend="torch", record_history=True)
    ax = slasolve.plot_residual_history(multi)
    assert len(ax.lines) == 2          # one line per right-hand side
    plt.close(ax.figure)
    _, none = slasolve.cg(A, b, rtol=1e-8, backend="torch")
    with pytest.raises(ValueError, match="record_history"):
        slasolve.plot_residual_history(none)


def test_plot_without_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match="needs matplotlib"):
        slasolve.plot_residual_history([1.0, 0.1, 0.01])


# --------------------------------------------------------------------------- ParaView output
@pytest.mark.mpi
@pytest.mark.parametrize("cell", ["triangle", "hexahedron"])
def test_pvtu_reads_back_as_one_dataset(shared_dir, cell):
    import meshio
    n = (5, 4) if cell == "triangle" else (3, 2, 4)
    mesh = box_mesh(n, cell=cell, comm=COMM)
    s, e = mesh.owned_range
    xo = mesh.owned_node_coords()
    u = torch.sin(3 * xo[:, 0]) + xo[:, 1] ** 2                  # owned nodes
    vec = xo * 2.0                                               # owned nodes, dim components
    cval = mesh.cells.sum(1).to(torch.float64)                   # per local cell
    folder = os.path.join(shared_dir, "out.d", "sub")            # directories, a dot
    if COMM.rank == 0:
        os.makedirs(folder)
    COMM.Barrier()
    index = write_mesh(os.path.join(folder, "u&v.pvtu"), mesh, point_data={"u": u, "vec": vec},
                       cell_data={"c": cval})
    gathered = write_mesh(os.path.join(shared_dir, "g.vtu"), mesh, point_data={"u": u, "vec": vec},
                          cell_data={"c": cval}, gather=True)
    COMM.Barrier()
    # the index names its pieces relative to its folder, and they exist there
    root = ET.parse(index).getroot()
    sources = [p.get("Source") for p in root.iter("Piece")]
    assert sources == [f"u&v_{r:04d}.vtu" for r in range(COMM.size)]
    assert all(os.path.isfile(os.path.join(folder, src)) for src in sources)
    piece = meshio.read(os.path.join(folder, sources[0]))
    declared = {a.get("Name") for a in root.iter("PDataArray") if a.get("Name")}
    assert declared == set(piece.point_data) | set(piece.cell_data)
    # reference, built here from the distributed Mesh with mpi4py (not slasolve's writer)
    pts = np.concatenate(COMM.allgather(xo.numpy()))
    cells = np.concatenate(COMM.allgather(mesh.cells.numpy()))
    u_ref = np.concatenate(COMM.allgather(u.numpy()))
    c_ref = np.concatenate(COMM.allgather(cval.numpy()))
    rank_ref = np.concatenate([np.full(c, r) for r, c in enumerate(COMM.allgather(mesh.n_local_cells))])
    for where in (index, shutil.copytree(os.path.dirname(folder), os.path.join(shared_dir, f"moved{COMM.rank}"))):
        m = read_pvtu(where if where.endswith(".pvtu") else os.path.join(where, "sub", "u&v.pvtu"))
        assert m.points.shape == (mesh.n_global_nodes, 3)
        assert np.array_equal(m.points[:, :mesh.dim], pts) and not m.points[:, mesh.dim:].any()
        assert len(m.cells) == 1 and m.cells[0].type == cell and np.array_equal(m.cells[0].data, cells)
        assert np.array_equal(m.point_data["u"], u_ref)
        assert np.array_equal(m.point_data["vec"], 2 * pts)
        assert np.array_equal(m.point_data["global_id"], np.arange(mesh.n_global_nodes))
        assert np.array_equal(m.cell_data["c"][0], c_ref) and np.array_equal(m.cell_data["rank"][0], rank_ref)
    g = meshio.read(gathered)                                    # the same as the gathered file
    m = read_pvtu(index)
    assert np.array_equal(g.points, m.points) and np.array_equal(g.cells[0].data, m.cells[0].data)
    for k in g.point_data:
        assert np.array_equal(g.point_data[k], m.point_data[k])
    for k in g.cell_data:
        assert np.array_equal(g.cell_data[k][0], m.cell_data[k][0])


def test_read_pvtu_rejects_other_files(tmp_path):
    p = tmp_path / "x.pvtu"
    p.write_text('<?xml version="1.0"?><VTKFile type="UnstructuredGrid"></VTKFile>')
    with pytest.raises(ValueError, match="PUnstructuredGrid"):
        read_pvtu(p)


# --------------------------------------------------------------------------- -log_view, no PETSc
def _env():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PRTE_", "SLASOLVE_"))}
    env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_mpi_yield_when_idle="1",
               OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return env


LOG_SCRIPT = textwrap.dedent("""
    import torch, slasolve
    from mpi4py import MPI
    from slasolve.fem import Assembler, DirichletBC, boundary_dofs, box_mesh
    torch.set_default_dtype(torch.float64)
    comm = MPI.COMM_WORLD
    V = Assembler(box_mesh(12, comm=comm))
    kappa = torch.ones(V.mesh.n_local_cells, requires_grad=True)
    K, f = DirichletBC(V, boundary_dofs(V), 0.0).apply(V.stiffness(kappa), V.load(1.0))
    u = slasolve.solve(K, f, "cg", pc="jacobi", rtol=1e-10)
    u.sum().backward()
    slasolve.eigsh(K.detach(), k=2, which="LA")
    Kd = K.detach()
    slasolve.nonlinear_solve(lambda u: Kd @ u + u ** 3 - f, torch.zeros_like(f), jacobian=None,
                             linear_solver={"method": "gmres"})
    if comm.rank == 0:
        print("DONE")
""")


@pytest.mark.skipif(MPIRUN is None or COMM.size > 1 or not HAS_PETSC, reason="serial run with mpirun and PETSc")
def test_log_view_shows_slasolve_stages(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(LOG_SCRIPT)
    cmd = ["timeout", "-k", "5", "120", MPIRUN, "--oversubscribe", "--bind-to", "none", "-n", "2",
           sys.executable, str(script), "-log_view"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "DONE" in text, text[-3000:]
    summary = text.split("Summary of Stages:")[1].split("See the 'Profiling'")[0]
    for st in _log.STAGE_NAMES:
        assert f"{st}:" in summary, summary
    for ev in ("slaAssembleMat", "slaAsmSetup", "slaHaloStart", "slaSolverSetup", "slaPCSetUp", "slaSolveVerify",
               "slaAdjoint", "slaEigSolve", "slaEigVerify", "slaNonlinear", "KSPSolve", "EPSSolve", "SNESSolve"):
        assert f"\n{ev} " in text, ev
    for st in _log.STAGE_NAMES:     # each stage has its own event table
        assert re.search(rf"--- Event Stage \d+: {st}\n", text), st


NO_PETSC = textwrap.dedent("""
    import sys, io, contextlib
    sys.modules["petsc4py"] = None
    sys.modules["slepc4py"] = None
    import torch, slasolve
    from slasolve import _log
    from slasolve.testing import poisson_matrix
    torch.set_default_dtype(torch.float64)
    assert not _log.enabled() and "petsc4py.PETSc" not in sys.modules
    A = slasolve.SparseTensor.from_scipy(poisson_matrix((8, 8)).tocsr())
    v = A.values.clone().requires_grad_()
    x, info = slasolve.cg(A.with_values(v), torch.ones(64), rtol=1e-10)
    x.sum().backward()
    assert info.backend == "torch" and info.times["solve"] > 0 and info.adjoint.times["total"] > 0
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        w, V, einfo = slasolve.eigsh(A, k=2, which="SA", progress=1, return_info=True)
    assert "eigsh iteration" in buf.getvalue() and einfo.times["total"] > 0
    print("OK")
""")


def test_no_petsc_path():
    out = subprocess.run([sys.executable, "-c", NO_PETSC], capture_output=True, text=True, timeout=120,
                         env=_env())
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-3000:]
