"""The command line: one command per file, errors rendered once in :mod:`.app`.

Nothing here imports torch, mpi4py or rich at module import time; a command
imports what it needs when it runs, so ``tp --help`` is instant.
"""
