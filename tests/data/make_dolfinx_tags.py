"""Regenerate dolfinx_tags.xdmf / .h5: a DOLFINx 0.5 mesh with cell and facet tags written by
``XDMFFile.write_meshtags`` (each tag set a Grid of its own referring to the mesh's Geometry).

Run from tests/data with the system python that has DOLFINx: ``python3 make_dolfinx_tags.py``.
The unit cube, 2 x 2 x 2 boxes of 6 tetrahedra; cell tags only on the cells whose midpoint has
x < 0.5 (1 + [y > 0.5]: a sparse tag set), facet tags 7 on x = 0 and 9 on z = 1.
"""
import numpy as np
from dolfinx import io, mesh as dm
from mpi4py import MPI

m = dm.create_unit_cube(MPI.COMM_WORLD, 2, 2, 2)
tdim = m.topology.dim
m.topology.create_connectivity(tdim - 1, tdim)
cells = dm.locate_entities(m, tdim, lambda x: x[0] <= 0.5 + 1e-12)
mid = dm.compute_midpoints(m, tdim, cells)
ct = dm.meshtags(m, tdim, cells, (1 + (mid[:, 1] > 0.5)).astype(np.int32))
ct.name = "materials"
left = dm.locate_entities_boundary(m, tdim - 1, lambda x: np.isclose(x[0], 0.0))
top = dm.locate_entities_boundary(m, tdim - 1, lambda x: np.isclose(x[2], 1.0))
f = np.concatenate([left, top])
v = np.concatenate([np.full(left.size, 7), np.full(top.size, 9)]).astype(np.int32)
o = np.argsort(f)
ft = dm.meshtags(m, tdim - 1, f[o], v[o])
ft.name = "boundaries"
with io.XDMFFile(m.comm, "dolfinx_tags.xdmf", "w") as x:
    x.write_mesh(m)
    x.write_meshtags(ct)
    x.write_meshtags(ft)
