"""PDE-constrained optimisation examples: examples/topology_optimisation.py (SIMP, MBB beam)
and examples/inverse_conductivity.py, plus slasolve.fem.filters; examples/hyperelastic_inverse.py
(--check criteria, rank-count independent data and misfit, misfit gradient through
nonlinear_solve vs central finite differences).

Checks: the examples run and decrease their objective; autograd SIMP sensitivities equal
the analytic ones; the compliance history equals a NumPy/SciPy transcription of the
88-line code (Andreassen et al. 2011); gradcheck of the inverse problem's data misfit;
the density filter equals the 88-line code's H / Hs; the noise is rank-count independent.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import os

import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch

import slasolve
import slasolve.krylov
from mpi4py import MPI

from example_loader import load_example

from slasolve.fem import DensityFilter, box_mesh, cell_laplacian, dual_graph_laplacian, elasticity_stiffness
from slasolve.testing import local_slice

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD


topo = load_example("topology_optimisation")
inv = load_example("inverse_conductivity")


def gather(x):
    return np.concatenate(COMM.allgather(np.asarray(x.detach() if isinstance(x, torch.Tensor) else x)))


def top88_reference(nelx, nely, volfrac, penal, rmin, iters):
    """The 88-line code (ft=2, density filter), NumPy/SciPy; returns the compliance history."""
    E0, Emin, nu = 1.0, 1e-9, 0.3
    A11 = np.array([[12, 3, -6, -3], [3, 12, 3, 0], [-6, 3, 12, -3], [-3, 0, -3, 12]])
    A12 = np.array([[-6, -3, 0, 3], [-3, -6, -3, -6], [0, -3, -6, 3], [3, -6, 3, -6]])
    B11 = np.array([[-4, 3, -2, 9], [3, -4, -9, 4], [-2, -9, -4, -3], [9, 4, -3, -4]])
    B12 = np.array([[2, -3, 4, -9], [-3, 2, 9, -2], [4, 9, 2, 3], [-9, -2, 3, 2]])
    KE = 1 / (1 - nu ** 2) / 24 * (np.block([[A11, A12], [A12.T, A11]]) + nu * np.block([[B11, B12], [B12.T, B11]]))
    nodenrs = np.arange((1 + nelx) * (1 + nely)).reshape(1 + nely, 1 + nelx, order="F")
    edofVec = (2 * nodenrs[:-1, :-1] + 2).reshape(-1, order="F")
    edofMat = edofVec[:, None] + np.array([0, 1, 2 * nely + 2, 2 * nely + 3, 2 * nely, 2 * nely + 1, -2, -1])
    iK = np.repeat(edofMat, 8, axis=1).reshape(-1)
    jK = np.tile(edofMat, (1, 8)).reshape(-1)
    ndof = 2 * (nely + 1) * (nelx + 1)
    F = np.zeros(ndof); F[1] = -1.0
    fixed = np.union1d(np.arange(0, 2 * (nely + 1), 2), [ndof - 1])
    free = np.setdiff1d(np.arange(ndof), fixed)
    ii, jj, vv = [], [], []
    r = int(np.ceil(rmin)) - 1
    for i1 in range(nelx):
        for j1 in range(nely):
            for i2 in range(max(i1 - r, 0), min(i1 + r, nelx - 1) + 1):
                for j2 in range(max(j1 - r, 0), min(j1 + r, nely - 1) + 1):
                    ii.append(i1 * nely + j1); jj.append(i2 * nely + j2)
                    vv.append(max(0.0, rmin - np.hypot(i1 - i2, j1 - j2)))
    H = sp.csr_matrix((vv, (ii, jj)), shape=(nelx * nely,) * 2)
    Hs = np.asarray(H.sum(1)).ravel()
    x = np.full(nelx * nely, volfrac)
    xPhys = x.copy()
    hist = []
    for _ in range(iters):
        sK = (KE.reshape(-1)[:, None] * (Emin + xPhys ** penal * (E0 - Emin))[None]).reshape(-1, order="F")
        K = sp.coo_matrix((sK, (iK, jK)), shape=(ndof, ndof)).tocsc()
        K = (K + K.T) / 2
        U = np.zeros(ndof)
        U[free] = spla.spsolve(K[free][:, free], F[free])
        ce = np.einsum("ei,ij,ej->e", U[edofMat], KE, U[edofMat])
        c = float(((Emin + xPhys ** penal * (E0 - Emin)) * ce).sum())
        dc = -penal * (E0 - Emin) * xPhys ** (penal - 1) * ce
        dv = np.ones(nelx * nely)
        dc = H @ (dc / Hs); dv = H @ (dv / Hs)
        l1, l2, move = 0.0, 1e9, 0.2
        while (l2 - l1) / (l1 + l2) > 1e-3:
            lmid = 0.5 * (l2 + l1)
            xnew = np.maximum(0, np.maximum(x - move, np.minimum(1, np.minimum(x + move, x * np.sqrt(-dc / dv / lmid)))))
            xPhys = (H @ xnew) / Hs
            if xPhys.sum() > volfrac * nelx * nely:
                l1 = lmid
            else:
                l2 = lmid
        x = xnew
        hist.append(c)
    return hist, xPhys.reshape(nely, nelx, order="F")


def filter_reference(nelx, nely, rmin):
    """H / Hs of the 88-line code in our cell order (id = ix + iy * nelx)."""
    ii, jj, vv = [], [], []
    for i1 in range(nelx):
        for j1 in range(nely):
            for i2 in range(nelx):
                for j2 in range(nely):
                    w = rmin - np.hypot(i1 - i2, j1 - j2)
                    if w > 0:
                        ii.append(i1 + j1 * nelx); jj.append(i2 + j2 * nelx); vv.append(w)
    H = sp.csr_matrix((vv, (ii, jj)), shape=(nelx * nely,) * 2)
    return H, np.asarray(H.sum(1)).ravel()


# ----------------------------------------------------------------------------- filters
@pytest.mark.parametrize("rmin", [1.5, 2.7])
def test_density_filter_matches_top88(rmin):
    nelx, nely = 9, 4
    mesh = box_mesh((nelx, nely), upper=(nelx, nely), cell="quad", comm=COMM)
    filt = DensityFilter(mesh, (nelx, nely), rmin)
    x = torch.rand(nelx * nely, generator=torch.Generator().manual_seed(3), dtype=torch.float64,
                   requires_grad=True)
    s, e = filt.cells.cell_range
    y = filt(local_slice(x, s, e, COMM))
    H, Hs = filter_reference(nelx, nely, rmin)
    np.testing.assert_allclose(gather(y), H @ x.detach().numpy() / Hs, rtol=1e-13, atol=1e-14)
    # backward: H^T (w / Hs), through the reverse halo exchange
    w = torch.linspace(-1, 2, nelx * nely, dtype=torch.float64)
    (y * w[s:e]).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), H.T @ (w.numpy() / Hs), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("cell,n,deg", [("quad", (6, 4), 4), ("triangle", (5, 4), 3), ("hexahedron", (3, 3, 4), 6)])
def test_cell_laplacian(cell, n, deg):
    upper = tuple(float(v) for v in n)                   # unit boxes: isotropic spacing
    mesh = box_mesh(n, upper=upper, cell=cell, comm=COMM)
    L = cell_laplacian(mesh, n)
    d = gather(L.diagonal())
    assert d.max() == deg and d.min() >= 1
    ones = torch.ones(L.n_local, dtype=torch.float64)
    assert float((L @ ones).abs().max()) == 0.0
    # symmetric: <a, L b> = <L a, b>
    g = torch.Generator().manual_seed(1)
    N = L.global_shape[0]
    a, b = torch.randn(N, generator=g, dtype=torch.float64), torch.randn(N, generator=g, dtype=torch.float64)
    s, e = L.row_range
    lhs = COMM.allreduce(float(a[s:e] @ (L @ b[s:e])))
    rhs = COMM.allreduce(float((L @ a[s:e]) @ b[s:e]))
    assert abs(lhs - rhs) < 1e-12 * max(1.0, abs(lhs))


# ----------------------------------------------------------------------------- topology optimisation
def test_topology_example_runs_and_decreases(tmp_path):
    png = os.path.join(COMM.bcast(str(tmp_path), root=0), "mbb.png")
    out = topo.main(["--nelx", "24", "--nely", "8", "--iters", "5", "--quiet", "--png", png])
    h = out["history"]
    assert len(h) == 5 and all(np.isfinite(h))
    assert all(b < a for a, b in zip(h, h[1:])), h
    vol = COMM.allreduce(float(out["xphys"].sum())) / (24 * 8)
    assert abs(vol - 0.5) < 2e-3
    if COMM.rank == 0:
        assert os.path.getsize(png) > 0


def test_simp_sensitivities_equal_analytic():
    nelx, nely, p, E0, Emin = 12, 8, 3.0, 1.0, 1e-9
    prob = topo.MBB(nelx, nely, penal=p, E0=E0, Emin=Emin, comm=COMM, use_filter=False,
                    solve_opts=dict(rtol=1e-14, maxiter=5000))
    s, e = prob.cell_range
    xg = 0.2 + 0.8 * torch.rand(nelx * nely, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x = xg[s:e].clone().requires_grad_(True)
    c = prob.compliance(x, filtered=False)
    c.backward()
    sp_ = prob.space
    u = sp_.fetch_ghosts(prob.last_u)                          # (n_local_nodes, 2)
    ue = u[sp_.local_cells].reshape(-1, 8)                     # node-major local dofs
    k0 = elasticity_stiffness(sp_.cell_coords, 1.0, 0.3, "quad", "plane_stress")
    ce = torch.einsum("ei,eij,ej->e", ue, k0, ue)
    expect = -p * x.detach() ** (p - 1) * (E0 - Emin) * ce
    err = COMM.allreduce(float((x.grad - expect).abs().max()), op=MPI.MAX)
    scale = COMM.allreduce(float(expect.abs().max()), op=MPI.MAX)
    assert err <= 1e-8 * scale, (err, scale)
    # and the compliance is u^T K u = sum_e E_e u_e^T k0 u_e
    ce_sum = COMM.allreduce(float(((Emin + x.detach() ** p * (E0 - Emin)) * ce).sum()))
    c = float(c.detach())
    assert abs(ce_sum - c) <= 1e-10 * abs(c)


def test_top88_history_matches_reference():
    nelx, nely, rmin, iters = 30, 10, 1.5, 8
    ref, ref_x = top88_reference(nelx, nely, 0.5, 3.0, rmin, iters)
    out = topo.main(["--nelx", str(nelx), "--nely", str(nely), "--rmin", str(rmin), "--iters", str(iters),
                     "--tol", "0", "--rtol", "1e-12", "--quiet"])
    h = np.asarray(out["history"])
    np.testing.assert_allclose(h, ref, rtol=1e-6)
    design = topo.gather_design(out["problem"], out["xphys"])
    if COMM.rank == 0:                                      # top88's rows run top-down
        np.testing.assert_allclose(design[::-1], ref_x, atol=1e-6)


@pytest.mark.parametrize("reuse", ["pc", "lagged", "interpolation"])
def test_top88_history_with_reuse(reuse):
    """--reuse (preconditioner kept across OC iterations) and --warm (x0="previous") change
    iteration counts only: the history is still the 88-line code's."""
    nelx, nely, rmin, iters = 30, 10, 1.5, 8
    ref, _ = top88_reference(nelx, nely, 0.5, 3.0, rmin, iters)
    out = topo.main(["--nelx", str(nelx), "--nely", str(nely), "--rmin", str(rmin), "--iters", str(iters),
                     "--tol", "0", "--rtol", "1e-12", "--quiet", "--reuse", reuse, "--warm"])
    np.testing.assert_allclose(np.asarray(out["history"]), ref, rtol=1e-6)
    infos = out["problem"].infos
    if reuse == "interpolation" and slasolve.krylov.default_backend() != "petsc":
        # documented: no prolongators to keep on the torch backend, the call is a default one
        assert len(infos) == iters and all(i.pc_reuse is None for i in infos)
        return
    assert len(infos) == iters and all(i.pc_reuse["mode"] == topo.REUSE[reuse] for i in infos)
    if reuse != "pc":  # built on the first iteration, kept on some later ones
        assert infos[0].pc_reuse["rebuilt"] and not all(i.pc_reuse["rebuilt"] for i in infos)


