"""Opt-in preconditioner reuse and warm starts in optimisation loops (``slasolve.solve``'s
``reuse_pc=True | "lagged" | "interpolation"`` and ``x0="previous"``).

Checks: after value changes every mode gives the answer of SciPy's ``spsolve`` on the
current values and the gradient of a no-reuse run (and gradcheck); PETSc's log events
prove the reuse (GAMG set-ups and prolongator builds counted) and the rebuild when the
iteration count grows or a kept preconditioner fails; the backward sets nothing up again;
no setting leaks into a later call without it; bad or disagreeing settings raise on every
rank. Run serially and under mpirun -n 2 / 3 / 4 with --with-mpi.
"""
import math

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve import DSparseTensor
from slasolve.krylov.reuse import LAG_CAP, LAG_GROWTH
from slasolve.testing import simp_mbb_system, spsolve_reference

pytestmark = pytest.mark.mpi
MODES = [True, "lagged", "interpolation"]


def poisson2d(n):
    I = sp.identity(n)
    D = sp.diags([-1, 2, -1], [-1, 0, 1], (n, n))
    return (sp.kron(I, D) + sp.kron(D, I)).tocsr()


def _close(x, ref, comm, tol):
    err = float(np.sqrt(comm.allreduce(float(((x.detach() - ref) ** 2).sum()))))
    nrm = float(np.sqrt(comm.allreduce(float((ref ** 2).sum()))))
    assert err <= tol * nrm, (err, nrm)


def _simp(comm, nelx, nely):
    """SIMP MBB stiffness: ``system(rho) -> (K_bc, f_bc)``, local cell count, first local
    cell, global cell count."""
    system, mesh = simp_mbb_system(comm, nelx, nely)
    nc = mesh.n_local_cells
    return system, nc, sum(comm.allgather(nc)[:comm.rank]), comm.allreduce(nc)


def _densities(comm, nc, off, n):
    """Uniform, two small changes, a big change (a kept GAMG fails on it), a small change."""
    g = torch.rand(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)[off:off + nc]
    big = 0.05 + 0.95 * g ** 2
    return [torch.full((nc,), 0.5), torch.full((nc,), 0.55), torch.full((nc,), 0.6), big, 0.9 * big]


def _events():
    """PETSc event counters over every slasolve stage: GAMG set-ups and prolongator builds (the
    finest level's prolongator smoothing, "PCGAMG Opt l00"; GAMG registers "PCGAMGProl" lazily)."""
    from petsc4py import PETSc
    from slasolve import _log
    PETSc.Log.begin()
    evs = {"gamg": PETSc.Log.Event("PCSetUp_GAMG+"), "prol": PETSc.Log.Event("PCGAMG Opt l00"),
           "setup": PETSc.Log.Event("PCSetUp")}
    stages = [0] + [_log.stage(s).petsc.id for s in _log.STAGE_NAMES]
    return lambda: {k: sum(e.getPerfInfo(st)["count"] for st in stages) for k, e in evs.items()}


def _compliance_and_grad(system, rho, count=None, method="cg", pc="gamg", **kw):
    """Compliance and its gradient; with ``count``, asserts that the backward sets up no
    preconditioner (PETSc's PCSetUp, sub-preconditioners included, counted)."""
    r = rho.clone().requires_grad_(True)
    K, f = system(r)
    x, info = slasolve.solve(K, f, method, pc=pc, rtol=1e-10, maxiter=600, return_info=True, **kw)
    c = slasolve.global_sum((f * x).sum())
    before = count() if count else None
    c.backward()
    if count:
        assert count()["setup"] == before["setup"], "the adjoint set a preconditioner up again"
    return K, f, x, float(c.detach()), r.grad, info


