"""torchpass-slurm: hot spares and live migration for PyTorch training on Slurm.

The package is light at import time: nothing here imports torch, mpi4py or
rich, so that the command line answers ``--help`` instantly on a login node.
A training script imports from :mod:`torchpass_slurm.train`, the public API;
the other modules are internal.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