def test_optimise_restarts_from_x0():
    """optimise(..., x0=x) continues a run: 3 iterations, then 3 more from their design, give
    the 88-line code's 6-iteration history; an x0 of the wrong shape on one rank raises on all."""
    nelx, nely, rmin = 30, 10, 1.5
    ref, _ = top88_reference(nelx, nely, 0.5, 3.0, rmin, 6)
    prob = topo.MBB(nelx, nely, rmin=rmin, comm=COMM, solve_opts=dict(rtol=1e-12))
    x3, h1 = topo.optimise(prob, 0.5, 3, tol=0.0)
    _, h2 = topo.optimise(prob, 0.5, 3, tol=0.0, x0=x3)
    np.testing.assert_allclose(h1 + h2, ref, rtol=1e-6)
    bad = x3 if COMM.rank != COMM.size - 1 else torch.cat([x3, x3[:1]])
    with pytest.raises(ValueError, match="x0 must have shape"):
        topo.optimise(prob, 0.5, 1, tol=0.0, x0=bad)


# ----------------------------------------------------------------------------- inverse conductivity
@pytest.mark.parametrize("optimizer", ["lbfgs", "adam"])
def test_inverse_example_runs_and_decreases(optimizer):
    out = inv.main(["--n", "8", "--iters", "6", "--optimizer", optimizer, "--quiet"])
    h = out["history"]
    assert len(h) == 7 and all(np.isfinite(h))
    assert h[-1] < 0.5 * h[0], h
    init = out["problem"].relative_error(torch.zeros_like(out["theta"]))
    assert out["rel_error"] < init