@pytest.mark.timeout(240)
@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_simp_sequence_answers_and_gradients(comm, mode, warm):
    """Every mode (with and without warm starts) through value changes, a big one included:
    x equals SciPy's solution for the current values, compliance and gradient equal a
    no-reuse run's, and the backward sets nothing up."""
    system, nc, off, n = _simp(comm, 24, 10)
    count = _events()
    for i, rho in enumerate(_densities(comm, nc, off, n)):
        K, f, x, c, g, info = _compliance_and_grad(system, rho, count, reuse_pc=mode,
                                                   x0="previous" if warm else None)
        _close(x, spsolve_reference(K, f, comm), comm, 1e-7)
        _, _, _, c_ref, g_ref, _ = _compliance_and_grad(system, rho, count, options_prefix="plain_")
        assert abs(c - c_ref) <= 1e-8 * abs(c_ref)
        _close(g, g_ref, comm, 1e-7)
        assert info.adjoint.converged and info.pc_reuse["mode"] == mode


@pytest.mark.parametrize("method,pc", [("cg", "gamg"), ("cg", "ilu"), ("gmres", "gamg"), ("gmres", "ilu"),
                                       ("bicgstab", "jacobi")])
def test_backward_reuses_forward_setup(comm, method, pc):
    """Default mode: the adjoint solve of the backward reuses the forward's preconditioner
    set-up (same values: no PCSetUp at all in the backward)."""
    system, nc, off, n = _simp(comm, 12, 6)
    count = _events()
    for rho in _densities(comm, nc, off, n)[:3]:
        _, _, _, _, g, info = _compliance_and_grad(system, rho, count, method=method, pc=pc)
        assert info.adjoint.converged and torch.isfinite(g).all()


