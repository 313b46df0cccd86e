"""Call-history properties: cached state never changes an answer (docs/testing.md).

Hypothesis draws a random sequence of calls on ONE operator: solves (random backend,
method, preconditioner, maxiter, x0, rtol, petsc_options, with or without a backward
pass), eigsh (random backend, k, which) and value mutations by every path a user has
(an in-place op, a write through ``.data``, a write through a NumPy view, ``.data``
reassignment, ``with_values``, a ``torch.optim`` step). After every call the result
must equal the same call on a FRESH operator built from the current values (no cached
Mat, KSP, options or split values), to round-off. Generic complement of
tests/test_call_history.py.
"""
import numpy as np
import pytest
import scipy.sparse as sp
import torch
from hypothesis import strategies as st

import slasolve
from slasolve import DSparseTensor
from slasolve.testing import case_matrix, collective_property, distribute_or_none

pytestmark = [pytest.mark.mpi, pytest.mark.property]

KINDS = ("spd", "grid2d", "block2", "separated")
PARTITIONS = ("contiguous", "metis", "random")
MUTATIONS = ("inplace", "data", "numpy", "data_assign", "with_values", "optim")
PETSC_OPTIONS = (None, {"ksp_max_it": 3}, {"ksp_gmres_restart": 4}, {"pc_jacobi_type": "rowsum"},
                 {"ksp_rtol": 0.5})


def _solve_op():
    return st.fixed_dictionaries({
        "op": st.just("solve"), "backend": st.sampled_from(("petsc", "torch")),
        "method": st.sampled_from(("cg", "minres", "gmres", "bicgstab")),
        "pc": st.sampled_from(("none", "jacobi", "ilu")),
        "maxiter": st.sampled_from((None, None, 1, 2, 5)),
        "x0": st.sampled_from(("none", "random")), "rtol": st.sampled_from((1e-10, 1e-6, 1e-3, 1.5)),
        "petsc_options": st.sampled_from(PETSC_OPTIONS), "grad": st.booleans(),
        "seed": st.integers(0, 1000)})


def _eig_op():
    return st.fixed_dictionaries({
        "op": st.just("eigsh"), "backend": st.sampled_from(("slepc", "torch")),
        "k": st.integers(1, 4), "which": st.sampled_from(("LA", "SA", "LM", "SM"))})


def _mutate_op():
    return st.fixed_dictionaries({
        "op": st.just("mutate"), "path": st.sampled_from(MUTATIONS),
        "scale": st.sampled_from((0.5, 2.0, 1.0)), "shift": st.sampled_from((0.25, 1.0, 3.0))})


@st.composite
def histories(draw):
    ops = draw(st.lists(st.one_of(_solve_op(), _mutate_op(), _eig_op()), min_size=2, max_size=8))
    ops.append(draw(_solve_op()))  # end with a call, so the last mutation is looked at
    return {"kind": draw(st.sampled_from(KINDS)), "n": draw(st.integers(8, 30)),
            "seed": draw(st.integers(0, 2 ** 16)), "partition": draw(st.sampled_from(PARTITIONS)),
            "ops": ops}


# ------------------------------------------------------------------------ the calls
def _diag_mask(dA):
    """Local values that sit on the scalar diagonal (for ``A + shift I``)."""
    loc = dA.local
    br, bc = loc.block_shape if loc.block_shape else (1, 1)
    rows = loc.row_indices() + dA.row_range[0] // br  # row_range counts scalar rows
    on = (rows == loc.indices)
    if not loc.block_shape:
        return on.to(dA.dtype)
    eye = torch.eye(br, bc, dtype=dA.dtype)
    return on.to(dA.dtype)[:, None, None] * eye


def _mutate(dA, op):
    """Set the values to ``scale * values + shift * (diagonal)`` by the path ``op["path"]``;
    returns the (possibly new) operator."""
    v = dA.values
    new = (op["scale"] * v.detach() + op["shift"] * _diag_mask(dA)).clone()
    path = op["path"]
    if path == "inplace":
        with torch.no_grad():
            v.mul_(op["scale"]).add_(op["shift"] * _diag_mask(dA))
    elif path == "data":
        v.data.copy_(new)
    elif path == "numpy":
        v.detach().numpy()[...] = new.numpy()
    elif path == "data_assign":
        v.data = new
    elif path == "with_values":
        dA = dA.with_values(new)
    elif path == "optim":
        # the step lands exactly on ``new`` (0 - 1 * (-new)): the fresh operator must hold the same
        # bits, since iteration counts and reasons are compared exactly (p - (p - new) can be an
        # ulp off ``new``, and a count compared exactly may then flip where a residual sits at rtol)
        p = torch.zeros_like(v.detach()).requires_grad_()
        dA = dA.with_values(p)
        opt = torch.optim.SGD([p], lr=1.0)
        p.grad = -new
        opt.step()
    return dA