def test_inverse_data_independent_of_rank_count():
    prob = inv.ConductivityProblem(n=8, comm=COMM)
    ref = inv.ConductivityProblem(n=8, comm=MPI.COMM_SELF)
    d0, d1 = prob.space.dof_range
    np.testing.assert_allclose(prob.data.numpy(), ref.data.numpy()[d0:d1], rtol=0, atol=1e-9)
    s, e = prob.cell_range
    th = torch.linspace(-0.5, 0.5, prob.n_cells, dtype=torch.float64)
    assert abs(float(prob.misfit(th[s:e])) - float(ref.misfit(th))) < 1e-8 * float(ref.misfit(th))


def test_inverse_misfit_gradcheck():
    prob = inv.ConductivityProblem(n=4, noise=0.01, comm=COMM, solve_opts=dict(rtol=1e-13, maxiter=2000))
    s, e = prob.cell_range
    theta = (0.3 * torch.sin(torch.arange(prob.n_cells, dtype=torch.float64))).requires_grad_(True)

    def f(t):
        return prob.misfit(local_slice(t, s, e, COMM))

    torch.manual_seed(0)                                    # fast mode: the same random vectors everywhere
    assert torch.autograd.gradcheck(f, (theta,), eps=1e-6, atol=1e-6, rtol=1e-5,
                                    fast_mode=COMM.Get_size() > 1)


