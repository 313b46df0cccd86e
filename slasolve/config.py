"""What this slasolve install is made of, and whether it works: ``python -m slasolve``.

:func:`~slasolve.config.config_info` collects, and :func:`~slasolve.show_config` prints:

* versions: slasolve, Python, torch, NumPy, SciPy, mpi4py, petsc4py, slepc4py;
* MPI: the library mpi4py loaded (vendor, version string), ``COMM_WORLD``'s size and rank;
* PETSc / SLEPc: found or not, version, scalar and index types, the configured external
  packages that matter to slasolve (MUMPS, hypre, ML, SuperLU, ...);
* torch: build (CPU / CUDA version), the devices it sees and its threads (set by
  ``import slasolve`` under ``mpirun``: ``slasolve/_threads.py``);
* the solver backends, preconditioners and eigensolvers that are available here, the
  partitioners, and the optional packages (pymetis, meshio, matplotlib).

``problems`` lists what is broken: mpi4py that cannot load an MPI library, petsc4py or
slepc4py installed but failing to import (slasolve would otherwise fall back to the torch
backend without a word), an ``mpiexec`` from another MPI than mpi4py's (every process
is rank 0 of 1). ``python -m slasolve`` exits with status 1 when there are problems.

An install whose mpi4py cannot load MPI, or whose petsc4py cannot load PETSc, fails at
``import slasolve`` itself; :func:`~slasolve.config.import_failed` (called there) turns the error into an
``ImportError`` that says what to do, and under ``python -m slasolve`` prints the report
(what can be known without importing slasolve) and exits with status 1.

Nothing here imports mpi4py, petsc4py or torch at module level.
"""
from __future__ import annotations

import importlib
import importlib.metadata as _md
import importlib.util
import os
import platform
import sys
from typing import Any, Dict, List, Optional, TextIO

__all__ = ["config_info", "show_config", "format_config", "import_failed"]

#: packages whose versions are reported (import name -> distribution name)
CORE = {"torch": "torch", "numpy": "numpy", "scipy": "scipy", "mpi4py": "mpi4py", "petsc4py": "petsc4py",
        "slepc4py": "slepc4py"}
#: optional packages and what they enable
OPTIONAL = {"pymetis": "partition='metis'", "meshio": "slasolve.fem.read_mesh (meshio formats)",
            "matplotlib": "plots in the examples and the notebook"}
#: PETSc external packages worth knowing about (``PETSc.Sys.hasExternalPackage``)
PETSC_EXTERNAL = ("mumps", "hypre", "ml", "superlu", "superlu_dist", "suitesparse", "scalapack", "metis",
                  "parmetis", "ptscotch", "hdf5", "cuda", "hip", "kokkos")

_MPI_HINT = ("mpi4py needs an MPI library. Without a system MPI: `pip install \"slasolve[mpi]\"` (the "
             "mpich wheel, for mpi4py>=4's wheels); with a system or cluster MPI: load the site's MPI "
             "module before Python starts (mpi4py>=4 wheels: MPI4PY_LIBMPI=/path/to/libmpi.so names the "
             "library), or build mpi4py against it: `pip install --no-binary mpi4py --force-reinstall "
             "mpi4py` (uses the mpicc on PATH).")
_PETSC_HINT = ("petsc4py is installed but does not load: it must match the PETSc library it was built "
               "against (and the NumPy it was compiled with, e.g. NumPy 1.x for Debian's petsc4py). Fix "
               "it, or uninstall petsc4py/slepc4py to use the torch backend only.")


# --------------------------------------------------------------------------- helpers
def _dist_version(dist: str) -> Optional[str]:
    try:
        return _md.version(dist)
    except _md.PackageNotFoundError:
        return None
    except Exception:  # noqa: BLE001 - a broken metadata directory
        return None


def _present(module: str) -> bool:
    """Whether ``module`` can be found (without importing it); False when ``sys.modules``
    holds None for it (how tests hide a package)."""
    if module in sys.modules:
        return sys.modules[module] is not None
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _error(exc: BaseException) -> str:
    """``Type: message`` on one line (mpi4py puts the library it tried on the second line)."""
    text = "; ".join(line.strip() for line in str(exc).strip().splitlines()[:3] if line.strip())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _module_version(module: str) -> Optional[str]:
    """The version a package reports when imported (if already imported), else its
    distribution's metadata."""
    mod = sys.modules.get(module)
    v = getattr(mod, "__version__", None) if mod is not None else None
    return str(v) if v is not None else _dist_version(CORE.get(module, module))


def _launcher_size() -> Optional[int]:
    """The process count an ``mpiexec`` announced in the environment (Open MPI, MPICH/Hydra,
    Intel MPI), or None when not started by one."""
    for var in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        value = os.environ.get(var, "").strip()
        if value.isdigit():
            return int(value)
    return None


