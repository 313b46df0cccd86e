"""The Newton kernels' tangent skips its forward halo exchange where every rank's owned dofs are
those of the latest residual (``NonlinearProblem._np_tangent_checked``): the values must equal a
fresh evaluation's bit for bit whichever ranks changed their dofs, and errors found from stale
ghost values must not be raised when the evaluation is redone."""
import numpy as np
import pytest
import torch

from nl_problems import diffusion, solid

pytestmark = pytest.mark.mpi


def _all(comm, flag) -> bool:
    return bool(comm.allreduce(int(bool(flag)), op=__import__("mpi4py").MPI.MIN))


def _fresh_tangent(P, x):
    """The tangent values of a new kernel pair (no memo: the exchange is always made)."""
    return P.iterate_kernels(P.residual, P.jacobian, ())[1](x)


@pytest.mark.parametrize("make", ["diffusion", "solid"])
def test_tangent_after_residual_whichever_ranks_moved(comm, make):
    sp, P = diffusion(comm) if make == "diffusion" else solid(comm, 0.05)
    res, tan = P.iterate_kernels(P.residual, P.jacobian, ())
    n = sp.zeros().shape[0]
    rng = np.random.default_rng(3 + comm.rank)
    x0 = 0.01 * rng.random(n)
    out = np.empty(n)
    # after a residual at x0: the tangent at x0 (nobody moved), then at points where only rank r moved
    res(x0, out)
    assert _all(comm, np.array_equal(tan(x0), _fresh_tangent(P, x0)))
    for r in range(comm.size):
        x1 = x0 + (0.01 * rng.random(n) if comm.rank == r else 0.0)
        res(x0, out)
        assert _all(comm, np.array_equal(tan(x1), _fresh_tangent(P, x1)))
    # twice at the same point, then at the residual's point again
    res(x0, out)
    t = tan(x0)
    assert _all(comm, np.array_equal(tan(x0), t) and np.array_equal(t, _fresh_tangent(P, x0)))


def test_stale_ghost_errors_are_not_raised(comm):
    """The latest residual was at a point whose values on the last rank overflow the tangent; the
    tangent at a point where only that rank moved back is finite, though its neighbours' first
    attempt (with the kept ghost values) was not."""
    sp, P = diffusion(comm)
    res, tan = P.iterate_kernels(P.residual, P.jacobian, ())
    n = sp.zeros().shape[0]
    x1 = np.full(n, 0.1)
    x0 = np.full(n, 1e160) if comm.rank == comm.size - 1 else x1.copy()
    with np.errstate(all="ignore"):
        res(x0, np.empty(n))
        got = tan(x1)
    assert _all(comm, np.array_equal(got, _fresh_tangent(P, x1)))
    # a real overflow still raises on every rank
    with np.errstate(all="ignore"):
        res(x1, np.empty(n))
        with pytest.raises(ValueError, match="NaN or infinite|rank"):
            tan(x0)
    assert _all(comm, np.array_equal(tan(x1), _fresh_tangent(P, x1)))