@pytest.mark.timeout(240)
def test_setup_counts_prove_reuse_and_rebuild(comm):
    """PETSc's own counters: lagged sets GAMG up once for three value changes, rebuilds when
    the kept one fails (retry, same answer as a fresh KSP); interpolation recomputes GAMG
    per value change but keeps its prolongators until the iterations grow."""
    system, nc, off, n = _simp(comm, 40, 16)
    rhos = _densities(comm, nc, off, n)
    count = _events()

    def fresh_iterations(i, rho, **kw):  # a new KSP (another options prefix) on these values
        K, f = system(rho)
        return slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True,
                              options_prefix=f"fresh{i}_", **kw)[1].iterations

    # --- lagged
    deltas, infos = [], []
    for rho in rhos[:4]:
        c0 = count()
        *_, info = _compliance_and_grad(system, rho, reuse_pc="lagged")
        c1 = count()
        deltas.append(c1["gamg"] - c0["gamg"])
        infos.append(info)
    assert deltas[:3] == [1, 0, 0], deltas                      # built once, kept twice
    assert [i.pc_reuse["rebuilt"] for i in infos[:3]] == [True, False, False]
    big = infos[3]   # the kept GAMG fails on the big change: rebuilt, solved again, a fresh KSP's count
    assert big.pc_reuse["retried"] and big.pc_reuse["rebuilt"] and deltas[3] == 1
    assert 0 < big.pc_reuse["discarded_iterations"] <= math.ceil(LAG_CAP * infos[0].iterations)
    assert big.iterations == fresh_iterations(3, rhos[3], reuse_pc=False)
    # --- interpolation: GAMG set up per value change, prolongators only when built from scratch
    prol, gamg, infos = [], [], []
    for rho in rhos:
        c0 = count()
        *_, info = _compliance_and_grad(system, rho, reuse_pc="interpolation")
        c1 = count()
        prol.append(c1["prol"] - c0["prol"])
        gamg.append(c1["gamg"] - c0["gamg"])
        infos.append(info)
    assert gamg[:3] == [1, 1, 1] and gamg[4] == 1, gamg
    assert prol[0] > 0 and prol[1] == prol[2] == 0, prol
    # the big change: the old prolongators cannot do it within LAG_GROWTH x the iterations after
    # the build; the solve is redone with GAMG built from scratch (prolongators too), with the
    # count of a new interpolation-mode KSP (its smoothers estimate their own eigenvalues)
    assert infos[3].pc_reuse["retried"] and gamg[3] == 2 and prol[3] > 0
    assert infos[3].iterations == fresh_iterations(5, rhos[3], reuse_pc="interpolation")
    # after a redo the next call builds without trying the kept one (back-off)
    assert infos[4].pc_reuse["rebuilt"] and not infos[4].pc_reuse["retried"] and prol[4] > 0


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_lagged_rebuilds_when_iterations_grow(comm, backend):
    """ILU kept across a large rescaling D A D cannot converge within LAG_CAP x the count
    after the build: that solve is stopped there and redone with ILU rebuilt (a fresh
    solver's iteration count); the next call builds (back-off). A moderate rescaling that
    needs more than LAG_GROWTH x the count converges but makes the next call rebuild."""
    A = poisson2d(12)
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    r0, r1 = dA.row_range
    bg = torch.from_numpy(np.sin(np.arange(A.shape[0]) * 0.37) + 0.5)
    b = bg[r0:r1].clone()
    kw = dict(pc="ilu", backend=backend, rtol=1e-10, return_info=True, reuse_pc="lagged")
    _, i1 = slasolve.solve(dA, b, "cg", **kw)
    d = sp.diags(1.0 + 50.0 * np.abs(np.sin(np.arange(A.shape[0]))))
    A2 = (d @ A @ d).tocsr()
    dB = dA.with_values(DSparseTensor.from_global(A2, comm, partition="contiguous").values)
    fresh = DSparseTensor.from_global(A2, comm, partition="contiguous")
    _, i_fresh = slasolve.solve(fresh, b, "cg", pc="ilu", backend=backend, rtol=1e-10, return_info=True)
    _, i_kept = slasolve.solve(dB, b, "cg", pc="ilu", backend=backend, rtol=1e-10, return_info=True,
                               reuse_pc=True)  # the ILU of A on D A D, to the end
    assert i_kept.iterations > LAG_CAP * i1.iterations, (i1, i_kept)
    x2, i2 = slasolve.solve(dB, b, "cg", **kw)
    ref = torch.from_numpy(spla.spsolve(A2.tocsc(), bg.numpy()))[r0:r1]
    _close(x2, ref, comm, 1e-7)
    assert i2.pc_reuse["retried"] and i2.pc_reuse["rebuilt"], i2.pc_reuse
    assert i2.pc_reuse["discarded_iterations"] == math.ceil(LAG_CAP * i1.iterations)
    assert i2.iterations == i_fresh.iterations
    x3, i3 = slasolve.solve(dB, b, "cg", **kw)
    _close(x3, ref, comm, 1e-7)
    # after the redo the next call builds without trying the kept one (back-off): same values,
    # so nothing to set up, a fresh solver's count
    assert i3.pc_reuse["rebuilt"] and not i3.pc_reuse["retried"] and i3.iterations == i_fresh.iterations
    # a moderate rescaling: the kept ILU converges, slower than LAG_GROWTH x; the next call rebuilds
    d3 = sp.diags(1.0 + np.abs(np.cos(np.arange(A.shape[0]) * 1.3)))
    A3 = (d3 @ A2 @ d3).tocsr()
    dC = dA.with_values(DSparseTensor.from_global(A3, comm, partition="contiguous").values)
    ref3 = torch.from_numpy(spla.spsolve(A3.tocsc(), bg.numpy()))[r0:r1]
    x4, i4 = slasolve.solve(dC, b, "cg", **kw)
    _close(x4, ref3, comm, 1e-7)
    assert not i4.pc_reuse["rebuilt"] and not i4.pc_reuse["retried"]
    assert LAG_GROWTH * i2.iterations < i4.iterations <= LAG_CAP * i2.iterations, (i2, i4)
    x5, i5 = slasolve.solve(dC, b, "cg", **kw)
    _close(x5, ref3, comm, 1e-7)
    fresh3 = DSparseTensor.from_global(A3, comm, partition="contiguous")
    _, i_fresh3 = slasolve.solve(fresh3, b, "cg", pc="ilu", backend=backend, rtol=1e-10, return_info=True)
    assert i5.pc_reuse["rebuilt"] and i5.iterations == i_fresh3.iterations < i4.iterations


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_warm_start_previous(comm, backend):
    """x0='previous' starts from the last such solution (a repeated solve takes 0 iterations,
    forward and adjoint); the answer is SciPy's; a later call without it starts cold."""
    A = poisson2d(10)
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    r0, r1 = dA.row_range
    bg = torch.from_numpy(np.cos(np.arange(A.shape[0]) * 0.21))
    ref = torch.from_numpy(spla.spsolve(A.tocsc(), bg.numpy()))[r0:r1]
    kw = dict(pc="jacobi", backend=backend, rtol=1e-10, return_info=True)
    _, cold = slasolve.solve(dA, bg[r0:r1].clone(), "cg", **kw)
    infos = []
    for _ in range(2):
        b = bg[r0:r1].clone().requires_grad_(True)
        x, info = slasolve.solve(dA, b, "cg", x0="previous", **kw)
        slasolve.global_sum(x.sum()).backward()
        _close(x, ref, comm, 1e-8)
        infos.append(info)
    assert infos[0].iterations == cold.iterations > 0          # no previous solution: zeros
    assert infos[1].iterations == 0 and infos[1].adjoint.iterations == 0
    # two columns: no previous solution of that shape
    B = torch.stack([bg[r0:r1], 2 * bg[r0:r1]], 1)
    X, info = slasolve.solve(dA, B, "cg", x0="previous", **kw)
    _close(X[:, 1], 2 * ref, comm, 1e-8)
    assert info.iterations == cold.iterations
    # and nothing leaks into a call without x0="previous"
    _, after = slasolve.solve(dA, bg[r0:r1].clone(), "cg", **kw)
    assert after.iterations == cold.iterations