def l_shaped_msh(d):
    """A gmsh file written by rank 0: the [0, 2] x [0, 1] plate minus its upper-right quarter,
    P1 triangles (a domain that is not a box, with a bounding box that is not the unit square)."""
    path = os.path.join(d, "lshape.msh")
    if COMM.rank == 0:
        meshio = pytest.importorskip("meshio")
        box = box_mesh((12, 6), upper=(2.0, 1.0), cell="triangle", comm=MPI.COMM_SELF)
        c = box.cells.numpy()
        xc = box.node_coords.numpy()[c].mean(1)
        keep = c[~((xc[:, 0] > 1.0) & (xc[:, 1] > 0.5))]
        used, inv = np.unique(keep, return_inverse=True)
        pts = np.c_[box.node_coords.numpy()[used], np.zeros(used.size)]
        meshio.write(path, meshio.Mesh(pts, [("triangle", inv.reshape(keep.shape))]), file_format="gmsh22",
                     binary=False)
    COMM.Barrier()
    return path


@pytest.fixture
def shared_tmp():
    import shutil
    import tempfile
    d = COMM.bcast(tempfile.mkdtemp(prefix="slasolve_inv_mesh_") if COMM.rank == 0 else None, root=0)
    yield d
    COMM.Barrier()
    if COMM.rank == 0:
        shutil.rmtree(d, ignore_errors=True)


