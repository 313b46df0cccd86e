"""``slasolve.testing``: helpers for testing code that uses slasolve, at any rank count.

User-facing (documented, stable):

* :func:`taylor_test` -- the first-order Taylor remainder of a gradient (MPI-parallel);
* :func:`local_slice` / :func:`replicate` / :func:`global_offsets` -- replicated <->
  sharded tensors with autograd, so ``torch.autograd.gradcheck`` perturbs the same
  inputs on every rank: wrap a distributed function as ``global input -> local_slice ->
  op -> replicate -> global output`` and gradcheck that on every rank at once;
* :func:`normal_by_id` -- normal numbers keyed by global id: synthetic data (noise) that is
  the same at every rank count;
* :func:`poisson_matrix` / :func:`grid_coords` -- a small reference matrix and its grid.

The test suite's own fixtures live in submodules: :mod:`slasolve.testing.matrices` (the
named random matrix families of the property tests, distribution helpers, the SIMP
system) and :mod:`slasolve.testing.properties` (hypothesis under MPI, reference checks);
their names are re-exported here for the existing tests.
"""
from __future__ import annotations

from ..taylor import TaylorResult, TaylorTestError, taylor_test
from .distributed import global_offsets, local_slice, normal_by_id, replicate
from .matrices import (MATRIX_KINDS, block_spd_matrix, case_matrix, distribute, distribute_or_none,
                       graph_laplacian, grid_coords, mass_like_matrix, nonsymmetric_matrix, poisson_matrix,
                       random_block_matrix, random_coords, random_matrix, random_partition,
                       repeated_spectrum_matrix, separated_spectrum_matrix, simp_mbb_system, spd_matrix,
                       symmetric_indefinite_matrix, with_empty_rows)
from .properties import (collective_property, eig_selection_error, on_root, property_config, residual_bound_ok,
                         spsolve_reference)

__all__ = ["taylor_test", "TaylorResult", "TaylorTestError", "local_slice", "replicate", "global_offsets", "normal_by_id",
           "poisson_matrix", "grid_coords", "random_matrix", "block_spd_matrix", "spd_matrix",
           "nonsymmetric_matrix", "symmetric_indefinite_matrix", "graph_laplacian", "separated_spectrum_matrix",
           "repeated_spectrum_matrix", "mass_like_matrix", "random_block_matrix", "with_empty_rows",
           "random_coords", "random_partition", "eig_selection_error", "residual_bound_ok", "property_config",
           "collective_property", "on_root", "spsolve_reference", "simp_mbb_system", "MATRIX_KINDS", "case_matrix", "distribute",
           "distribute_or_none"]
