"""DTensor interop (slasolve.dtensor): layouts and placements, DTensor in and out of the
products and solvers, gradients across the boundary (against the plain-tensor path and
central finite differences), and a DDP training step against a single-process reference.

Run serially and under mpirun -n 2 / 4 with --with-mpi.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import scipy.sparse.linalg as spla
import torch
from mpi4py import MPI

import slasolve
from slasolve import DSparseTensor, global_sum
from slasolve import dtensor as sd
from slasolve.testing import poisson_matrix

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():  # pragma: no cover
    pytest.skip("torch built without torch.distributed", allow_module_level=True)
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor  # noqa: E402

pytestmark = pytest.mark.mpi

COMM = MPI.COMM_WORLD
GRID = (6, 5)                      # 30 unknowns: uneven at 4 ranks, DTensor's split differs from PETSc's
EPS = torch.finfo(torch.float64).eps


@pytest.fixture(scope="module")
def mesh():
    return sd.device_mesh(COMM)


def grid_coords(grid=GRID):
    g = np.stack(np.meshgrid(*[np.arange(m) for m in grid], indexing="ij"), -1)
    return g.reshape(-1, len(grid)).astype(float)


def operator(partition="contiguous", nonsym=False, grid=GRID):
    A = poisson_matrix(grid).tocsr()
    if nonsym:
        A = (A + sp.diags([0.3], [1], shape=A.shape)).tocsr()
    coords = grid_coords(grid) if partition == "rcb" else None
    return A, DSparseTensor.from_global(A, COMM, partition=partition, coords=coords)


def global_field(n, k=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n,) if k is None else (n, k), generator=g, dtype=torch.float64)


def with_leaf_values(dA):
    v = dA.values.detach().clone().requires_grad_(True)
    return v, dA.with_values(v)


def assert_close(a, b, rtol=1e-12, what=""):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    scale = max(float(b.abs().max()), 1e-300)
    err = float((a - b).abs().max()) / scale
    assert err <= rtol, f"{what}: relative difference {err:.3e} > {rtol}"


# -- placements and layouts ----------------------------------------------------------------------

def test_placement_map():
    assert sd.to_torch_placement(slasolve.row_shard()) == Shard(0)
    assert sd.to_torch_placement(slasolve.row_shard(1), nbatch=1) == Shard(1)
    assert sd.to_torch_placement(slasolve.Replicated()) == Replicate()
    assert sd.to_torch_placement(slasolve.Shard(0), nbatch=1) == Shard(0)
    assert sd.from_torch_placement(Shard(0)) == slasolve.row_shard()
    assert sd.from_torch_placement(Shard(0), nbatch=1) == slasolve.Shard(0)
    assert sd.from_torch_placement(Shard(1), nbatch=1) == slasolve.row_shard(1)
    assert sd.from_torch_placement(Replicate()) == slasolve.Replicated()
    for p in (slasolve.col_shard(),):
        with pytest.raises(ValueError, match="column shard"):
            sd.to_torch_placement(p)
    with pytest.raises(ValueError, match="Partial"):
        sd.from_torch_placement(Partial())
    with pytest.raises(ValueError, match="after the rows"):
        sd.from_torch_placement(Shard(1))
    with pytest.raises(ValueError, match="batch"):
        sd.to_torch_placement(slasolve.Shard(1), nbatch=1)


def test_shard_offsets_match_dtensor(mesh):
    """shard_offsets is DTensor's own Shard(0) split (torch.distribute_tensor)."""
    for n in (0, 1, 5, 30, 31):
        full = torch.arange(float(n))
        local = distribute_tensor(full, mesh, [Shard(0)]).to_local()
        off = sd.shard_offsets(n, COMM.size)
        assert torch.equal(local, full[off[COMM.rank]:off[COMM.rank + 1]])


def test_device_mesh_cached_and_size_checked(mesh):
    assert sd.device_mesh(COMM) is mesh
    assert mesh.size() == COMM.size and list(mesh.get_coordinate()) == [COMM.rank]
    if COMM.size > 1:  # a communicator of another size than torch's world
        sub = COMM.Split(COMM.rank % 2, COMM.rank)
        with pytest.raises(ValueError, match="already initialised with a world of"):
            sd.device_mesh(sub)
        sub.Free()


