"""Overhead of the DTensor path of ``slasolve.solve`` per call (issue 23).

Run: ``mpirun -n 2 python bench/dtensor_overhead.py`` (``--nx`` 1000: 2-D Poisson with
1M unknowns; ``--quick``: 300).

Contenders, alternating in one run (the machine may be loaded: take the paired ratios):

* ``plain``: ``slasolve.solve(dA, b)`` with ``b`` this rank's rows (CG + GAMG, rtol 1e-8;
  the preconditioner is set up by the warm-up and reused, as in a training loop whose
  operator does not change between calls -- the case where a fixed overhead weighs most);
* ``dtensor``: the same solve with ``b`` a ``DTensor`` (``Shard(0)``) and ``x`` returned as
  one: the hook's argument scan, ``from_dtensor`` and ``to_dtensor`` (checks, row moves).

Two row layouts: ``even`` (PETSc's split equals DTensor's ``torch.chunk`` split: nothing
moves) and ``uneven`` (rank 0 owns 45 % of the rows: 5 % of the vector crosses between the
ranks on the way in and out). Also timed alone: the round trip ``from_dtensor`` +
``to_dtensor`` of one vector in each layout. The overhead is the median of the per-trial
differences ``dtensor - plain`` (same trial, back to back) and its ratio to ``plain``.
"""
from __future__ import annotations

import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COMM, RANK, SIZE, base_parser, compare, fmt_t, poisson2d_rows, rhs_local, rprint, \
    split_offsets, write_json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import slasolve  # noqa: E402
from slasolve import dtensor as sd  # noqa: E402
from slasolve.dsparse import DSparseTensor  # noqa: E402


def build(nx: int, offsets) -> DSparseTensor:
    """Collective. The 2-D Poisson row shard with the given ownership offsets."""
    r0, r1 = int(offsets[RANK]), int(offsets[RANK + 1])
    ip, ix, v = poisson2d_rows(nx, r0, r1)
    n = nx * nx
    return DSparseTensor.from_local_rows(torch.from_numpy(ip), torch.from_numpy(ix), torch.from_numpy(v), (n, n),
                                         COMM)


def uneven_offsets(n: int) -> np.ndarray:
    """Rank 0 owns 45 % of the rows, the others share the rest evenly (at 2 ranks: 5 % of
    the rows lie on the other side of DTensor's split)."""
    if SIZE == 1:
        return np.array([0, n], dtype=np.int64)
    first = int(0.45 * n) if SIZE == 2 else n // SIZE - n // (10 * SIZE)
    rest = split_offsets(n - first, SIZE - 1) + first
    return np.concatenate([[0], rest]).astype(np.int64)


def main() -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--nx", type=int, default=None, help="grid points per side (default 1000; --quick 300)")
    p.add_argument("--pc", default="gamg")
    p.add_argument("--rtol", type=float, default=1e-8)
    args = p.parse_args()
    nx = args.nx or (300 if args.quick else 1000)
    trials = args.trials or (3 if args.quick else 7)
    torch.set_num_threads(1)
    n = nx * nx
    mesh = sd.device_mesh(COMM)
    opts = dict(method="cg", pc=args.pc, rtol=args.rtol)
    rows = {}
    results = {}
    for name, offs in (("even", split_offsets(n, SIZE)), ("uneven", uneven_offsets(n))):
        dA = build(nx, offs)
        r0, r1 = dA.row_range
        b = rhs_local(r1 - r0, r0)
        bd = sd.to_dtensor(b, dA, mesh=mesh)
        moved = int(np.abs(np.asarray(offs) - sd.shard_offsets(n, SIZE)).max())   # same on every rank
        _, info = slasolve.solve(dA, b, return_info=True, **opts)
        res = compare({"plain": lambda: slasolve.solve(dA, b, **opts),
                       "dtensor": lambda: slasolve.solve(dA, bd, **opts),
                       "round_trip": lambda: sd.to_dtensor(sd.from_dtensor(bd, dA), dA, mesh=mesh)},
                      trials=trials, warmup=1)
        diffs = [d - q for d, q in zip(res["dtensor"]["samples"], res["plain"]["samples"])]
        over = statistics.median(diffs)
        plain = res["plain"]["median"]
        rows[name] = dict(plain=plain, dtensor=res["dtensor"]["median"], round_trip=res["round_trip"]["median"],
                          overhead=over, overhead_ratio=over / plain, rows_moved_max=moved,
                          round_trip_ratio=res["round_trip"]["median"] / plain,
                          iterations=info.iterations, paired_diffs=diffs)
        results[name] = res
    rprint(f"DTensor overhead of slasolve.solve, 2-D Poisson {nx}x{nx} = {n:,} unknowns, {SIZE} rank(s), "
           f"CG + {args.pc} rtol {args.rtol:g}, {trials} trials (medians; overhead = median of paired differences)")
    rprint(f"{'layout':>8} {'rows off split':>15} {'its':>4} {'plain':>10} {'dtensor':>10} {'overhead':>10} "
           f"{'ratio':>8} {'round trip':>11} {'ratio':>8}")
    for name, r in rows.items():
        rprint(f"{name:>8} {r['rows_moved_max']:>15,} {r['iterations']:>4} {fmt_t(r['plain']):>10} "
               f"{fmt_t(r['dtensor']):>10} {fmt_t(r['overhead']):>10} {100 * r['overhead_ratio']:>7.2f}% "
               f"{fmt_t(r['round_trip']):>11} {100 * r['round_trip_ratio']:>7.2f}%")
    write_json(args.json, {"nx": nx, "n": n, "size": SIZE, "pc": args.pc, "rtol": args.rtol, "trials": trials,
                           "rows": rows, "raw": results})


if __name__ == "__main__":
    main()
