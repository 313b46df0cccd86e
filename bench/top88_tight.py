"""top88's MBB beam at rtol 1e-12: slasolve's defaults against the PETSc KSP a DOLFINx user gets.

Run (1 and 2 ranks):

    python bench/top88_tight.py
    mpirun -n 2 python bench/top88_tight.py

The SIMP plane-stress MBB beam of ``examples/topology_optimisation.py`` (top88's load case,
``E_min = 1e-9``, ``slasolve.testing.simp_mbb_system``) on ``nelx x nely`` quads, two
designs: ``holes`` (density 1e-3 in elliptic holes, 1 elsewhere, as
``tests/test_tight_tolerance.py``) and ``graded`` (a smooth density between 1e-3 and 1).
CG + GAMG at ``rtol = 1e-12``, the tolerance users set when they want sensitivities to
many digits, where float64 cannot reach ``||b - A x|| <= rtol ||b||`` on SIMP matrices
(``||A|| ||x||`` is 1e4-1e5 times ``||b||``).

* **slasolve**: ``solve(K, f, "cg", pc="gamg", rtol=1e-12, return_info=True)``: converges, or is
  accepted at the normwise backward-error floor ``4 eps (||A||_inf ||x|| + ||b||)``
  (``info.floor``), or raises.
* **KSP as DOLFINx**: a petsc4py KSP on the same matrix configured as DOLFINx's
  ``LinearProblem`` does (``ksp_type cg``, ``pc_type gamg``, ``ksp_rtol 1e-12`` through the
  options database, ``setFromOptions``): PETSc's defaults, the *preconditioned* residual norm,
  ``max_it`` 10000.
* **KSP same test**: the same with ``ksp_norm_type unpreconditioned``, the test slasolve's
  ``rtol`` means.

Each trial refills the matrix with new values (the design scaled by ``1 + 1e-6 t``: a new
operator for every contender, as in an optimisation loop), contenders alternated. Printed:
the outcome (converged / reason), CG iterations, time, and the errors of the compliance
``f^T u`` and of the true relative residual against SciPy's sparse direct solve of the same
system on every rank (``COMM_SELF``).
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, SIZE, base_parser, fmt_t, rprint, stats, timed_call, write_json  # noqa: E402

import numpy as np  # noqa: E402
import scipy.sparse.linalg as ssl  # noqa: E402
import torch  # noqa: E402
from mpi4py import MPI  # noqa: E402

import slasolve  # noqa: E402
from slasolve.petsc import PETSc  # noqa: E402
from slasolve.testing import simp_mbb_system  # noqa: E402

RTOL = 1e-12


def density(c: torch.Tensor, design: str) -> torch.Tensor:
    if design == "holes":
        holes = torch.sin(c[:, 0] / 6.0) * torch.sin(c[:, 1] / 5.0) > 0.3
        return torch.where(holes, torch.full_like(c[:, 0], 1e-3), torch.ones_like(c[:, 0])).to(torch.float64)
    g = 0.5 + 0.5 * torch.sin(c[:, 0] / 7.0) * torch.cos(c[:, 1] / 4.0)
    return g.clamp(1e-3, 1.0).to(torch.float64)


def reference(nelx: int, nely: int, design: str, scale: float):
    """Every rank: (f^T u, ||f||) of SciPy's direct solve of the whole system (COMM_SELF)."""
    system, mesh = simp_mbb_system(MPI.COMM_SELF, nelx, nely)
    K, f = system(density(mesh.local_cell_coords().mean(1), design) * scale)
    u = ssl.spsolve(K.local.to_scipy().tocsc(), f.numpy())
    return float(f.numpy() @ u)


class RawKSP:
    def __init__(self, comm, unpreconditioned: bool):
        self.comm, self.unprec = comm, unpreconditioned
        self.prefix = f"top88_{'unprec' if unpreconditioned else 'dolfinx'}_"

    def solve(self, K, f):
        A = K.to_petsc(mat_type="aij").duplicate(copy=True)
        ksp = PETSc.KSP().create(self.comm)
        ksp.setOperators(A)
        ksp.setOptionsPrefix(self.prefix)
        opts = PETSc.Options()
        entries = {"ksp_type": "cg", "pc_type": "gamg", "ksp_rtol": RTOL}
        if self.unprec:
            entries["ksp_norm_type"] = "unpreconditioned"
        for k, v in entries.items():
            opts[self.prefix + k] = v
        ksp.setFromOptions()
        for k in entries:
            opts.delValue(self.prefix + k)
        b = A.createVecLeft()
        b.getArray()[:] = f.numpy()
        x = A.createVecRight()
        ksp.solve(b, x)
        reason, its = ksp.getConvergedReason(), ksp.getIterationNumber()
        u = torch.from_numpy(x.getArray().copy())
        for o in (ksp, A, b, x):
            o.destroy()
        return u, reason >= 0, _reason_name(reason), its