# --------------------------------------------------------------------------- sections
def _mpi_info(problems: List[str]) -> Dict[str, Any]:
    info: Dict[str, Any] = {"ok": False}
    if not _present("mpi4py"):
        problems.append("mpi4py is not installed (`pip install mpi4py`; see README)")
        return info
    try:
        from mpi4py import MPI
    except Exception as e:  # noqa: BLE001 - mpi4py cannot load its MPI library
        info["error"] = _error(e)
        problems.append(f"mpi4py cannot load an MPI library ({info['error']}). {_MPI_HINT}")
        return info
    comm = MPI.COMM_WORLD
    info.update(ok=True, size=comm.Get_size(), rank=comm.Get_rank(),
                library=" ".join(MPI.Get_library_version().strip().splitlines()[0].split()),
                standard="%d.%d" % MPI.Get_version())
    try:
        name, ver = MPI.get_vendor()
        info["vendor"] = f"{name} {'.'.join(map(str, ver))}"
    except Exception:  # noqa: BLE001
        info["vendor"] = "unknown"
    launched = _launcher_size()
    info["launcher_size"] = launched
    if launched is not None and launched != info["size"]:
        problems.append(f"started by an mpiexec for {launched} processes, but mpi4py's MPI "
                        f"({info['vendor']}) sees COMM_WORLD of size {info['size']}: the mpiexec belongs to "
                        f"another MPI than the one mpi4py loaded. Use the matching mpiexec (pip-only: the "
                        f"environment's bin/mpiexec from the mpich wheel).")
    return info


def _petsc_info(problems: List[str]) -> Dict[str, Any]:
    info: Dict[str, Any] = {"found": _present("petsc4py"), "ok": False}
    if not info["found"]:
        return info
    try:
        import petsc4py
        from petsc4py import PETSc
    except Exception as e:  # noqa: BLE001 - installed, does not load
        info["error"] = _error(e)
        problems.append(f"petsc4py is installed but fails to import ({info['error']}). {_PETSC_HINT}")
        return info
    info.update(ok=True, version="%d.%d.%d" % PETSc.Sys.getVersion(),
                scalar=PETSc.ScalarType.__name__, index_bits=8 * PETSc.IntType(0).itemsize)
    try:
        cfg = petsc4py.get_config()
        info["dir"] = cfg.get("PETSC_DIR", "")
        info["arch"] = cfg.get("PETSC_ARCH", "")
    except Exception:  # noqa: BLE001
        pass
    has = getattr(PETSc.Sys, "hasExternalPackage", None)
    if has is not None:
        found = []
        for pkg in PETSC_EXTERNAL:
            try:
                if has(pkg):
                    found.append(pkg)
            except Exception:  # noqa: BLE001 - a name this PETSc does not know
                pass
        info["external"] = found
    return info


def _slepc_info(problems: List[str], petsc_ok: bool) -> Dict[str, Any]:
    info: Dict[str, Any] = {"found": _present("slepc4py"), "ok": False}
    if not info["found"]:
        return info
    if not petsc_ok:
        info["error"] = "petsc4py does not load"
        return info
    try:
        from slepc4py import SLEPc
    except Exception as e:  # noqa: BLE001
        info["error"] = _error(e)
        problems.append(f"slepc4py is installed but fails to import ({info['error']}); it must match "
                        f"petsc4py's PETSc and its SLEPc library (or uninstall it to use the torch "
                        f"eigensolvers).")
        return info
    info.update(ok=True, version="%d.%d.%d" % SLEPc.Sys.getVersion()[:3])
    return info


def _torch_info(problems: List[str]) -> Dict[str, Any]:
    info: Dict[str, Any] = {"ok": False, "devices": ["cpu"]}
    try:
        import torch
    except Exception as e:  # noqa: BLE001
        info["error"] = _error(e)
        problems.append(f"torch does not import ({info['error']})")
        return info
    info.update(ok=True, version=torch.__version__, build=("CUDA " + torch.version.cuda) if torch.version.cuda
                else ("ROCm " + torch.version.hip) if getattr(torch.version, "hip", None) else "CPU")
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        if info["cuda_available"]:
            info["devices"] += [f"cuda:{i} ({torch.cuda.get_device_name(i)})" for i in range(torch.cuda.device_count())]
    except Exception as e:  # noqa: BLE001 - a CUDA build on a machine whose driver is broken
        info["cuda_available"] = False
        info["cuda_error"] = _error(e)
    mps = getattr(getattr(torch, "backends", None), "mps", None)
    if mps is not None and getattr(mps, "is_available", lambda: False)():
        info["devices"].append("mps")
    from ._threads import torch_threads_note
    info["threads"] = torch.get_num_threads()
    info["threads_set_by_slasolve"] = torch_threads_note()
    return info


