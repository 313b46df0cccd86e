"""Sphinx configuration: the API reference from the numpydoc docstrings plus the
markdown guides (myst-parser).

Build (warnings are errors, as in ``scripts/test.sh``)::

    .venv/bin/python -m sphinx -W --keep-going -b html docs docs/_build/html

Needs the ``docs`` extra (``pip install -e .[docs]``: sphinx, numpydoc, myst-parser).
``import slasolve`` runs at build time (autodoc), on one process, with petsc4py when
it is installed (``slasolve.petsc`` needs it).
"""
import os
import sys

sys.path.insert(0, os.path.abspath(".."))
# ``import slasolve`` hands sys.argv to PETSc: sphinx-build's options are not PETSc's.
_argv, sys.argv = sys.argv, sys.argv[:1]
import slasolve  # noqa: E402
sys.argv = _argv

project = "slasolve"
author = "the slasolve developers"
copyright = "the slasolve developers"
release = version = slasolve.__version__

extensions = [
    "sphinx.ext.autodoc",
    "numpydoc",
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# autodoc / numpydoc
autodoc_default_options = {"members": True}
autodoc_member_order = "bysource"
autodoc_typehints = "none"          # numpydoc's Parameters sections say it
numpydoc_show_class_members = False  # members are documented by autodoc, no autosummary stubs
numpydoc_class_members_toctree = False
numpydoc_xref_param_type = False
default_role = "py:obj"
# every cross-reference to slasolve must resolve; references to other projects are
# plain text (no intersphinx: the build runs offline)
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(scipy|numpy|np|torch|mpi4py|MPI|petsc4py|PETSc|slepc4py|SLEPc|meshio|pymetis|hypothesis)(\..*)?"),
    (r"py:.*", r"(builtins\.)?(ValueError|TypeError|RuntimeError|KeyError|IndexError|NotImplementedError"
               r"|int|float|complex|str|bool|bytes|list|tuple|dict|set|callable|object|None|Exception)"),
]

# markdown
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

html_theme = "alabaster"
html_title = f"slasolve {release}"
html_static_path = []


# -- cross-references written relative to where an object is defined ----------------
# Docstrings say :func:`box_mesh` inside slasolve.fem.mesh, or
# :class:`slasolve.eigen.info.EigenInfo`, while the reference documents each object
# once, under its public name (slasolve.fem.box_mesh, slasolve.EigenInfo). Resolve
# such references to the one documented object they mean; anything else (a name
# that is documented nowhere, or ambiguously) stays a warning, hence an error.
import importlib  # noqa: E402


def _import_object(path):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for p in parts[i:]:
                obj = getattr(obj, p)
        except AttributeError:
            return None
        return obj
    return None


def _resolve_relative(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    from sphinx.util.nodes import make_refnode
    domain = env.get_domain("py")
    target = node["reftarget"].lstrip("~.")
    wanted = set(domain.objtypes_for_role(node["reftype"]) or ())
    objects = {n: e for n, e in domain.objects.items() if e.objtype in wanted and not e.aliased}
    klass = node.get("py:class")
    candidates = []
    for t in ([klass + "." + target] if klass else []) + [target]:
        candidates = [n for n in objects if n.endswith("." + t)]
        if len(candidates) == 1:
            break
    if len(candidates) != 1 and node["reftype"] != "mod":
        # the object the name means, absolute or relative to the enclosing packages
        mod = (node.get("py:module") or "").split(".")
        paths = [target] + [".".join(mod[:i] + [target]) for i in range(len(mod), 0, -1)]
        obj = next((o for o in map(_import_object, paths) if o is not None), None)
        last = target.rsplit(".", 1)[-1]
        if obj is not None:
            candidates = [n for n in objects if n.rsplit(".", 1)[-1] == last and _import_object(n) is obj]
    if len(candidates) != 1:
        return None
    entry = objects[candidates[0]]
    return make_refnode(app.builder, node["refdoc"], entry.docname, entry.node_id, contnode, candidates[0])


def _warnings_to_sphinx():
    # numpydoc reports docstrings it cannot parse (an unknown section, ...) with
    # warnings.warn, which -W would not see: log them as Sphinx warnings
    import warnings
    from sphinx.util import logging
    logger = logging.getLogger("slasolve-docs")
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if "numpydoc" in str(filename):
            logger.warning(f"numpydoc: {message}")
        else:
            shown(message, category, filename, lineno, file, line)
    warnings.showwarning = showwarning


def setup(app):
    app.connect("missing-reference", _resolve_relative)
    _warnings_to_sphinx()
