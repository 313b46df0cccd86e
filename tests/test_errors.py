"""Collective error semantics (README "MPI", docs/decisions.md).

Each bad input is given on ONE rank only (the last one); EVERY rank must raise
(``pytest.raises`` on all ranks) and nothing may hang. Afterwards the
communicator must still work (checked by the next collective in each test).
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

from slasolve import DSparseTensor, HaloPlan
from slasolve.testing import poisson_matrix, random_matrix

pytestmark = pytest.mark.mpi


def bad_rank(comm):
    return comm.size - 1


def local_rows(comm, A):
    """This rank's rows of A (PETSc split) as (indptr, indices, values, shape)."""
    n = A.shape[0]
    counts = np.full(comm.size, n // comm.size)
    counts[: n % comm.size] += 1
    offs = np.concatenate([[0], np.cumsum(counts)])
    B = A[offs[comm.rank]:offs[comm.rank + 1]]
    return B.indptr.copy(), B.indices.copy(), torch.from_numpy(B.data.copy()), A.shape


def still_alive(comm):
    assert comm.allreduce(1) == comm.size


def needs_two(comm):
    if comm.size < 2:
        pytest.skip("needs >= 2 ranks: the inputs can only disagree across ranks")


A_SMALL = poisson_matrix((6, 5))


def _mutate(comm, kind):
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    kw = {}
    if comm.rank == bad_rank(comm):
        if kind == "values_len":
            v = v[:-1]
        elif kind == "indptr_2d":
            ip = ip.reshape(1, -1)
        elif kind == "indptr_end":
            ip = ip.copy()
            ip[-1] += 1
        elif kind == "int_values":
            v = v.to(torch.int64)
        elif kind == "bool_indices":
            ix = ix.astype(bool)
        elif kind == "float_indices":
            ix = ix.astype(np.float64)
        elif kind == "nan":
            v = v.clone()
            v[0] = float("nan")
        elif kind == "inf":
            v = v.clone()
            v[-1] = -float("inf")
        elif kind == "neg_col":
            ix = ix.copy()
            ix[0] = -1
        elif kind == "big_col":
            ix = ix.copy()
            ix[-1] = shape[1]
        elif kind == "shape_len":
            shape = (shape[0], shape[1], 1)
        elif kind == "blocked_values":
            v = v.reshape(-1, 1, 1)
    return ip, ix, v, shape, kw


@pytest.mark.parametrize("kind, exc, match", [
    ("values_len", ValueError, "values"),
    ("indptr_2d", ValueError, "indptr"),
    ("indptr_end", ValueError, "indptr"),
    ("int_values", TypeError, "floating point"),
    ("bool_indices", TypeError, "indices"),
    ("float_indices", TypeError, "indices"),
    ("nan", ValueError, "NaN or Inf"),
    ("inf", ValueError, "NaN or Inf"),
    ("neg_col", ValueError, "negative"),
    ("big_col", ValueError, "out of range"),
    ("shape_len", ValueError, "global_shape"),
    ("blocked_values", ValueError, "values"),
])
def test_from_local_rows_bad_input_on_one_rank(comm, kind, exc, match):
    ip, ix, v, shape, kw = _mutate(comm, kind)
    with pytest.raises(exc, match=match):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm, **kw)
    still_alive(comm)


def test_mismatched_dtype_across_ranks(comm):
    needs_two(comm)
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    if comm.rank == bad_rank(comm):
        v = v.float()
    with pytest.raises(TypeError, match="dtype differs"):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm)
    still_alive(comm)


def test_mismatched_global_shape(comm):
    needs_two(comm)
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    if comm.rank == bad_rank(comm):
        shape = (shape[0] + 1, shape[1] + 1)
    with pytest.raises(ValueError, match="global_shape differs"):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm)
    still_alive(comm)


def test_local_rows_do_not_add_up(comm):
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    if comm.rank == bad_rank(comm):  # one row too few
        ip, ix, v = ip[:-1], ix[: ip[-2]], v[: ip[-2]]
    with pytest.raises(ValueError, match="add up to"):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm)
    still_alive(comm)


def test_n_local_cols_on_one_rank_only(comm):
    needs_two(comm)
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    kw = {"n_local_cols": len(ip) - 1} if comm.rank == bad_rank(comm) else {}
    with pytest.raises(ValueError, match="n_local_cols"):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm, **kw)
    still_alive(comm)


def test_n_local_cols_wrong_sum(comm):
    ip, ix, v, shape = local_rows(comm, A_SMALL)
    n = len(ip) - 1 + (1 if comm.rank == bad_rank(comm) else 0)
    with pytest.raises(ValueError, match="n_local_cols"):
        DSparseTensor.from_local_rows(ip, ix, v, shape, comm, n_local_cols=n)
    still_alive(comm)