@pytest.mark.parametrize("partition", ["contiguous", "rcb"])
@pytest.mark.parametrize("k", [None, 3])
def test_round_trip(mesh, partition, k):
    """to_dtensor / from_dtensor: the DTensor holds the vector in the user's numbering (what
    scatter/gather use), with DTensor's split; back to slasolve's rows exactly."""
    A, dA = operator(partition)
    xg = global_field(A.shape[0], k)
    x = dA.scatter(xg, root=None)
    d = sd.to_dtensor(x, dA)
    assert d.placements == (Shard(0),) and d.shape == xg.shape
    assert torch.equal(d.full_tensor(), xg)
    assert torch.equal(d.to_local(), xg[slice(*sd.shard_offsets(A.shape[0], COMM.size)[[COMM.rank, COMM.rank + 1]])])
    assert torch.equal(sd.from_dtensor(d, dA), x)
    r = sd.to_dtensor(x, dA, placement=Replicate())
    assert r.placements == (Replicate(),) and torch.equal(r.to_local(), xg)
    assert torch.equal(sd.from_dtensor(r, dA), x)
    p = DTensor.from_local(r.to_local() / COMM.size, mesh, [Partial()])   # sums to xg
    assert_close(sd.from_dtensor(p, dA), x, rtol=4 * EPS, what="Partial")
    # no operator: rows in rank order, DTensor's split on the way back
    d2 = sd.to_dtensor(x)
    assert torch.equal(d2.full_tensor(), torch.cat([t for t in COMM.allgather(x)]))


def test_bad_placements_raise_everywhere(mesh):
    A, dA = operator()
    xg = global_field(A.shape[0], 4)
    d = distribute_tensor(xg, mesh, [Shard(1)]) if COMM.size <= 4 else None
    with pytest.raises(ValueError, match="no slasolve counterpart"):
        sd.from_dtensor(d, dA)
    bad = dA.scatter(xg, root=None)
    if COMM.rank == 0:  # only rank 0's rows are wrong: ValueError on every rank
        bad = bad[:-1]
    with pytest.raises(ValueError, match="rows"):
        sd.to_dtensor(bad, dA)
    wrong = distribute_tensor(global_field(A.shape[0] + 1), mesh, [Shard(0)])
    with pytest.raises(ValueError, match="rows"):
        sd.from_dtensor(wrong, dA)
    with pytest.raises(TypeError):
        sd.from_dtensor(torch.zeros(3), dA)


# -- products ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("partition", ["contiguous", "rcb"])
def test_products_and_gradients(mesh, partition):
    """dA @ x and dA.T @ y with DTensors: values equal the plain path, gradients (values and x)
    equal to rounding of the final reduction."""
    A, dA = operator(partition, nonsym=True)
    n = A.shape[0]
    xg, wg = global_field(n, seed=1), global_field(n, seed=2)
    # plain path
    v, dAv = with_leaf_values(dA)
    x = dA.scatter(xg, root=None).requires_grad_(True)
    w = dA.scatter(wg, root=None)
    y = dAv @ x
    z = dAv.T @ (y * w)
    global_sum((z * z).sum()).backward()
    # DTensor path
    v2, dAv2 = with_leaf_values(dA)
    xd = distribute_tensor(xg, mesh, [Shard(0)]).requires_grad_(True)
    wd = distribute_tensor(wg, mesh, [Shard(0)])
    yd = dAv2 @ xd
    assert isinstance(yd, DTensor) and yd.placements == (Shard(0),)
    assert_close(yd.full_tensor(), torch.from_numpy(A @ xg.numpy()), rtol=8 * EPS, what="A x")
    zd = dAv2.T @ (yd * wd)
    assert isinstance(zd, DTensor)
    assert torch.equal(sd.from_dtensor(zd, dA), z.detach())
    (zd * zd).sum().full_tensor().backward()
    assert_close(v2.grad, v.grad, what="values grad")
    assert_close(sd.from_dtensor(xd.grad, dA), x.grad, what="x grad")
    # replicated input: replicated result
    yr = dA @ distribute_tensor(xg, mesh, [Replicate()])
    assert yr.placements == (Replicate(),)
    assert_close(yr.to_local(), torch.from_numpy(A @ xg.numpy()), rtol=8 * EPS)


def test_replicated_operator_product(mesh):
    A = poisson_matrix(GRID).tocsr()
    dR = DSparseTensor.from_global(A, COMM, placement=slasolve.Replicated())
    xg = global_field(A.shape[0])
    y = dR @ distribute_tensor(xg, mesh, [Shard(0)])
    assert y.placements == (Replicate(),)
    assert_close(y.to_local(), torch.from_numpy(A @ xg.numpy()), rtol=8 * EPS)


# -- solvers ---------------------------------------------------------------------------------------

def directional_fd(loss_of_b, bg, dirg, h=1e-3):
    return (loss_of_b(bg + h * dirg) - loss_of_b(bg - h * dirg)) / (2 * h)