@pytest.mark.timeout(120)
def test_modes_never_leak_into_later_calls(comm):
    """After calls in every mode (values changing), a ``reuse_pc=False`` call equals a fresh
    KSP's (same iteration count), and a lagged call after it starts from a build."""
    system, nc, off, n = _simp(comm, 24, 10)
    rhos = _densities(comm, nc, off, n)
    for i, mode in enumerate(MODES):
        for rho in rhos[:3]:
            K, f = system(rho * (1 + 0.1 * i))
            slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, reuse_pc=mode, x0="previous")
        K, f = system(rhos[3])
        x, info = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True,
                                 reuse_pc=False)
        _, fresh = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True,
                                  options_prefix=f"fresh{i}_", reuse_pc=False)
        assert info.iterations == fresh.iterations and info.pc_reuse is None
        _close(x, spsolve_reference(K, f, comm), comm, 1e-7)
    K, f = system(rhos[4])
    _, info = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True, reuse_pc="lagged")
    assert info.pc_reuse["rebuilt"]


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_multiple_rhs_lagged(comm, backend):
    A = poisson2d(9)
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    r0, r1 = dA.row_range
    rng = np.random.default_rng(3)
    Bg = torch.from_numpy(rng.standard_normal((A.shape[0], 3)))
    for s in (1.0, 1.5, 3.0):
        dS = dA.with_values(dA.values.detach() * s)
        X = slasolve.solve(dS, Bg[r0:r1].clone(), "cg", pc="ilu", backend=backend, rtol=1e-10,
                           reuse_pc="lagged", x0="previous")
        ref = torch.from_numpy(spla.spsolve((A * s).tocsc(), Bg.numpy()))[r0:r1]
        _close(X, ref, comm, 1e-7)