# -- from_global ---------------------------------------------------------------------
def test_bad_partition_name(comm):
    A = random_matrix(20, seed=1)
    with pytest.raises(ValueError, match="method"):
        DSparseTensor.from_global(A if comm.rank == 0 else None, comm, partition="nope")
    # given on the root only: the ranks disagree (or, on one rank, the name is bad)
    part = "nope" if comm.rank == 0 else "contiguous"
    with pytest.raises(ValueError, match="method|differ: partition"):
        DSparseTensor.from_global(A, comm, partition=part)
    still_alive(comm)


def test_geometric_partition_without_coords(comm):
    A = random_matrix(20, seed=1)
    with pytest.raises(ValueError, match="coords"):
        DSparseTensor.from_global(A if comm.rank == 0 else None, comm, partition="rcb")
    with pytest.raises(ValueError, match="coords"):
        DSparseTensor.from_global(A if comm.rank == 0 else None, comm, partition="hilbert",
                                  coords=np.zeros((3, 2)))
    still_alive(comm)


def test_from_global_bad_matrix_on_root(comm):
    with pytest.raises(ValueError, match="A is None"):
        DSparseTensor.from_global(None, comm)
    with pytest.raises(TypeError, match="A must be"):
        DSparseTensor.from_global(np.eye(3) if comm.rank == 0 else None, comm)
    A = random_matrix(20, seed=1).tolil()
    A[3, 4] = np.nan
    with pytest.raises(ValueError, match="NaN"):
        DSparseTensor.from_global(A.tocsr() if comm.rank == 0 else None, comm)
    still_alive(comm)


# -- with_values, gather, products ------------------------------------------------------
@pytest.fixture
def dA(comm):
    return DSparseTensor.from_global(A_SMALL, comm)


@pytest.mark.parametrize("kind, exc, match", [
    ("nan", ValueError, "NaN"),
    ("short", ValueError, "shape"),
    ("int", TypeError, "floating point"),
])
def test_with_values_bad_on_one_rank(comm, dA, kind, exc, match):
    v = dA.values.clone()
    if comm.rank == bad_rank(comm):
        v = {"nan": lambda: v.index_fill(0, torch.tensor([0]), float("nan")),
             "short": lambda: v[:-1],
             "int": lambda: v.to(torch.int32)}[kind]()
    with pytest.raises(exc, match=match):
        dA.with_values(v)
    still_alive(comm)


def test_gather_bad_on_one_rank(comm, dA):
    x = torch.zeros(dA.n_local + (1 if comm.rank == bad_rank(comm) else 0))
    with pytest.raises(ValueError, match="owned rows"):
        dA.gather(x, root=0)
    still_alive(comm)


def test_scatter_bad_on_root(comm, dA):
    with pytest.raises(ValueError, match="x_global must have shape"):
        dA.scatter(torch.zeros(3) if comm.rank == 0 else None, root=0)
    with pytest.raises(TypeError, match="x_global"):
        dA.scatter(None, root=0)
    still_alive(comm)


def test_matvec_bad_x_is_a_local_error(comm, dA):
    """matvec/rmatvec check x locally (free: no communication per call), before any
    message is posted: every rank that passes a bad x raises at once. (A bad x on
    only some ranks is a caller bug that cannot be detected without an Allreduce
    per product, so it is not tested here.)"""
    with pytest.raises(ValueError, match="owned rows"):
        dA @ torch.zeros(dA.n_local + 1)
    with pytest.raises(ValueError, match="owned rows"):
        dA.T @ torch.zeros(dA.n_local, 2, 2)
    with pytest.raises(TypeError, match="dtype"):
        dA @ torch.zeros(dA.n_local, dtype=torch.float32)
    with pytest.raises(TypeError, match="torch.Tensor"):
        dA @ np.zeros(dA.n_local)
    # nothing was left in flight: the next product works
    y = dA @ torch.ones(dA.n_local)
    assert comm.allreduce(float(y.sum())) == pytest.approx(A_SMALL.sum())


# -- halo plan ----------------------------------------------------------------------------
def test_halo_plan_bad_ghosts_on_one_rank(comm):
    n = 10 * comm.size
    s, e = 10 * comm.rank, 10 * comm.rank + 10
    good = [i for i in (s - 1, e) if 0 <= i < n]
    for bad in ([s] + good, [n], sorted(good, reverse=True) if len(good) == 2 else [-1], [-1]):
        ghosts = bad if comm.rank == bad_rank(comm) else good
        with pytest.raises(ValueError, match="ghost_ids"):
            HaloPlan(comm, (s, e), np.asarray(ghosts, dtype=np.int64))
    still_alive(comm)


def test_halo_plan_bad_range_on_one_rank(comm):
    s, e = 10 * comm.rank, 10 * comm.rank + 10
    if comm.rank == bad_rank(comm):
        s += 1
    with pytest.raises(ValueError, match="owned_range"):
        HaloPlan(comm, (s, e), np.zeros(0, dtype=np.int64), offsets=np.arange(comm.size + 1) * 10)
    still_alive(comm)