def test_dual_graph_laplacian_is_the_box_cell_laplacian():
    """On a box mesh, the Laplacian of the dual graph (any mesh) equals cell_laplacian (box only)."""
    mesh = box_mesh(6, cell="triangle", comm=COMM)
    L, ref = dual_graph_laplacian(mesh), cell_laplacian(mesh, 6)
    assert L.spec.offsets == ref.spec.offsets
    assert torch.equal(L.local.indptr, ref.local.indptr) and torch.equal(L.local.indices, ref.local.indices)
    assert torch.equal(L.local.values, ref.local.values)


def test_inverse_example_on_a_mesh_file(shared_tmp):
    """--mesh FILE (a gmsh .msh written here, converted once): the objective falls, kappa gets
    closer to the truth, the data do not depend on the rank count, and --output .xdmf holds the
    recovered kappa."""
    h5py = pytest.importorskip("h5py")  # noqa: F841
    from slasolve.fem import read_cell_data, read_mesh
    msh = l_shaped_msh(shared_tmp)
    out = os.path.join(shared_tmp, "kappa.xdmf")
    res = inv.main(["--mesh", msh, "--iters", "6", "--quiet", "--output", out], comm=COMM)
    h, prob = res["history"], res["problem"]
    assert prob.n_cells == 108 and prob.mesh.cell_type == "triangle"
    assert len(h) == 7 and all(np.isfinite(h)) and h[-1] < 0.5 * h[0], h
    assert res["rel_error"] < prob.relative_error(torch.zeros_like(res["theta"]))
    mesh = read_mesh(out, comm=COMM)
    kappa = read_cell_data(out, mesh, "kappa")
    got = np.empty(prob.n_cells)
    got[np.concatenate(COMM.allgather(mesh.original_cell_ids.numpy()))] = np.concatenate(
        COMM.allgather(kappa.numpy()))
    ref = np.concatenate(COMM.allgather(torch.exp(res["theta"]).numpy()))   # the file's cells: rank after rank
    assert np.array_equal(got, ref)
    # the data by file node id, and the misfit of a theta given by file cell id, at one rank and at this run's
    xdmf = msh[:-len(".msh")] + ".xdmf"
    one = inv.ConductivityProblem(noise=prob.sigma, comm=MPI.COMM_SELF, mesh_file=xdmf)
    for p in (prob, one):
        p.file_ids = p.mesh.original_ids[p.mesh.owned_mask()].numpy()
    d_ref = np.empty((one.file_ids.size, 2))
    d_ref[one.file_ids] = one.data.numpy()
    np.testing.assert_allclose(prob.data.numpy(), d_ref[prob.file_ids], rtol=0, atol=1e-9)

    def theta(p):
        return 0.4 * torch.sin(p.mesh.original_cell_ids.to(torch.float64))
    assert abs(float(prob.misfit(theta(prob))) - float(one.misfit(theta(one)))) < 1e-8 * float(one.misfit(theta(one)))