SOLVERS = [
    pytest.param(dict(method="cg", backend="torch", pc="jacobi", rtol=1e-13), id="cg-torch"),
    pytest.param(dict(method="cg", backend="petsc", pc="gamg", rtol=1e-13), id="cg-gamg",
                 marks=pytest.mark.petsc),
    pytest.param("spsolve", id="spsolve-mumps", marks=pytest.mark.petsc),
    pytest.param("spsolve-scipy", id="spsolve-scipy",
                 marks=pytest.mark.skipif(COMM.size > 1, reason="SciPy's SuperLU runs on one rank")),
]


@pytest.mark.parametrize("how", SOLVERS)
def test_solve_dtensor(mesh, how):
    """solve / spsolve with a DTensor b: DTensor x; gradients (b and values) equal the plain
    path's and a central finite difference of the global loss."""
    A, dA = operator("rcb")
    n = A.shape[0]
    bg, cg_ = global_field(n, seed=3), global_field(n, seed=4)

    def run(dAv, b):
        if isinstance(how, str):
            return slasolve.spsolve(dAv, b, backend="scipy" if how == "spsolve-scipy" else None)
        return slasolve.solve(dAv, b, **how)

    v, dAv = with_leaf_values(dA)
    b = dA.scatter(bg, root=None).requires_grad_(True)
    c = dA.scatter(cg_, root=None)
    x = run(dAv, b)
    global_sum(((x - c) ** 2).sum()).backward()

    v2, dAv2 = with_leaf_values(dA)
    bd = distribute_tensor(bg, mesh, [Shard(0)]).requires_grad_(True)
    cd = distribute_tensor(cg_, mesh, [Shard(0)])
    xd = run(dAv2, bd)
    assert isinstance(xd, DTensor) and xd.placements == (Shard(0),)
    xref = spla.spsolve(A.tocsc(), bg.numpy())
    assert_close(xd.full_tensor(), torch.from_numpy(xref), rtol=1e-9, what="x")
    ((xd - cd) ** 2).sum().full_tensor().backward()
    # the adjoint solve is the same computation on both paths: equal to rounding of the reductions
    assert_close(v2.grad, v.grad, rtol=1e-12, what="values grad")
    assert_close(sd.from_dtensor(bd.grad, dA), b.grad, rtol=1e-12, what="b grad")

    # central differences along a global direction (quadratic loss: exact up to rounding,
    # |L| eps / h and the solver tolerance 1e-13 ||x|| / h)
    dirg = global_field(n, seed=5)

    def loss(bb):
        with torch.no_grad():
            xx = run(dA, distribute_tensor(bb, mesh, [Shard(0)]))
            return float(((xx - cd) ** 2).sum().full_tensor())
    fd = directional_fd(loss, bg, dirg)
    ad = float((bd.grad.full_tensor() * dirg).sum())
    assert abs(fd - ad) <= 1e-7 * max(abs(ad), 1.0), (fd, ad)


def test_solve_x0_block_and_replicated(mesh):
    A, dA = operator()
    n = A.shape[0]
    Bg = global_field(n, 2, seed=6)
    X = slasolve.solve(dA, distribute_tensor(Bg, mesh, [Replicate()]), backend="torch", rtol=1e-12,
                       x0=distribute_tensor(torch.zeros(n, 2), mesh, [Shard(0)]))
    assert X.placements == (Shard(0),)     # one sharded input: sharded result
    Xr = slasolve.solve(dA, distribute_tensor(Bg, mesh, [Replicate()]), backend="torch", rtol=1e-12)
    assert Xr.placements == (Replicate(),)
    ref = torch.from_numpy(spla.spsolve(A.tocsc(), Bg.numpy()))
    assert_close(X.full_tensor(), ref, rtol=1e-9)
    assert_close(Xr.to_local(), ref, rtol=1e-9)
    x, info = sd.solve(dA, dA.scatter(Bg[:, 0], root=None), backend="torch", rtol=1e-12, return_info=True)
    assert isinstance(x, DTensor) and info.converged


