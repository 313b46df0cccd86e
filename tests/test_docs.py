"""Documentation checks: the docstrings' ``Examples`` run, and the docs' links resolve.

* Doctests: every ``Examples`` section in :data:`DOCTEST_MODULES` runs as a doctest
  (one rank, torch's default dtype float32 as in a fresh interpreter); the examples of
  collective entry points also run under ``mpirun`` (the test marked mpi: every rank
  runs them and asserts the same outcome). :data:`MUST_HAVE_EXAMPLES` names the
  docstrings that must keep one.
* Links: every relative link ``[text](target)`` in README.md and docs/*.md points to a
  file of the repository, and an anchor ``#...`` to a heading of that file; every
  repository path written as code (``examples/fem_solve.py``, ``slasolve/krylov/``)
  exists. The HTML build itself (``sphinx-build -W``) runs in ``scripts/test.sh``.
"""
import doctest
import glob
import importlib
import os
import re

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# modules whose docstring examples run as doctests (add a module when it gains examples)
DOCTEST_MODULES = [
    "slasolve.sparse",
    "slasolve.dsparse",
    "slasolve.krylov.solve",
    "slasolve.eigen.eigsh",
    "slasolve.fem.assembly",
    "slasolve.fem.mesh",
    "slasolve.partition",
]
OPTIONAL_DOCTEST_MODULES = [  # run when they exist and import (modules added later / extras)
    "slasolve.direct",
    "slasolve.direct.api",
    "slasolve.nonlinear",
    "slasolve.linalg",
    "slasolve.config",
    "slasolve.plotting",
    "slasolve.taylor",
    "slasolve.timestepping.trajectory",
]
MUST_HAVE_EXAMPLES = [
    "slasolve.sparse.SparseTensor",
    "slasolve.dsparse.DSparseTensor",
    "slasolve.dsparse.DSparseTensor.from_local_rows",
    "slasolve.krylov.solve.solve",
    "slasolve.krylov.solve.cg",
    "slasolve.eigen.eigsh.eigsh",
    "slasolve.fem.assembly.Assembler",
    "slasolve.fem.mesh.box_mesh",
    "slasolve.partition.partition",
]
# collective examples that must also hold under mpirun (the others use one-rank inputs)
COLLECTIVE_EXAMPLES = [
    "slasolve.dsparse.DSparseTensor",
    "slasolve.dsparse.DSparseTensor.from_local_rows",
    "slasolve.krylov.solve.solve",
    "slasolve.eigen.eigsh.eigsh",
    "slasolve.fem.assembly.Assembler",
    "slasolve.fem.mesh.box_mesh",
]
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules():
    names = list(DOCTEST_MODULES)
    for name in OPTIONAL_DOCTEST_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
        names.append(name)
    return names


def _doctests(module_name):
    mod = importlib.import_module(module_name)
    return [t for t in doctest.DocTestFinder(exclude_empty=True).find(mod, module_name) if t.examples]


def _run(tests):
    """Run doctests with torch's stock default dtype; returns (failed, attempted, report)."""
    import io
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # tests/conftest.py sets float64; examples show the default
    try:
        for t in tests:
            t.globs = dict(t.globs)
            runner.run(t, out=out.write)
    finally:
        torch.set_default_dtype(old)
    res = runner.summarize(verbose=False)
    return res.failed, res.attempted, out.getvalue()


@pytest.mark.parametrize("module_name", _modules())
def test_docstring_examples(module_name):
    tests = _doctests(module_name)
    if module_name in DOCTEST_MODULES:
        assert tests, f"{module_name}: no docstring examples found"
    failed, attempted, report = _run(tests)
    assert failed == 0, f"{failed} of {attempted} doctest examples failed in {module_name}:\n{report}"


def test_required_examples_exist():
    found = {t.name: len(t.examples) for m in _modules() for t in _doctests(m)}
    missing = [n for n in MUST_HAVE_EXAMPLES if found.get(n, 0) == 0]
    assert not missing, f"docstrings without a runnable Examples section: {missing}"
    assert sum(found.values()) >= 60, found


@pytest.mark.mpi
def test_collective_examples_under_mpi(comm):
    tests = [t for m in DOCTEST_MODULES for t in _doctests(m) if t.name in COLLECTIVE_EXAMPLES]
    assert sorted(t.name for t in tests) == sorted(COLLECTIVE_EXAMPLES)
    failed, attempted, report = _run(tests)
    outcomes = comm.allgather((failed, attempted))
    bad = [(r, f, report if r == comm.rank else "") for r, (f, _) in enumerate(outcomes) if f]
    assert not bad, f"doctests failed at {comm.size} ranks (rank, failures): {bad}"


# ------------------------------------------------- Collective. / Local. (house rule)
PUBLIC_MODULES = ["slasolve", "slasolve.fem", "slasolve.partition", "slasolve.petsc", "slasolve.testing",
                  "slasolve.autograd", "slasolve.halo", "slasolve.direct", "slasolve.nonlinear", "slasolve.linalg",
                  "slasolve.plotting", "slasolve.config"]