def _torch_pc_factor(petsc_ok: bool) -> str:
    if petsc_ok:
        return "ILU(0)/IC(0) by PETSc"
    return "exact local LU by SciPy's SuperLU (no petsc4py)"


def config_info() -> Dict[str, Any]:
    """Local. The configuration of this install as a dict (see the module docstring): keys
    ``slasolve``, ``python``, ``platform``, ``versions``, ``mpi``, ``petsc``, ``slepc``,
    ``torch``, ``backends``, ``preconditioners``, ``eigensolvers``, ``partitioners``,
    ``optional``, ``problems`` (empty when the install works). Never raises for a broken
    install: what is broken goes to ``problems``."""
    problems: List[str] = []
    slasolve = sys.modules.get("slasolve")
    info: Dict[str, Any] = {
        "slasolve": {"version": getattr(slasolve, "__version__", None) or _dist_version("slasolve"),
                     "path": os.path.dirname(os.path.abspath(getattr(slasolve, "__file__", __file__)))},
        "python": {"version": platform.python_version(), "executable": sys.executable,
                   "venv": sys.prefix != getattr(sys, "base_prefix", sys.prefix)},
        "platform": platform.platform(),
    }
    info["mpi"] = _mpi_info(problems)
    info["petsc"] = _petsc_info(problems)
    info["slepc"] = _slepc_info(problems, info["petsc"]["ok"])
    info["torch"] = _torch_info(problems)
    info["versions"] = {m: _module_version(m) for m in CORE}
    petsc_ok, slepc_ok = info["petsc"]["ok"], info["slepc"]["ok"]
    info["backends"] = {"petsc": petsc_ok, "torch": info["torch"]["ok"]}
    info["default_backend"] = "petsc" if petsc_ok else "torch"
    from .registry import KRYLOV_METHODS, PRECONDITIONERS   # imports neither torch nor PETSc
    pcs: Dict[str, List[str]] = {"torch": [p.name for p in PRECONDITIONERS.values() if p.torch] + ["callable"]}
    if petsc_ok:
        ext = set(info["petsc"].get("external", ()))

        def here(p):    # the external package it needs, if any, is in this PETSc
            return p.petsc_type is not None and (p.hypre_type is None or "hypre" in ext) and \
                (p.factor_solver is None or p.factor_solver in ext)
        pcs["petsc"] = [p.name for p in PRECONDITIONERS.values() if here(p)] + ["callable"]
    info["preconditioners"] = pcs
    info["krylov_methods"] = {"petsc": list(KRYLOV_METHODS) if petsc_ok else [],
                              "torch": [m.name for m in KRYLOV_METHODS.values() if m.torch_kernel]}
    info["torch_ilu"] = _torch_pc_factor(petsc_ok)
    info["eigensolvers"] = (["slepc"] if slepc_ok else []) + ["torch (lobpcg, lanczos)"]
    info["optional"] = {m: _dist_version(m) for m in OPTIONAL}
    info["partitioners"] = ["contiguous"] + (["metis"] if info["optional"]["pymetis"] else []) + ["rcb", "hilbert"]
    info["problems"] = problems
    return info


