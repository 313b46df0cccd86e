"""Load a script of ``examples/`` as a module (the tests call its ``main``)."""
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_example(name: str):
    """``examples/<name>.py`` as a fresh module."""
    spec = importlib.util.spec_from_file_location(f"_example_{name}", os.path.join(ROOT, "examples", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
