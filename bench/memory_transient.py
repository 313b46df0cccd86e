"""Where the memory of ``bench/transient.py --compare`` goes, slasolve against dolfin-adjoint:
RSS by kind after the imports, the set-up, the warm-up, the forward and the backward.

Run (not under mpirun): ``python bench/memory_transient.py [--ranks 1 2] [--n 64] [--steps 100]
[--snapshots 10] [--baseline ROOT] [--no-peer] [--json out.json]`` (``--baseline``: the same
worker importing another checkout's slasolve, e.g. ``/work/main``: before / after a change).
It runs ``transient.py``'s two workers (slasolve with ``--snapshots`` snapshots, and
dolfin-adjoint in its venv when there is one) with ``SLASOLVE_BENCH_PROBE`` set, so each rank
records its memory at each phase (``bench/memory_probe.py``), and prints, per rank count, MiB
(the largest over the ranks):

* after the imports: RSS, anonymous, file-backed;
* from the imports to the end of the backward (the peak: the heap is never trimmed): the
  anonymous growth split into the glibc heap's bytes in use, its bytes free but kept
  (temporaries, fragmentation) and the other anonymous mappings; the file-backed growth
  (library pages first touched), the largest libraries named;
* the anonymous and file-backed growth of each phase.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)


def _phase_rows(points: list) -> dict:
    """Local. The items of one rank's probe (MiB)."""
    by = {p["name"]: p for p in points}
    imp, end = by["imports"], points[-1]
    out = {"imports: RSS": imp["rollup"]["Rss"], "imports: anonymous": imp["rollup"]["Anonymous"],
           "imports: file-backed": imp["rollup"]["file"],
           "peak RSS (VmHWM)": end["VmHWM"], "RSS at the end": end["rollup"]["Rss"]}
    d_anon = end["rollup"]["Anonymous"] - imp["rollup"]["Anonymous"]
    d_file = end["rollup"]["file"] - imp["rollup"]["file"]
    mi0, mi1 = imp["mallinfo"], end["mallinfo"]
    heap_grown = (mi1["arena"] + mi1["hblkhd"]) - (mi0["arena"] + mi0["hblkhd"])
    out["over imports: RSS"] = end["rollup"]["Rss"] - imp["rollup"]["Rss"]
    out["over imports: anonymous"] = d_anon
    out["  heap in use (live)"] = mi1["uordblks"] + mi1["hblkhd"] - mi0["uordblks"] - mi0["hblkhd"]
    out["  heap free, kept by glibc"] = mi1["fordblks"] - mi0["fordblks"]
    out["  other anonymous (pymalloc, stacks; - untouched heap)"] = d_anon - heap_grown
    out["over imports: file-backed"] = d_file
    libs = []
    for k, (rss, anon) in end["mappings"].items():
        r0, a0 = imp["mappings"].get(k, [0.0, 0.0])
        libs.append(((rss - anon) - (r0 - a0), k))
    libs.sort(reverse=True)
    for dv, k in libs[:3]:
        if dv >= 0.5:
            out[f"  file: {os.path.basename(k)}"] = dv
    prev = imp
    for p in points[points.index(imp) + 1:]:
        out[f"phase {p['name']}: anonymous"] = p["rollup"]["Anonymous"] - prev["rollup"]["Anonymous"]
        out[f"phase {p['name']}: file-backed"] = p["rollup"]["file"] - prev["rollup"]["file"]
        prev = p
    out["new modules after the imports"] = sum(len(p["new_modules"]) for p in points[points.index(imp) + 1:])
    return out


def run(a) -> dict:
    """Local. The probes of both contenders at each rank count."""
    from transient import PEER_PYTHON, PEER_WORKER, peer_available
    why = peer_available()
    if why:
        print(f"dolfin-adjoint skipped: {why}", flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    out = {"n": a.n, "steps": a.steps, "snapshots": a.snapshots, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for ranks in a.ranks:
            cmds = {"slasolve": ([sys.executable, os.path.join(HERE, "transient.py"), "--compare-worker", str(a.n),
                                  str(a.steps), str(a.snapshots), "0.5", "0.1", "0", "source"], env)}
            if a.baseline:
                cmds["baseline"] = (cmds["slasolve"][0], dict(env, PYTHONPATH=a.baseline + os.pathsep +
                                                              os.environ.get("PYTHONPATH", "")))
            if not why and not a.no_peer:
                cmds["dolfin-adjoint"] = ([PEER_PYTHON, PEER_WORKER, str(a.n), str(a.steps), "0.5", "0.1"],
                                          dict(env, PYTHONPATH=""))
            res = {}
            for name, (cmd, e) in cmds.items():
                prefix = os.path.join(tmp, f"p{ranks}")
                if ranks > 1:
                    cmd = ["timeout", "1800", "mpirun", "-n", str(ranks), "--oversubscribe", "--bind-to", "none"] + \
                          (["--allow-run-as-root"] if os.geteuid() == 0 else []) + cmd
                subprocess.run(cmd, env=dict(e, SLASOLVE_BENCH_PROBE=prefix), check=True, capture_output=True)
                files = sorted(glob.glob(f"{prefix}.*.json"))
                rows = [_phase_rows(json.load(open(f))["points"]) for f in files]
                for f in files:
                    os.remove(f)
                res[name] = {k: max(r[k] for r in rows) for k in rows[0] if all(k in r for r in rows)}
                res[name]["per_rank"] = rows
            out["runs"][ranks] = res
            _print(ranks, res, a)
    return out


def _print(ranks: int, res: dict, a) -> None:
    names = list(res)
    print(f"\n{ranks} rank(s), n = {a.n}, {a.steps} steps, slasolve {a.snapshots} snapshots; MiB, max over ranks")
    print(f"{'item':<56}" + "".join(f"{n:>16}" for n in names))
    keys = []
    for n in names:
        keys += [k for k in res[n] if k != "per_rank" and k not in keys]
    for k in keys:
        print(f"{k:<56}" + "".join(f"{res[n][k]:16.1f}" if k in res[n] else f"{'-':>16}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--n", type=int, default=64)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--snapshots", type=int, default=10)
    ap.add_argument("--baseline", default=None, metavar="ROOT", help="also another checkout's slasolve")
    ap.add_argument("--no-peer", action="store_true", help="without dolfin-adjoint")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    out = run(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