def cantilever_msh(d):
    """A gmsh file written by rank 0: the [0, 3] x [0, 1] plate in 12 x 4 quads, its left edge
    tagged 1 (clamped), the lower half of its right edge tagged 2 (loaded)."""
    path = os.path.join(d, "cantilever.msh")
    if COMM.rank == 0:
        meshio = pytest.importorskip("meshio")
        box = box_mesh((12, 4), upper=(3.0, 1.0), cell="quad", comm=MPI.COMM_SELF)
        xy = box.node_coords.numpy()

        def edge(sel):
            ids = np.flatnonzero(sel)
            ids = ids[np.argsort(xy[ids, 1])]
            return np.stack([ids[:-1], ids[1:]], axis=1)
        left, right = edge(np.isclose(xy[:, 0], 0.0)), edge(np.isclose(xy[:, 0], 3.0) & (xy[:, 1] < 0.51))
        lines = np.concatenate([left, right])
        tags = [np.r_[np.ones(len(left), int), np.full(len(right), 2)], np.full(box.n_global_cells, 3)]
        meshio.write(path, meshio.Mesh(np.c_[xy, np.zeros(len(xy))], [("line", lines), ("quad", box.cells.numpy())],
                                       cell_data={"gmsh:physical": tags, "gmsh:geometrical": tags}),
                     file_format="gmsh22", binary=False)
    COMM.Barrier()
    return path


def test_topology_example_on_a_mesh_file(shared_tmp):
    """--mesh FILE with tagged facets (a gmsh .msh written here): the compliance falls, the volume
    meets volfrac, the history is the one-rank run's (to the solver tolerance), the design goes to
    --output, and the gradient through the Helmholtz filter matches central differences."""
    pytest.importorskip("h5py")  # the mesh and --output are XDMF + HDF5
    from slasolve.fem import read_cell_data, read_mesh
    msh = cantilever_msh(shared_tmp)
    out = os.path.join(shared_tmp, "design.xdmf")
    argv = ["--iters", "5", "--quiet", "--rtol", "1e-12"]
    res = topo.main(["--mesh", msh, "--output", out] + argv, comm=COMM)
    h, prob = res["history"], res["problem"]
    assert len(h) == 5 and h[-1] < 0.8 * h[0], h
    assert abs(prob.volume(res["xphys"]) / prob.total_volume - 0.5) < 1e-2
    assert abs(prob.total_volume - 3.0) < 1e-12
    xdmf = msh[:-len(".msh")] + ".xdmf"
    one = COMM.bcast(topo.main(["--mesh", xdmf] + argv, comm=MPI.COMM_SELF)["history"] if COMM.rank == 0
                     else None, root=0)
    np.testing.assert_allclose(h, one, rtol=1e-7)
    mesh = read_mesh(out, comm=COMM)
    dens = read_cell_data(out, mesh, "density")
    assert np.array_equal(np.sort(gather(dens)), np.sort(gather(res["xphys"])))
    # d compliance / dx in a direction, against central differences
    x = 0.5 + 0.3 * torch.sin(prob.mesh.original_cell_ids.to(torch.float64))
    d = torch.cos(3.0 * prob.mesh.original_cell_ids.to(torch.float64))
    xr = x.clone().requires_grad_(True)
    prob.compliance(xr).backward()
    g = float(slasolve.global_sum((xr.grad * d).sum(), COMM))
    eps = 1e-5
    with torch.no_grad():
        fd = (float(prob.compliance(x + eps * d)) - float(prob.compliance(x - eps * d))) / (2 * eps)
    assert abs(g - fd) <= 1e-5 * abs(fd), (g, fd)


# ----------------------------------------------------------------------------- hyperelastic inverse
hyper = load_example("hyperelastic_inverse")


def test_hyperelastic_inverse_check_mode():
    """--check: the objective falls by 10x and the recovered mu correlates with the truth."""
    out = hyper.main(["--check", "--quiet"])
    h = out["history"]
    assert all(np.isfinite(h)) and h[-1] <= 0.1 * h[0], h
    assert out["corr"] >= 0.6 and out["ok"]
    init_rel, _ = out["problem"].scores(torch.full_like(out["theta"], float(hyper.theta_of(torch.tensor(1.0)))))
    assert out["rel_error"] < init_rel