def test_eigsh_dtensor(mesh):
    """eigsh: Replicate() eigenvalues, Shard(0) eigenvectors; gradients equal the plain path."""
    A, dA = operator("rcb", grid=(4, 3))
    kw = dict(k=2, which="SA", backend="torch", tol=1e-12)
    v, dAv = with_leaf_values(dA)
    w, V = slasolve.eigsh(dAv, v0=torch.ones(dA.n_local), **kw)
    (w.sum() + global_sum((V ** 4).sum())).backward()
    v2, dAv2 = with_leaf_values(dA)
    # a DTensor starting vector makes the public eigsh return DTensors
    wd, Vd = slasolve.eigsh(dAv2, v0=distribute_tensor(torch.ones(A.shape[0]), mesh, [Shard(0)]), **kw)
    assert wd.placements == (Replicate(),) and Vd.placements == (Shard(0),)
    assert_close(wd.to_local(), w.detach(), rtol=1e-12)
    assert_close(sd.from_dtensor(Vd, dA), V.detach(), rtol=1e-10)
    ref = np.sort(np.linalg.eigvalsh(A.toarray()))[:2]
    assert_close(wd.to_local(), torch.from_numpy(ref), rtol=1e-10)
    (wd.sum() + (Vd ** 4).sum()).full_tensor().backward()
    assert_close(v2.grad, v.grad, rtol=1e-12, what="values grad")


def chunk_operator(A):
    """``A`` (SciPy CSR, on every rank) as a row shard in DTensor's own split (shard_offsets)."""
    off = sd.shard_offsets(A.shape[0], COMM.size)
    rows = A[off[COMM.rank]:off[COMM.rank + 1]]
    return DSparseTensor.from_local_rows(torch.from_numpy(rows.indptr).long(), torch.from_numpy(rows.indices).long(),
                                         torch.from_numpy(rows.data), A.shape, COMM)


@pytest.mark.parametrize("jacobian", [True, False])
def test_nonlinear_solve_dtensor(mesh, jacobian):
    """nonlinear_solve with a DTensor u0: the residual works on DTensors (a DSparseTensor
    product included); u and the gradient of a DTensor parameter equal the plain path's.
    With a Jacobian: an operator whose rows follow DTensor's split; without: JFNK and an
    operator in another (renumbered) layout."""
    if jacobian:
        A = poisson_matrix((5, 4)).tocsr()
        dA = chunk_operator(A)
        r0, r1 = dA.row_range
        indptr, cols, _ = dA.local_rows_csr()
        rows = torch.repeat_interleave(torch.arange(r0, r1), indptr[1:] - indptr[:-1])
        diag = torch.nonzero(cols == rows).flatten()

        def J(u, b):
            ul = u.to_local() if isinstance(u, DTensor) else u
            return dA.with_values(dA.values.index_add(0, diag, 3 * ul.detach() ** 2))
        kw = dict(backend="torch", rtol=1e-12, jacobian=J, linear_solver={"rtol": 1e-13})
    else:
        if COMM.size > 2:
            pytest.skip("the JFNK variant runs at 1 and 2 ranks (test-time budget)")
        A, dA = operator("rcb", grid=(4, 3))
        kw = dict(backend="torch", rtol=1e-9)
    n = A.shape[0]
    bg = global_field(n, seed=7)

    def F(u, b):
        return dA @ u + u ** 3 - b

    b = dA.scatter(bg, root=None).requires_grad_(True)
    u = slasolve.nonlinear_solve(F, torch.zeros_like(b), b, comm=COMM, **kw)
    global_sum((u ** 2).sum()).backward()

    bd = distribute_tensor(bg, mesh, [Shard(0)]).requires_grad_(True)
    ud = slasolve.nonlinear_solve(F, distribute_tensor(torch.zeros(n), mesh, [Shard(0)]), bd, **kw)
    assert isinstance(ud, DTensor) and ud.placements == (Shard(0),)
    tol = 1e-12 if jacobian else 1e-10   # JFNK: finite-difference products, step ~ sqrt(eps)
    assert_close(sd.from_dtensor(ud, dA), u.detach(), rtol=tol, what="u")
    (ud ** 2).sum().full_tensor().backward()
    assert_close(sd.from_dtensor(bd.grad, dA), b.grad, rtol=tol, what="b grad")
    if jacobian and COMM.size <= 2:  # central differences along a global direction (1-2 ranks: time budget):
        # O(h^2) truncation, eps / h rounding
        dirg = global_field(n, seed=9)

        def loss(bb):
            with torch.no_grad():
                uu = slasolve.nonlinear_solve(F, distribute_tensor(torch.zeros(n), mesh, [Shard(0)]),
                                              distribute_tensor(bb, mesh, [Shard(0)]), **kw)
                return float((uu ** 2).sum().full_tensor())
        fd = directional_fd(loss, bg, dirg, h=1e-4)
        ad = float((bd.grad.full_tensor() * dirg).sum())
        assert abs(fd - ad) <= 1e-6 * max(abs(ad), 1.0), (fd, ad)


# -- a distributed model ----------------------------------------------------------------------------

