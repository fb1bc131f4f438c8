"""Deprecated import path: :class:`MeshLayout` lives in :mod:`torchpass_slurm.mesh` now.

Training scripts import it from the public API, ``from torchpass_slurm.train import
MeshLayout``. This module keeps the old path working, with a :class:`DeprecationWarning`,
for one release.
"""

from __future__ import annotations

import warnings

from torchpass_slurm.mesh import MAX_MESH_DIMS, REPLICATE, MeshLayout, assign_donors

__all__ = ["MeshLayout", "REPLICATE", "MAX_MESH_DIMS", "assign_donors"]

warnings.warn(
    "torchpass_slurm.rank.layout is deprecated and goes in the next release: "
    "import MeshLayout from torchpass_slurm.train",
    DeprecationWarning,
    stacklevel=2,
)