def _reason_name(code: int) -> str:
    names = {v: k for k, v in vars(PETSc.KSP.ConvergedReason).items() if isinstance(v, int)}
    return names.get(code, str(code))


def check(K, f, u, c_ref: float):
    """Collective. (relative compliance error, true relative residual)."""
    r = f - K @ u
    s = COMM.allreduce(np.array([float(r @ r), float(f @ f), float(f @ u)]), op=MPI.SUM)
    return abs(s[2] - c_ref) / abs(c_ref), float(np.sqrt(s[0] / s[1]))


def run_case(nelx: int, nely: int, design: str, trials: int) -> dict:
    system, mesh = simp_mbb_system(COMM, nelx, nely)
    rho = density(mesh.local_cell_coords().mean(1), design)
    raw, raw_same = RawKSP(COMM, False), RawKSP(COMM, True)
    out = {"nelx": nelx, "nely": nely, "design": design, "ranks": SIZE, "rtol": RTOL, "contenders": {}}
    res = {}

    def sla(K, f):
        try:
            u, info = slasolve.solve(K, f, "cg", pc="gamg", rtol=RTOL, return_info=True)
        except slasolve.ConvergenceError as e:
            return None, False, f"raised {e.info.reason}", e.info.iterations, None
        fl = None if info.floor is None else info.floor
        return u, True, info.reason, info.iterations, fl

    calls = {"slasolve": sla, "KSP as DOLFINx": lambda K, f: raw.solve(K, f) + (None,),
             "KSP same test": lambda K, f: raw_same.solve(K, f) + (None,)}
    samples = {k: [] for k in calls}
    for t in range(trials + 1):   # trial 0: warm-up
        K, f = system(rho * (1.0 + 1e-6 * t))
        for name in (list(calls) if t % 2 == 0 else list(calls)[::-1]):
            r, dt = timed_call(lambda: calls[name](K, f), COMM)
            if t > 0:
                samples[name].append(dt)
            res[name] = (K, f, r)
    c_ref = reference(nelx, nely, design, 1.0 + 1e-6 * trials)
    fn = float(np.sqrt(COMM.allreduce(float(res["slasolve"][1] @ res["slasolve"][1]), op=MPI.SUM)))
    for name, (K, f, (u, ok, reason, its, floor)) in res.items():
        e_c, rr = check(K, f, u, c_ref) if u is not None else (None, None)
        out["contenders"][name] = {"time": stats(samples[name]), "converged": ok, "reason": reason,
                                   "iterations": its, "floor/||b||": None if floor is None else floor / fn,
                                   "rel error compliance": e_c, "true rel residual": rr}
    return out


def main(argv=None):
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="*", default=None, help="nelx x nely pairs, e.g. 120x40 300x100")
    args = p.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in (args.sizes or (["120x40"] if args.quick
                                                                           else ["120x40", "300x100"]))]
    trials = args.trials or (2 if args.quick else 3)
    rprint(f"top88 MBB beam, CG + GAMG at rtol {RTOL:g}, {SIZE} rank(s), {trials} trials (median time)")
    out = {"rtol": RTOL, "cases": []}
    for nelx, nely in sizes:
        for design in ("holes", "graded"):
            r = run_case(nelx, nely, design, trials)
            out["cases"].append(r)
            rprint(f"{nelx}x{nely} {design}:")
            t_sla = r["contenders"]["slasolve"]["time"]["median"]
            for name, c in r["contenders"].items():
                floor = "" if c["floor/||b||"] is None else f", accepted at floor {c['floor/||b||']:.1e} ||b||"
                errs = "" if c["rel error compliance"] is None else \
                    f", compliance err {c['rel error compliance']:.0e}, true rel residual {c['true rel residual']:.1e}"
                rprint(f"  {name:>15}: {c['reason']} after {c['iterations']} its{floor}, "
                       f"{fmt_t(c['time']['median'])} (slasolve / this {t_sla / c['time']['median']:.2f}){errs}")
    write_json(args.json or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                         f"top88_tight_n{SIZE}.json"), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