class Coefficient(torch.nn.Module):
    """Per-node right-hand side from node features: a tiny MLP (same seed everywhere)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(11)
        self.net = torch.nn.Sequential(torch.nn.Linear(2, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)

    def forward(self, feats):
        return self.net(feats).sum(-1)   # a new tensor (FSDP2 warns about views)


def model_loss(model, dA, feats_d, target_d):
    """Loss of a model whose output is a DTensor right-hand side; the solve in the middle."""
    b = DTensor.from_local(model(feats_d.to_local()), feats_d.device_mesh, [Shard(0)],
                           shape=target_d.shape, stride=target_d.stride())
    x = slasolve.solve(dA, b, backend="torch", rtol=1e-13)
    return ((x - target_d) ** 2).sum().full_tensor()


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_training_step_matches_single_process(mesh, wrap):
    """DDP, or FSDP2's fully_shard (parameters sharded over the mesh), over the ranks; each rank
    runs the model on its rows. After loss.backward() and an SGD step the parameter gradients
    and the parameters equal a single-process model's on the whole problem."""
    A, dA = operator("rcb")
    n = A.shape[0]
    feats = torch.from_numpy(grid_coords() / np.array(GRID, dtype=float))
    target = global_field(n, seed=8)
    feats_d = distribute_tensor(feats, mesh, [Shard(0)])
    target_d = distribute_tensor(target, mesh, [Shard(0)])
    model = Coefficient().double()
    if wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(model)
    else:
        from torch.distributed.fsdp import fully_shard
        fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # DDP and FSDP average the ranks' gradients; the loss is the global one on every rank and
    # each rank's backward gives its rows' share, so scale by the rank count to sum the shares
    (model_loss(model, dA, feats_d, target_d) * COMM.size).backward()
    grads = [p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad for p in model.parameters()]
    opt.step()
    params = [p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters()]
    ref = Coefficient().double()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dS = DSparseTensor.from_global(A, MPI.COMM_SELF)
    xs = slasolve.solve(dS, ref(feats), backend="torch", rtol=1e-13)
    ((xs - target) ** 2).sum().backward()
    ref_grads = [q.grad for q in ref.parameters()]
    ref_opt.step()
    for g, q, p, r in zip(grads, ref_grads, params, ref.parameters()):
        # the solves differ by CG's rounding at another rank count (rtol 1e-13 of x)
        assert_close(g, q, rtol=1e-11, what="parameter grad")
        assert_close(p, r, rtol=1e-12, what="parameter after the step")


def test_learned_closure_example():
    """examples/learned_closure.py --check: FSDP2 training through the DTensor solve, loss
    history equal (1e-6) to the one-process plain-tensor run, and decreasing."""
    from example_loader import load_example
    mod = load_example("learned_closure")
    out = mod.main(["--n", "6", "--iters", "4", "--check", "--quiet", "--backend", "torch"])
    assert len(out["history"]) == 5 and out["history"][-1] < out["history"][0]


def test_column_shard_product_raises(mesh):
    A = poisson_matrix(GRID).tocsr()
    dC = DSparseTensor.from_global(A, COMM, placement=slasolve.col_shard())
    with pytest.raises(ValueError, match="not supported"):
        dC @ distribute_tensor(global_field(A.shape[0]), mesh, [Shard(0)])


def test_replicated_rhs_gradient(mesh):
    """A replicated DTensor b: x replicated, and b's gradient (each rank's own rows, summed
    over the ranks) equals the plain path's global gradient."""
    A, dA = operator("rcb")
    n = A.shape[0]
    bg = global_field(n, seed=10)
    b = dA.scatter(bg, root=None).requires_grad_(True)
    x = slasolve.solve(dA, b, backend="torch", rtol=1e-13)
    global_sum((x ** 3).sum()).backward()
    ref = dA.gather(b.grad, root=None)
    bd = distribute_tensor(bg, mesh, [Replicate()]).requires_grad_(True)
    xd = slasolve.solve(dA, bd, backend="torch", rtol=1e-13)
    assert xd.placements == (Replicate(),)
    (xd ** 3).sum().full_tensor().backward()
    assert_close(bd.grad.full_tensor(), ref, rtol=1e-12, what="replicated b grad")


def test_foreign_mesh(mesh):
    """A 1-D mesh made by torch's init_device_mesh over every rank (MPI rank order) works too."""
    from torch.distributed.device_mesh import init_device_mesh
    other = init_device_mesh("cpu", (COMM.size,))
    A, dA = operator()
    xg = global_field(A.shape[0], seed=12)
    d = sd.to_dtensor(dA.scatter(xg, root=None), dA, mesh=other)
    assert d.device_mesh is other and torch.equal(d.full_tensor(), xg)