def _public_callables():
    import inspect
    seen = {}
    for m in PUBLIC_MODULES:
        try:
            mod = importlib.import_module(m)
        except ImportError:
            continue
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name, None)
            if not getattr(obj, "__module__", "").startswith("slasolve"):
                continue
            if inspect.isfunction(obj):
                seen.setdefault(id(obj), (f"{m}.{name}", obj))
            elif inspect.isclass(obj) and not issubclass(obj, BaseException):
                for attr, val in vars(obj).items():
                    f = val.__func__ if isinstance(val, (classmethod, staticmethod)) else val
                    if not attr.startswith("_") and inspect.isfunction(f):
                        seen.setdefault(id(f), (f"{m}.{name}.{attr}", f))
    return sorted(seen.values(), key=lambda t: t[0])


def test_public_docstrings_say_collective_or_local():
    """Every public function and method says in its first line whether it is collective."""
    import inspect
    items = _public_callables()
    assert len(items) > 100
    bad = [n for n, f in items if not (inspect.getdoc(f) or "").lstrip().startswith(("Collective", "Local"))]
    assert not bad, f"docstrings that do not start with 'Collective.' or 'Local.': {bad}"


def test_numpydoc_parameters_parse():
    """numpydoc reads every Parameters entry as ``name[, name...] : type``: a stray paragraph
    inside the section (it renders as a parameter) or ``name: type`` (no space) fails here."""
    pytest.importorskip("numpydoc")
    import inspect
    import warnings
    from numpydoc.docscrape import ClassDoc, FunctionDoc
    ident = re.compile(r"^\*{0,2}[A-Za-z_]\w*(\s*,\s*\*{0,2}[A-Za-z_]\w*)*$")
    bad = []
    for name, f in _public_callables():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            doc = ClassDoc(f) if inspect.isclass(f) else FunctionDoc(f)
        bad += [f"{name}: {w.message}" for w in caught]
        bad += [f"{name}: parameter {p.name!r}" for p in doc["Parameters"] if not ident.match(p.name.strip())]
    assert not bad, "docstrings numpydoc misreads:\n" + "\n".join(bad)


def test_api_reference_covers_the_public_api():
    """Every name in ``slasolve.__all__`` has an autodoc directive in docs/api/slasolve.rst,
    and every public module has a page (the other pages use ``automodule :members:``, which
    follows the module's ``__all__``)."""
    import slasolve
    with open(os.path.join(ROOT, "docs", "api", "slasolve.rst")) as fh:
        rst = fh.read()
    documented = set(re.findall(r"^\.\. auto(?:function|class|exception|data)::\s+(?:slasolve\.)?(\w+)\s*$",
                                rst, flags=re.M))
    missing = sorted(set(slasolve.__all__) - documented)
    assert not missing, f"add to docs/api/slasolve.rst: {missing}"
    pages = "".join(open(p).read() for p in glob.glob(os.path.join(ROOT, "docs", "api", "*.rst")))
    for mod in ("slasolve.fem", "slasolve.partition", "slasolve.petsc", "slasolve.testing", "slasolve.linalg"):
        assert f".. automodule:: {mod}\n   :members:" in pages, mod


# --------------------------------------------------------------------------- links
def _markdown_files():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _strip_code_blocks(text):
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading):
    """GitHub's (and myst's) anchor for a heading."""
    h = re.sub(r"`([^`]*)`", r"\1", heading.strip()).lower()
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def _anchors(path):
    with open(path) as fh:
        text = _strip_code_blocks(fh.read())
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, flags=re.M)}


LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_PATH = re.compile(r"`((?:\.\./)*(?:docs|examples|slasolve|scripts|tests|bench|\.ci)/[\w./-]*)`")


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: os.path.relpath(p, ROOT))
def test_relative_links_resolve(md):
    with open(md) as fh:
        text = _strip_code_blocks(fh.read())
    here = os.path.dirname(md)
    bad = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: (offline: not checked)
            continue
        path, _, anchor = target.partition("#")
        full = md if not path else os.path.normpath(os.path.join(here, path))
        if not os.path.exists(full):
            bad.append(f"{target}: no file {os.path.relpath(full, ROOT)}")
        elif anchor and full.endswith(".md") and anchor not in _anchors(full):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    for path in CODE_PATH.findall(text):
        # paths written as code are relative to the repository root (README convention);
        # build outputs (docs/_build/...) exist only after a build
        if "_build" not in path and not glob.glob(os.path.join(ROOT, path.rstrip("/"))):
            bad.append(f"`{path}`: no such file or directory in the repository")
    assert not bad, f"{os.path.relpath(md, ROOT)}: broken references:\n" + "\n".join(bad)


def test_link_checker_catches_breakage(tmp_path):
    """The checker itself can fail: a missing file and a missing anchor are reported."""
    assert _slug("CI slice and full set") == "ci-slice-and-full-set"
    assert _slug("`fem_solve.py`") == "fem_solvepy"
    md = tmp_path / "x.md"
    md.write_text("# Title\n[a](missing.md) [b](#title) [c](#nope)\n")
    text = md.read_text()
    targets = LINK.findall(text)
    assert targets == ["missing.md", "#title", "#nope"]
    assert "title" in _anchors(str(md)) and "nope" not in _anchors(str(md))
