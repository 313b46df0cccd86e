"""The declared settings schemas (``slasolve.settings``): a call binds exactly the declared
names; the collective agree dict and the cache key come from that one binding; a setting
that selects the cached solver really selects another one."""
import pytest
import scipy.sparse as sp
import torch

import slasolve
from slasolve.direct.api import DIRECT_SETTINGS
from slasolve.krylov.solve import SOLVE_SETTINGS
from slasolve.nonlinear.solve import NONLINEAR_SETTINGS
from slasolve.settings import SettingsSchema


def test_bind_exactly_the_declared_names():
    schema = SettingsSchema(keyed=("method", "pc"), agreed=("rtol",))
    s = schema.bind(method="cg", pc="gamg", rtol=1e-8)
    assert s.agree() == {"method": "cg", "pc": "gamg", "rtol": 1e-8}
    assert s.key() == ("cg", "gamg") and s.key(method="gmres") == ("gmres", "gamg")
    with pytest.raises(TypeError, match="missing"):
        schema.bind(method="cg", pc="gamg")
    with pytest.raises(TypeError, match="undeclared"):
        schema.bind(method="cg", pc="gamg", rtol=1e-8, atol=0.0)


@pytest.mark.parametrize("schema", [SOLVE_SETTINGS, DIRECT_SETTINGS, NONLINEAR_SETTINGS])
def test_families_key_on_agreed_settings(schema):
    assert set(schema.keyed) <= schema.names and len(set(schema.keyed)) == len(schema.keyed)


def test_keyed_setting_selects_its_own_solver():
    """``restart`` is keyed: GMRES with another restart is another cached KSP, the same restart
    the same one (the layout's solver cache grows only on the new key)."""
    A = slasolve.DSparseTensor.from_global(sp.diags([-1.0, 2.5, -1.0], [-1, 0, 1], (40, 40), format="csr"))
    b = A.scatter(torch.ones(40, dtype=torch.float64), root=None)
    cache = A._layout.cache("solvers")
    slasolve.solve(A, b, "gmres", restart=20)
    n = len(cache)
    slasolve.solve(A, b, "gmres", restart=20, rtol=1e-9)   # rtol is agreed, not keyed
    assert len(cache) == n
    slasolve.solve(A, b, "gmres", restart=10)
    assert len(cache) == n + 1
