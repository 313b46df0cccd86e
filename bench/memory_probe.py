"""Where a process's resident memory is, at named points: anonymous vs file-backed, per mapping,
the glibc heap (in use vs free but kept) and the modules imported since the last point.

Standard library only, so the same probe runs in slasolve's venv and in the peer venvs
(``bench/transient.py --compare`` and its dolfin-adjoint worker use it when
``SLASOLVE_BENCH_PROBE=PREFIX`` is set: each rank writes ``PREFIX.<contender>.rank<r>.json``;
``bench/memory_transient.py`` runs them and prints the tables).

At each ``mark(name)``:

* ``/proc/self/smaps_rollup``: ``Rss``, ``Anonymous`` (private memory: heap, thread arenas,
  anonymous ``mmap``), ``file`` = ``Rss - Anonymous`` (pages of shared libraries and other files:
  code and read-only data, shared between the processes that map them);
* ``/proc/self/status``: ``VmHWM`` (the peak RSS so far, what ``ru_maxrss`` reports);
* glibc ``mallinfo2()``: ``arena`` (the main heap's size), ``hblkhd`` (``mmap``-ed blocks),
  ``uordblks`` (in use) and ``fordblks`` (free, kept by the process);
* ``/proc/self/smaps``: ``Rss`` and ``Anonymous`` per mapping, grouped by file (``[heap]``,
  ``[anon]`` for unnamed mappings, ``[stack]``, each library's path);
* ``sys.modules``: how many modules, and which appeared since the previous mark.

Note (Debian's PETSc 3.18 build, both venvs): the SuperLU_DIST library's constructor calls
``mallopt(M_MMAP_MAX, 0)`` and ``mallopt(M_TRIM_THRESHOLD, -1)`` when PETSc is loaded, so
glibc never returns freed heap memory and never serves a large block by ``mmap``: every
allocation comes from the ``[heap]`` (``brk``) and RSS only grows. The state at the last mark
is then the peak's, and ``fordblks`` is memory freed but kept (temporaries, fragmentation).
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
import time

_KEYS = ("Rss", "Anonymous", "Pss")


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(k, ctypes.c_size_t) for k in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def _libc():
    try:
        lib = ctypes.CDLL("libc.so.6")
        lib.mallinfo2.restype = _Mallinfo2
        return lib
    except (OSError, AttributeError):
        return None


_LIBC = _libc()


def mallinfo_mib() -> dict:
    """Local. glibc's ``mallinfo2()`` of the main arena and ``mmap``-ed blocks, in MiB ({} if unavailable)."""
    if _LIBC is None:
        return {}
    m = _LIBC.mallinfo2()
    return {k: getattr(m, k) / 2 ** 20 for k in ("arena", "hblkhd", "uordblks", "fordblks")}


def rollup_mib() -> dict:
    """Local. ``Rss``, ``Anonymous``, ``Pss`` of ``/proc/self/smaps_rollup`` and ``file = Rss - Anonymous``, MiB."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in _KEYS:
                out[k] = int(v.split()[0]) / 1024.0
    out["file"] = out["Rss"] - out["Anonymous"]
    return out


def status_mib(key: str) -> float:
    """Local. A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ``RssAnon``, ...), MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def mappings_mib() -> dict:
    """Local. ``{name: [Rss, Anonymous]}`` in MiB per mapped file (``[anon]``: unnamed mappings)."""
    out: dict = {}
    name = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if len(head) >= 5 and "-" in head[0] and ":" not in head[0]:
                name = head[5].strip() if len(head) == 6 else "[anon]"
                out.setdefault(name, [0.0, 0.0])
            elif line.startswith("Rss:"):
                out[name][0] += int(line.split()[1]) / 1024.0
            elif line.startswith("Anonymous:"):
                out[name][1] += int(line.split()[1]) / 1024.0
    return out


class Probe:
    """Local. Memory at named points (see the module docstring); ``tracemalloc=True`` also records
    the Python-side allocations (and NumPy's data buffers, which NumPy reports to tracemalloc)."""

    def __init__(self, tracemalloc: bool = False) -> None:
        self.points: list = []
        self._modules = set(sys.modules)
        self._tm = tracemalloc
        if tracemalloc:
            import tracemalloc as tm
            tm.start(1)

    def mark(self, name: str) -> None:
        """Local. Record the memory now under ``name``."""
        mods = set(sys.modules)
        new = sorted(m for m in mods - self._modules if "." not in m or m.count(".") <= 1)
        self._modules = mods
        p = {"name": name, "time": time.perf_counter(), "rollup": rollup_mib(), "VmHWM": status_mib("VmHWM"),
             "VmRSS": status_mib("VmRSS"), "mallinfo": mallinfo_mib(), "mappings": mappings_mib(),
             "n_modules": len(mods), "new_modules": new}
        if self._tm:
            import tracemalloc as tm
            cur, peak = tm.get_traced_memory()
            p["tracemalloc"] = {"current": cur / 2 ** 20, "peak": peak / 2 ** 20}
            tm.reset_peak()
        self.points.append(p)

    def dump(self, path: str) -> None:
        """Local. Write the points as JSON."""
        with open(path, "w") as f:
            json.dump({"pid": os.getpid(), "points": self.points}, f)


def from_env(contender: str):
    """Local. A ``Probe`` and where to write it when ``SLASOLVE_BENCH_PROBE`` is set, else ``(None, None)``
    (the rank from the launcher's environment: called before MPI is imported)."""
    prefix = os.environ.get("SLASOLVE_BENCH_PROBE")
    if not prefix:
        return None, None
    rank = os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0"))
    return (Probe(tracemalloc=os.environ.get("SLASOLVE_BENCH_TRACEMALLOC") == "1"),
            f"{prefix}.{contender}.rank{rank}.json")
