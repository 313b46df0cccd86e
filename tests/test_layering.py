"""The import-layering contract (read from the source with ``ast``, nothing imported).

Units: each top-level module of ``slasolve`` (``slasolve/dsparse.py`` -> ``slasolve.dsparse``)
and each subpackage (``slasolve/krylov/`` -> ``slasolve.krylov``); the package's
``__init__.py`` (the public facade) is not a unit. The contract:

* no import cycle between units, nor between modules, counting imports inside functions too (a
  function-level import hides a cycle, it does not remove it); one known module cycle inside
  ``slasolve.fem`` is listed in ``KNOWN_MODULE_CYCLES`` until it is removed;
* no name with a leading underscore imported from another unit. Modules whose own name starts
  with an underscore (``_comm``, ``_log``, ``_process``, ``_startup``, ``_faults``, ``_argv``,
  ``_petsc_values``) are the library's
  shared infrastructure: any unit may import them, but not their underscore-prefixed names.

A new module that breaks either rule fails here with the offending imports named.
"""
import ast
import os

import slasolve

ROOT = os.path.dirname(slasolve.__file__)


def _modules():
    mods = {}
    for dirpath, _dirs, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(dirpath, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                mods[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return mods


MODULES = _modules()


def _unit(module: str):
    parts = module.split(".")
    return None if len(parts) == 1 else ".".join(parts[:2])


def _imports():
    """``(importer, imported module, imported name or None, line)`` for every import of slasolve."""
    out = []
    for mod, path in MODULES.items():
        pkg = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(open(path).read(), path)):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[:len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if not target.startswith("slasolve"):
                    continue
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    if sub in MODULES:
                        out.append((mod, sub, None, node.lineno))
                    else:
                        out.append((mod, target, alias.name, node.lineno))
            elif isinstance(node, ast.Import):
                out += [(mod, a.name, None, node.lineno) for a in node.names if a.name.startswith("slasolve")]
    return out


#: module cycles not yet removed (each a debt, not a license): ``Assembler.neumann`` calls
#: ``facets.neumann_load``, which needs ``Assembler``
KNOWN_MODULE_CYCLES = [{"slasolve.fem.assembly", "slasolve.fem.facets"}]


def _cycles(graph):
    """The strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return out


def test_no_import_cycle_between_modules():
    graph = {}
    for m, target, _name, _line in _imports():
        # the facade and a package's __init__ re-exporting its own modules are not dependencies
        if "slasolve" in (m, target) or m == target or target.startswith(m + "."):
            continue
        graph.setdefault(m, set()).add(target)
    cycles = [sorted(c) for c in _cycles(graph) if c not in KNOWN_MODULE_CYCLES]
    assert not cycles, f"import cycles between modules: {cycles}"


def test_no_private_name_crosses_units():
    bad = [f"{MODULES[m]}:{line}: {name} from {target}" for m, target, name, line in _imports()
           if name is not None and name.startswith("_") and _unit(m) is not None
           and _unit(target) not in (None, _unit(m))]
    assert not bad, "private names imported from another unit:\n" + "\n".join(bad)


def test_no_import_cycle_between_units():
    graph = {}
    where = {}
    for m, target, _name, line in _imports():
        a, b = _unit(m), _unit(target)
        if a is None or b is None or a == b:
            continue
        graph.setdefault(a, set()).add(b)
        where.setdefault((a, b), f"{MODULES[m]}:{line}")
    cycles = []
    state = {}

    def visit(u, stack):
        state[u] = 1
        for v in sorted(graph.get(u, ())):
            if state.get(v) == 1:
                loop = stack[stack.index(v):] + [v]
                cycles.append(" -> ".join(loop) + "  (" + ", ".join(where[(x, y)] for x, y in zip(loop, loop[1:]))
                              + ")")
            elif v not in state:
                visit(v, stack + [v])
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u, [u])
    assert not cycles, "import cycles between units:\n" + "\n".join(cycles)