def format_config(info: Dict[str, Any]) -> str:
    """Local. The text :func:`~slasolve.show_config` prints for ``info`` (a dict from
    :func:`~slasolve.config.config_info`)."""
    v = info["versions"]
    lines = [f"slasolve {info['slasolve']['version']}  ({info['slasolve']['path']})",
             f"python   {info['python']['version']}  ({info['python']['executable']}"
             f"{', venv' if info['python']['venv'] else ''})",
             f"platform {info['platform']}", "", "packages:"]
    for m in CORE:
        lines.append(f"  {m:<10} {v.get(m) or 'not installed'}")
    mpi = info["mpi"]
    lines.append("")
    if mpi.get("ok"):
        lines.append(f"MPI:      {mpi['library']}")
        lines.append(f"          vendor {mpi['vendor']}, MPI standard {mpi['standard']}, "
                     f"COMM_WORLD size {mpi['size']} (this is rank {mpi['rank']})")
    else:
        lines.append(f"MPI:      BROKEN ({mpi.get('error', 'mpi4py not installed')})")
    p = info["petsc"]
    if p.get("ok"):
        where = f", PETSC_DIR={p['dir']}" if p.get("dir") else ""
        where += f", PETSC_ARCH={p['arch']}" if p.get("arch") else ""
        lines.append(f"PETSc:    {p['version']} ({p['scalar']}, {p['index_bits']}-bit indices{where})")
        if "external" in p:
            lines.append(f"          external packages: {', '.join(p['external']) or 'none of ' + '/'.join(PETSC_EXTERNAL)}")
    elif p.get("found"):
        lines.append(f"PETSc:    BROKEN (petsc4py installed, {p.get('error')})")
    else:
        lines.append("PETSc:    not found (petsc4py not installed): torch backend only")
    s = info["slepc"]
    if s.get("ok"):
        lines.append(f"SLEPc:    {s['version']}")
    elif s.get("found"):
        lines.append(f"SLEPc:    BROKEN (slepc4py installed, {s.get('error')})")
    else:
        lines.append("SLEPc:    not found (slepc4py not installed): torch eigensolvers only")
    t = info["torch"]
    if t.get("ok"):
        cuda = "yes" if t.get("cuda_available") else ("no" + (f" ({t['cuda_error']})" if t.get("cuda_error") else ""))
        lines.append(f"torch:    {t['version']}, {t['build']} build; CUDA available: {cuda}; "
                     f"devices: {', '.join(t['devices'])}; threads: {t['threads']}"
                     + (f" (set at import: {t['threads_set_by_slasolve']})" if t["threads_set_by_slasolve"] else ""))
    else:
        lines.append(f"torch:    BROKEN ({t.get('error')})")
    lines.append("")
    backends = [b + (" (default)" if b == info["default_backend"] else "") for b, ok in info["backends"].items() if ok]
    lines.append(f"solve backends:   {', '.join(backends) or 'none'}")
    for b, names in info["krylov_methods"].items():
        if names:
            lines.append(f"  methods ({b}):{' ' * max(1, 4 - len(b))}{', '.join(names)}")
    for b, names in info["preconditioners"].items():
        lines.append(f"  pc ({b}):{' ' * max(1, 9 - len(b))}{', '.join(names)}")
    lines.append(f"  torch ilu/icc/bjacobi: {info['torch_ilu']}")
    lines.append(f"eigsh backends:   {', '.join(info['eigensolvers'])}")
    lines.append(f"partitioners:     {', '.join(info['partitioners'])}")
    lines.append("optional:")
    for m, what in OPTIONAL.items():
        ver = info["optional"].get(m)
        lines.append(f"  {m:<10} {ver or 'not installed':<14} {what}")
    lines.append("")
    if info["problems"]:
        lines.append(f"PROBLEMS ({len(info['problems'])}):")
        lines += [f"  * {msg}" for msg in info["problems"]]
    else:
        lines.append("status: OK")
    return "\n".join(lines)


def show_config(file: Optional[TextIO] = None) -> Dict[str, Any]:
    """Local. Print the configuration of this install (versions, MPI, PETSc/SLEPc and their
    external packages, torch devices, available backends and preconditioners, optional
    packages, problems) and return it as the dict of :func:`~slasolve.config.config_info`.

    ``info["problems"]`` is empty when the install works; ``python -m slasolve`` prints
    the same report and exits with status 1 when it is not."""
    info = config_info()
    print(format_config(info), file=sys.stdout if file is None else file, flush=True)
    return info


# --------------------------------------------------------------------------- import failure
def _running_as_main() -> bool:
    """``python -m slasolve`` (the package is being imported by runpy for its __main__)."""
    if not sys.argv or sys.argv[0] != "-m":
        return False
    orig = getattr(sys, "orig_argv", None)
    if orig is None:
        return True
    for i, tok in enumerate(orig[:-1]):
        if tok == "-m":
            return orig[i + 1] == "slasolve"
    return False


def import_failed(exc: BaseException) -> None:
    """Local. Called by ``slasolve/__init__.py`` when loading MPI (mpi4py) or PETSc (petsc4py)
    failed during ``import slasolve``. Under ``python -m slasolve``: print the report and
    exit with status 1. Otherwise raise an ``ImportError`` that names the cause and the fix
    (chained to the original error)."""
    mpi_stage = "slasolve._process" not in sys.modules   # the module that imports mpi4py.MPI
    what, hint = (("mpi4py cannot load an MPI library", _MPI_HINT) if mpi_stage
                  else ("petsc4py/slepc4py is installed but PETSc/SLEPc fails to load", _PETSC_HINT))
    if _running_as_main():
        info = config_info()
        if not info["problems"]:
            info["problems"].append(f"{what}: {_error(exc)}. {hint}")
        print(format_config(info), flush=True)
        print(f"\nimport slasolve fails: {what} ({_error(exc)})", file=sys.stderr, flush=True)
        raise SystemExit(1)
    raise ImportError(f"import slasolve: {what} ({_error(exc)}). {hint} "
                      f"`python -m slasolve` reports the whole configuration.") from exc
