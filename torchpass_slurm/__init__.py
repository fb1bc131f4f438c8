"""torchpass-slurm: hot spares and live migration for PyTorch training on Slurm.

The package is light at import time: nothing here imports torch, mpi4py or
rich, so that the command line answers ``--help`` instantly on a login node.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