@pytest.mark.parametrize("mode", MODES)
def test_gradcheck_with_reuse(comm, mode):
    """gradcheck perturbs the values one by one: reuse and warm starts change nothing
    beyond the solve tolerance."""
    if comm.size > 1:
        pytest.skip("per-rank gradcheck on local inputs needs one rank (gradients vs a no-reuse run "
                    "are checked at every size above)")
    A = poisson2d(4)
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    v = dA.values.detach().clone().requires_grad_()
    b = torch.from_numpy(np.sin(np.arange(16) * 0.37) + 0.5).requires_grad_()

    def f(v, b):
        return slasolve.solve(dA.with_values(v), b, "cg", pc="gamg", rtol=1e-13, atol=1e-15, reuse_pc=mode,
                              x0="previous")

    # a warm-started adjoint differs between two backward passes within the solve tolerance
    assert torch.autograd.gradcheck(f, (v, b), atol=1e-6, rtol=1e-5, nondet_tol=1e-9)


def test_bad_and_disagreeing_settings_raise_everywhere(comm):
    A = poisson2d(5)
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    r0, r1 = dA.row_range
    b = torch.ones(r1 - r0, dtype=torch.float64)
    for kw in (dict(reuse_pc="sometimes"), dict(reuse_pc=1), dict(x0="prev")):
        with pytest.raises(ValueError):
            slasolve.solve(dA, b, "cg", **kw)
    if comm.size > 1:
        with pytest.raises(ValueError, match="reuse_pc"):
            slasolve.solve(dA, b, "cg", reuse_pc="lagged" if comm.rank == 0 else False)
        with pytest.raises(ValueError, match="x0"):
            slasolve.solve(dA, b, "cg", x0="previous" if comm.rank == 0 else None)
    x = slasolve.solve(dA, b, "cg", rtol=1e-10)   # and the communicator is still in step
    _close(x, torch.from_numpy(spla.spsolve(A.tocsc(), np.ones(25)))[r0:r1], comm, 1e-8)


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_batched_local_matrix_lagged_and_warm(backend):
    """A batched (local) SparseTensor: one solve per batch entry, each reusing/warm-starting
    from the previous entry's; every entry equals SciPy's solution."""
    A = poisson2d(6)
    At = slasolve.SparseTensor.from_scipy(A)
    scales = torch.tensor([1.0, 1.1, 4.0], dtype=torch.float64)
    v = (At.values[None, :] * scales[:, None]).clone().requires_grad_()
    b = torch.stack([torch.from_numpy(np.sin(np.arange(36) * 0.3) + 1.0)] * 3)
    x, info = slasolve.solve(At.with_values(v), b, "cg", pc="ilu", backend=backend, rtol=1e-12,
                             reuse_pc="lagged", x0="previous", return_info=True)
    ref = spla.spsolve(A.tocsc(), b[0].numpy())
    for i in range(3):
        np.testing.assert_allclose(x[i].detach().numpy(), ref / float(scales[i]), rtol=1e-9, atol=1e-12)
    x.sum().backward()
    assert torch.isfinite(v.grad).all() and all(i.pc_reuse["mode"] == "lagged" for i in info.per_rhs)


@pytest.mark.parametrize("backend", ["petsc", "torch"])
def test_lagged_backs_off_when_values_keep_jumping(comm, backend):
    """Values that jump at every call (A, D A D, A, ...): the kept ILU fails its cap on the
    2nd call; after that the next 1, then 3 calls build without trying it, so the 8 calls
    try (and redo) only 3 times; every answer is SciPy's."""
    A = poisson2d(12)
    d = sp.diags(1.0 + 50.0 * np.abs(np.sin(np.arange(A.shape[0]))))
    mats = [A, (d @ A @ d).tocsr()]
    dA = DSparseTensor.from_global(A, comm, partition="contiguous")
    vals = [DSparseTensor.from_global(M, comm, partition="contiguous").values for M in mats]
    r0, r1 = dA.row_range
    bg = torch.from_numpy(np.sin(np.arange(A.shape[0]) * 0.37) + 0.5)
    refs = [torch.from_numpy(spla.spsolve(M.tocsc(), bg.numpy()))[r0:r1] for M in mats]
    pattern = []
    for k in range(8):
        x, info = slasolve.solve(dA.with_values(vals[k % 2]), bg[r0:r1].clone(), "cg", pc="ilu", backend=backend,
                                 rtol=1e-10, return_info=True, reuse_pc="lagged")
        _close(x, refs[k % 2], comm, 1e-7)
        pattern.append("redo" if info.pc_reuse["retried"] else "build" if info.pc_reuse["rebuilt"] else "kept")
    assert pattern == ["build", "redo", "build", "redo", "build", "build", "build", "redo"], pattern