def _solve(dA, A, op, comm):
    n = A.shape[0]
    rng = np.random.default_rng(op["seed"])
    b = dA.scatter(torch.from_numpy(rng.standard_normal(n)), root=None)
    x0 = None if op["x0"] == "none" else dA.scatter(torch.from_numpy(rng.standard_normal(n)), root=None)
    pc = op["pc"] if not (op["method"] == "minres" and op["backend"] == "petsc") else "none"
    kw = dict(backend=op["backend"], pc=pc, maxiter=op["maxiter"], rtol=op["rtol"], x0=x0,
              petsc_options=op["petsc_options"] if op["backend"] == "petsc" else None,
              return_info=True, raise_on_fail=False)
    if not op["grad"]:
        with torch.no_grad():
            x, info = slasolve.solve(dA, b, op["method"], **kw)
        return dA.gather(x, root=None), info, None
    p = dA.values.detach().clone().requires_grad_()
    bb = b.clone().requires_grad_()
    x, info = slasolve.solve(dA.with_values(p), bb, op["method"], **kw)
    wts = dA.scatter(torch.from_numpy(rng.uniform(-1, 1, n)), root=None)
    grads = None
    if info.converged:
        slasolve.global_sum((x * wts).sum()).backward()
        grads = (torch.cat(comm.allgather(p.grad.reshape(-1))), dA.gather(bb.grad, root=None))
    return dA.gather(x.detach(), root=None), info, grads


def _eigsh(dA, op):
    w, V = slasolve.eigsh(dA, op["k"], which=op["which"], backend=op["backend"], tol=1e-12)
    return w, dA.gather(V, root=None)


def _fresh(A_now, comm, dA):
    part = dA.spec.partition
    return DSparseTensor.from_global(A_now, comm, partition="contiguous" if part is None else part)


def _close(a, b, what, rtol=1e-8):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    d = float((a - b).abs().max()) if a.numel() else 0.0
    s = float(b.abs().max()) if b.numel() else 0.0
    assert d <= rtol * max(s, 1e-300) + 1e-13, f"{what}: differs from a fresh operator's by {d:.3e} (scale {s:.3e})"


def _compare(dA, A_now, comm, op, step):
    fresh = _fresh(A_now, comm, dA)
    where = f"call {step} {op}"
    if op["op"] == "solve":
        x, info, g = _solve(dA, A_now, op, comm)
        xf, infof, gf = _solve(fresh, A_now, op, comm)
        assert (info.converged, info.reason, info.iterations) == (infof.converged, infof.reason, infof.iterations), \
            f"{where}: {info.summary()} but a fresh operator gives {infof.summary()}"
        _close(x, xf, f"{where}: x")
        if g is not None and gf is not None:
            _close(g[0], gf[0], f"{where}: dL/dvalues")
            _close(g[1], gf[1], f"{where}: dL/db")
    else:
        w, V = _eigsh(dA, op)
        wf, Vf = _eigsh(fresh, op)
        _close(w, wf, f"{where}: eigenvalues")


def _check_history(comm, ex):
    A, coords, _ = case_matrix(ex["kind"], ex["n"], ex["seed"])
    dA = distribute_or_none(A, comm, ex["partition"], coords, ex["seed"])
    if dA is None:
        return  # the partitioner left a rank without rows (raised on every rank)
    A_now = A.copy()
    for step, op in enumerate(ex["ops"]):
        if op["op"] == "mutate":
            dA = _mutate(dA, op)
            A_now = (op["scale"] * A_now + op["shift"] * sp.identity(A.shape[0])).tocsr()
            if hasattr(A, "blocksize"):
                A_now = A_now.tobsr(blocksize=A.blocksize)
            continue
        if op["op"] == "eigsh" and op["backend"] == "torch" and op["which"] == "SM" and dA.block_shape:
            op = dict(op, which="SA")  # documented refusal: torch "SM" is shift-invert, scalar matrices only
        _compare(dA, A_now, comm, op, step)


def _known_histories():
    """Always run: a value change through ``.data`` (and each other path) between two
    equal solves on each backend; maxiter and x0 of one solve leaking into the next."""
    solve = {"op": "solve", "backend": "petsc", "method": "cg", "pc": "none", "maxiter": None, "x0": "none",
             "rtol": 1e-10, "petsc_options": None, "grad": False, "seed": 0}
    out = []
    for backend in ("petsc", "torch"):
        s = dict(solve, backend=backend)
        out.append({"kind": "block2", "n": 8, "seed": 0, "partition": "contiguous",
                    "ops": [s] + [op for path in MUTATIONS
                                  for op in ({"op": "mutate", "path": path, "scale": 0.5, "shift": 0.25}, s)]})
        out.append({"kind": "spd", "n": 20, "seed": 0, "partition": "contiguous",
                    "ops": [dict(s, maxiter=1), s, dict(s, x0="random", maxiter=2, method="bicgstab"),
                            dict(s, method="bicgstab")]})
    return out


def test_call_history_never_changes_answers(comm):
    collective_property(comm, histories(), lambda ex: _check_history(comm, ex),
                        name="call_history", examples=12, full_examples=300, explicit=_known_histories())