def test_check_collective_keeps_builtin_types(comm):
    from slasolve._comm import check_collective
    err = KeyError("boom") if comm.rank == bad_rank(comm) else None
    with pytest.raises(KeyError, match="boom"):
        check_collective(comm, err)
    err = ZeroDivisionError("zero") if comm.rank == 0 else None
    with pytest.raises(ZeroDivisionError, match="zero"):
        check_collective(comm, err)
    still_alive(comm)


def test_allreduce_int_matches_mpi4py(comm):
    """The buffer reduction that replaced mpi4py's pickled allreduce on the hot paths."""
    from mpi4py import MPI
    from slasolve._comm import allreduce_int
    for op in (MPI.SUM, MPI.MAX, MPI.MIN):
        mine = 7 * comm.rank - 3 + (2 ** 40 if comm.rank == comm.size - 1 else 0)
        got = allreduce_int(comm, mine, op)
        assert type(got) is int and got == comm.allreduce(mine, op=op)


# -- fem meshes ---------------------------------------------------------------------------
@pytest.mark.parametrize("kw, exc, match", [
    (dict(n=(4, 0)), ValueError, "n must be positive"),
    (dict(cell="prism"), ValueError, "cell must be one of"),
    (dict(upper=(1.0, float("nan"))), ValueError, "finite lower < upper"),
    (dict(dtype=torch.int64), TypeError, "dtype"),
    (dict(n="abc"), TypeError, "n must be an int or a sequence"),
])
def test_box_mesh_bad_on_one_rank(comm, kw, exc, match):
    from slasolve.fem import box_mesh
    args = dict(n=(4, 2 * comm.size), cell="triangle", comm=comm)
    if comm.rank == bad_rank(comm):
        args.update(kw)
    with pytest.raises(exc, match=match):
        box_mesh(**args)
    still_alive(comm)


def test_box_mesh_different_on_one_rank(comm):
    """Valid on every rank, but not the same box: every rank raises, naming the argument."""
    from slasolve.fem import box_mesh
    needs_two(comm)
    n = (4 if comm.rank != bad_rank(comm) else 5, 2 * comm.size)
    with pytest.raises(ValueError, match="differ: n"):
        box_mesh(n, cell="quad", comm=comm)
    still_alive(comm)


def test_read_mesh_bad_args_on_one_rank(comm, tmp_path):
    from slasolve.fem import read_mesh
    path = str(tmp_path / "never_read.vtu")   # validation comes before any file access
    with pytest.raises(TypeError, match="dtype"):
        read_mesh(path, comm=comm, dtype=torch.int32 if comm.rank == bad_rank(comm) else torch.float64)
    if comm.size > 1:
        with pytest.raises(ValueError, match="partition"):
            read_mesh(path, comm=comm, partition="rcb" if comm.rank == bad_rank(comm) else "metis")
    still_alive(comm)


def test_write_mesh_mode_differs_on_one_rank(comm, tmp_path):
    """gather=True on one rank only (or another path) would mismatch the collectives of the
    two modes: every rank raises instead, before anything is written."""
    from slasolve.fem import box_mesh, write_mesh
    needs_two(comm)
    mesh = box_mesh((3, 2 * comm.size), cell="quad", comm=comm)
    path = str(tmp_path / "out.pvtu")    # per-rank directories: nothing may be written anyway
    with pytest.raises(ValueError, match="differ"):
        write_mesh(path, mesh, gather=comm.rank == bad_rank(comm))
    assert not (tmp_path / "out.pvtu").exists() and list(tmp_path.iterdir()) == []
    still_alive(comm)


@pytest.mark.parametrize("kw, match", [
    (dict(problem="heat"), "problem must be"),
    (dict(dim=4), "dim must be 2 or 3"),
    (dict(cell="tetra"), "not a 2-D cell"),
])
def test_manufactured_solve_bad_on_one_rank(comm, kw, match):
    from slasolve.fem import manufactured_solve
    args = dict(problem="poisson", n=2 * comm.size, dim=2, comm=comm, pc="jacobi")
    if comm.rank == bad_rank(comm):
        args.update(kw)
    with pytest.raises(ValueError, match=match):
        manufactured_solve(**args)
    still_alive(comm)


def test_assemble_manufactured_bad_problem_on_one_rank(comm):
    from slasolve.fem import box_mesh
    from slasolve.fem.problems import assemble_manufactured
    mesh = box_mesh((3, 2 * comm.size), cell="triangle", comm=comm)
    with pytest.raises(ValueError, match="problem"):
        assemble_manufactured("heat" if comm.rank == bad_rank(comm) else "poisson", mesh)
    still_alive(comm)