def test_hyperelastic_inverse_data_and_misfit_independent_of_rank_count():
    prob = hyper.HyperelasticProblem(8, 4, comm=COMM)
    ref = hyper.HyperelasticProblem(8, 4, comm=MPI.COMM_SELF)
    d0, d1 = prob.space.dof_range
    for d, r in zip(prob.data, ref.data):
        np.testing.assert_allclose(d.numpy(), r.numpy()[d0:d1], rtol=0, atol=1e-9)
    s, e = prob.cell_range
    th = torch.linspace(-0.3, 0.6, prob.n_cells, dtype=torch.float64)
    m, mr = float(prob.misfit(th[s:e])), float(ref.misfit(th))
    assert abs(m - mr) < 1e-7 * mr


def test_hyperelastic_inverse_gradient_matches_finite_differences():
    prob = hyper.HyperelasticProblem(6, 4, comm=COMM)
    s, e = prob.cell_range
    theta = (0.3 * torch.sin(torch.arange(prob.n_cells, dtype=torch.float64)) + 0.5).requires_grad_(True)
    prob.misfit(local_slice(theta, s, e, COMM)).backward()
    v = torch.cos(1.3 * torch.arange(prob.n_cells, dtype=torch.float64))
    h = 1e-5
    with torch.no_grad():
        fd = (prob.misfit((theta + h * v)[s:e]) - prob.misfit((theta - h * v)[s:e])) / (2 * h)
    ad = float(theta.grad @ v)
    assert abs(ad - float(fd)) <= 1e-5 * abs(float(fd)), (ad, float(fd))


def test_hyperelastic_inverse_on_a_mesh_file(shared_tmp):
    """--mesh FILE with tagged clamp / load facets (the gmsh cantilever written here): the
    objective falls, mu gets closer to the truth, the data and the misfit do not depend on the
    rank count, and --output .xdmf holds the recovered mu."""
    pytest.importorskip("h5py")  # the mesh and --output are XDMF + HDF5
    from slasolve.fem import read_cell_data, read_mesh
    msh = cantilever_msh(shared_tmp)
    out = os.path.join(shared_tmp, "mu.xdmf")
    res = hyper.main(["--mesh", msh, "--iters", "1", "--quiet", "--output", out], comm=COMM)
    h, prob = res["history"], res["problem"]
    assert prob.n_cells == 48 and len(h) == 2 and h[-1] < 0.5 * h[0], h
    init_rel, _ = prob.scores(torch.full_like(res["theta"], float(hyper.theta_of(torch.tensor(1.0)))))
    assert res["rel_error"] < init_rel
    mu = read_cell_data(out, read_mesh(out, comm=COMM), "mu")
    assert np.array_equal(gather(mu), gather(hyper.mu_of(res["theta"])))   # the file's cells: rank after rank
    xdmf = msh[:-len(".msh")] + ".xdmf"
    def theta(p):
        return 0.3 * torch.sin(p.mesh.original_cell_ids.to(torch.float64))

    def file_dofs(p):
        return (p.mesh.original_ids[p.mesh.owned_mask()].numpy()[:, None] * 2 + np.arange(2)).reshape(-1)
    ref = None
    if COMM.rank == 0:     # the one-rank run, once
        one = hyper.HyperelasticProblem(noise=0.002, comm=MPI.COMM_SELF, mesh_file=xdmf)
        data = np.empty((2, file_dofs(one).size))
        data[:, file_dofs(one)] = np.stack([d.numpy() for d in one.data])
        ref = (one.sigma, data, float(one.misfit(theta(one))))
    sigma, data, m2 = COMM.bcast(ref, root=0)
    assert abs(sigma - prob.sigma) <= 1e-9 * sigma
    for k in range(2):
        assert np.abs(prob.data[k].numpy() - data[k, file_dofs(prob)]).max() <= 1e-6 * sigma
    m1 = float(prob.misfit(theta(prob)))
    assert abs(m1 - m2) < 1e-6 * m2
