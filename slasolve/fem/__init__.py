"""Finite elements on distributed meshes.

* :mod:`slasolve.fem.elements` -- local, vectorised element kernels in torch
  (all elements at once, differentiable in per-element coefficients):
  :func:`stiffness`, :func:`mass`, :func:`load`, :func:`element_volume`,
  :func:`elasticity_stiffness` for P1 triangles / tetrahedra and Q1 quads /
  hexahedra (vertex orderings are documented there).
* :mod:`slasolve.fem.mesh` -- :class:`Mesh` (each rank holds its owned cells, a
  contiguous range of owned nodes and its ghost nodes), :func:`box_mesh`
  (collective; generated in parallel, no global arrays), :func:`read_mesh`
  (collective; XDMF read in parallel slices, other formats with meshio on rank 0), :func:`write_mesh`
  (collective; one VTU piece per rank plus a ``.pvtu`` index, or gathered),
  :func:`read_pvtu` (local; the pieces reassembled into one ``meshio.Mesh``),
  :func:`boundary_nodes` (local).
* :mod:`slasolve.fem.xdmf` -- XDMF + HDF5 in parallel: :func:`write_xdmf` (mesh, tags,
  fields, time series; every rank writes its share), the sliced reader behind
  :func:`read_mesh` for ``.xdmf``, :func:`read_point_data` / :func:`read_cell_data` /
  :func:`read_matrix` (restart on any number of ranks), :func:`convert_mesh` (gmsh ``.msh`` and other
  meshio formats to XDMF, once).
* :mod:`slasolve.fem.distribute` -- parallel dual graph, partition (PT-Scotch, METIS,
  block) and redistribution of a mesh read in slices; :func:`partition_quality`, :func:`dual_graph`,
  :func:`dual_graph_laplacian`.
* :mod:`slasolve.fem.assembly` -- :class:`Assembler` (alias :class:`FunctionSpace`;
  collective): precomputed distributed pattern, vectorised differentiable
  assembly of stiffness / mass / elasticity matrices and load vectors.
* :mod:`slasolve.fem.bc` -- :class:`DirichletBC` (symmetric elimination,
  differentiable), :func:`apply_dirichlet`, :func:`boundary_dofs`.
* :mod:`slasolve.fem.problems` -- manufactured Poisson / elasticity problems,
  :func:`l2_error`, :func:`manufactured_solve`.
"""
from .elements import (CELL_TYPES, cell_dim, elasticity_stiffness, element_volume, infer_cell, load,
                       mass, n_vertices, stiffness)
from .mesh import Mesh, boundary_nodes, box_mesh, read_mesh, read_pvtu, write_mesh
from .assembly import Assembler, FunctionSpace
from .bc import DirichletBC, apply_dirichlet, boundary_dofs
from .problems import FemResult, l2_error, manufactured_solve

__all__ = ["CELL_TYPES", "cell_dim", "n_vertices", "infer_cell", "stiffness", "mass", "load",
           "element_volume", "elasticity_stiffness", "Mesh", "box_mesh", "boundary_nodes",
           "read_mesh", "write_mesh", "read_pvtu", "Assembler", "FunctionSpace", "DirichletBC", "apply_dirichlet",
           "boundary_dofs", "l2_error", "manufactured_solve", "FemResult"]
from .filters import BoxCells, DensityFilter, cell_laplacian  # noqa: E402
__all__ += ["BoxCells", "DensityFilter", "cell_laplacian"]
from .nullspace import rigid_body_modes  # noqa: E402
__all__ += ["rigid_body_modes"]
from .facets import BoundaryFacets, boundary_facets, neumann_load, tagged_facets, tagged_nodes  # noqa: E402
from .nonlinear import NonlinearDiffusion, NonlinearProblem  # noqa: E402
from .hyperelastic import NeoHookean  # noqa: E402
__all__ += ["BoundaryFacets", "boundary_facets", "neumann_load", "NonlinearProblem", "NonlinearDiffusion",
            "NeoHookean"]
from .mesh import FacetTags  # noqa: E402
from .distribute import dual_graph, dual_graph_laplacian, partition_quality  # noqa: E402
from .xdmf import convert_mesh, read_cell_data, read_matrix, read_point_data, write_xdmf, xdmf_steps  # noqa: E402
__all__ += ["tagged_facets", "tagged_nodes", "FacetTags", "partition_quality", "dual_graph", "dual_graph_laplacian", "write_xdmf", "read_point_data", "read_cell_data", "read_matrix", "xdmf_steps",
            "convert_mesh"]
