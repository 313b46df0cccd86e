"""Wall time of the 1000-step gradient check of ``tests/test_timestepping_long.py`` with a chosen direct backend.

``mpirun -n 2 python bench/transient_long_case.py scipy|petsc`` (PYTHONPATH picks the checkout): full
storage and 5 snapshots (checkpointed == full storage is printed as their largest relative difference), and
the Taylor test with the checkpointed gradient, as the test runs them; prints one ``LONG {json}`` line on
rank 0 with the seconds, the per-phase seconds (full storage forward, backward; 5 snapshots forward,
backward) and the Taylor rate. ``scipy`` on several ranks: SuperLU on every rank of the gathered step
matrix (``LinearTimeProblem``'s redundant path); ``petsc``: MUMPS.
"""
import sys, time, json, torch, scipy.sparse as sp
from mpi4py import MPI
import slasolve
from slasolve.testing import taylor_test
from slasolve.timestepping import LinearTimeProblem, integrate
COMM = MPI.COMM_WORLD
backend = sys.argv[1]
torch.set_num_threads(1)
n = 12
K = (sp.diags([-1.0, 2.0, -1.0], [-1, 0, 1], shape=(n, n)) * (n + 1) ** 2).tocsr()
M = sp.diags([1 / 6, 2 / 3, 1 / 6], [-1, 0, 1], shape=(n, n)).tocsr()
dM, dK = slasolve.DSparseTensor.from_global(M, COMM), slasolve.DSparseTensor.from_global(K, COMM)
r0, r1 = dK.row_range
x = torch.linspace(0, 1, n + 2, dtype=torch.float64)[1:-1][r0:r1]
allsum = lambda t: slasolve.global_sum(t, COMM)
n_steps = 1000; dt = 0.1 / n_steps
u0, q, Kv = torch.cos(2 * x), torch.sin(3 * x), dK.values.clone()
def loss(u0, q, Kv, **kw):
    P = LinearTimeProblem(dM, dK.with_values(Kv), lambda t, q: q * (1.0 + t), scheme="cn", method="direct", backend=backend)
    mid, end = integrate(P, u0, q, dt=dt, n_steps=n_steps, outputs=[n_steps // 2, n_steps], **kw)
    return allsum((end ** 2).sum() + (mid * x).sum())
COMM.Barrier(); t = time.perf_counter()
grads = {}
ph = []
for kw in ({}, {"checkpoints": 5}):
    leaves = [t_.clone().requires_grad_(True) for t_ in (u0, q, Kv)]
    COMM.Barrier(); a = time.perf_counter()
    J_ = loss(*leaves, **kw)
    COMM.Barrier(); b = time.perf_counter()
    J_.backward()
    COMM.Barrier(); c = time.perf_counter(); ph += [round(b - a, 2), round(c - b, 2)]
    grads[repr(kw)] = torch.cat([t_.grad for t_ in leaves])
full, ck = grads["{}"], grads[repr({"checkpoints": 5})]
err = float(allsum((ck - full).abs().max())) / float(allsum(full.abs().max()))
g = torch.Generator().manual_seed(COMM.rank)
d = [torch.randn(u0.shape, generator=g, dtype=torch.float64), torch.randn(q.shape, generator=g, dtype=torch.float64), 10 * torch.randn(Kv.shape, generator=g, dtype=torch.float64)]
n0, nq = u0.shape[0], q.shape[0]
dJdm = float(allsum((ck[:n0] * d[0]).sum() + (ck[n0:n0 + nq] * d[1]).sum() + (ck[n0 + nq:] * d[2]).sum()))
r = taylor_test(loss, [u0, q, Kv], d, dJdm=dJdm, steps=2)
COMM.Barrier(); t = time.perf_counter() - t
if COMM.rank == 0:
    print("LONG " + json.dumps({"slasolve": slasolve.__file__.rsplit("/slasolve/", 1)[0], "ranks": COMM.size, "backend": backend, "seconds": t, "ckpt_vs_full": err, "taylor_rate": r.rate, "phases": ph}), flush=True)