@pytest.mark.parametrize("backend,pc,expected", [("petsc", "gamg", "interpolation"), ("petsc", "jacobi", None),
                                                 ("torch", "jacobi", None)])
def test_auto_is_the_default(comm, backend, pc, expected):
    """``reuse_pc="auto"`` (the default) is ``"interpolation"`` for GAMG on the petsc backend and
    no reuse otherwise; through value changes the answers equal SciPy's."""
    system, nc, off, n = _simp(comm, 16, 8)
    for rho in _densities(comm, nc, off, n)[:4]:
        K, f = system(rho)
        x, info = slasolve.solve(K, f, "cg", pc=pc, backend=backend, rtol=1e-10, maxiter=2000, return_info=True)
        assert (info.pc_reuse or {}).get("mode") == expected
        _close(x, spsolve_reference(K, f, comm), comm, 1e-7)


@pytest.mark.parametrize("mode", ["lagged", "interpolation"])
def test_other_tolerances_neither_capped_nor_judged(comm, mode):
    """A solve at a much tighter rtol in a reusing loop (a reference solve, a final polish) needs
    more iterations for that reason alone: it is not capped (no redo) and does not make the next
    solve at the loop's rtol rebuild."""
    system, nc, off, n = _simp(comm, 24, 10)
    rhos = _densities(comm, nc, off, n)
    kw = dict(pc="gamg", maxiter=2000, return_info=True, reuse_pc=mode, options_prefix=f"tols_{mode}_")
    K, f = system(rhos[0])
    _, first = slasolve.solve(K, f, "cg", rtol=1e-6, **kw)
    K, f = system(rhos[0] * 1.01)
    x, tight = slasolve.solve(K, f, "cg", rtol=1e-12, **kw)
    assert tight.converged and not tight.pc_reuse["rebuilt"] and not tight.pc_reuse["retried"]
    assert tight.iterations > first.iterations
    _close(x, spsolve_reference(K, f, comm), comm, 1e-9)
    K, f = system(rhos[0] * 1.02)
    _, again = slasolve.solve(K, f, "cg", rtol=1e-6, **kw)
    assert not again.pc_reuse["rebuilt"] and not again.pc_reuse["retried"]


@pytest.mark.timeout(120)
def test_kept_preconditioner_is_rebuilt_for_the_same_values(comm):
    """A solve with ``reuse_pc=True`` on new values keeps the old GAMG; the next solve on the
    SAME values without reuse must build one for them (the set-up is skipped only when the
    preconditioner was built for the operator's current values), with a fresh KSP's count;
    a third identical call sets nothing up."""
    system, nc, off, n = _simp(comm, 24, 10)
    rhos = _densities(comm, nc, off, n)
    count = _events()
    K0, f0 = system(rhos[0])
    slasolve.solve(K0, f0, "cg", pc="gamg", rtol=1e-10, reuse_pc=False)
    K, f = system(rhos[1])
    c0 = count()
    _, kept = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True, reuse_pc=True)
    c1 = count()
    x, info = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True, reuse_pc=False)
    c2 = count()
    _, again = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True, reuse_pc=False)
    c3 = count()
    _, fresh = slasolve.solve(K, f, "cg", pc="gamg", rtol=1e-10, maxiter=600, return_info=True,
                              options_prefix="fresh_same_values_", reuse_pc=False)
    assert not kept.pc_reuse["retried"]
    assert c1["gamg"] - c0["gamg"] == 0 and c2["gamg"] - c1["gamg"] == 1 and c3["gamg"] == c2["gamg"]
    assert info.iterations == again.iterations == fresh.iterations
    _close(x, spsolve_reference(K, f, comm), comm, 1e-7)
