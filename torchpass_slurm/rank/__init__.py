"""The rank side: what runs inside every training process.

:mod:`.runtime` (the rank's connection to the supervisor: hello, heartbeats,
standby, reports), :mod:`.elastic` (``ElasticTrainer``: the step-commit rule
and live recovery in place), :mod:`.checkpoint` (sharded checkpoints) and
:mod:`.rankinfo` (the environment contract). Nothing here imports the Slurm
layer: ranks talk to Slurm only through the supervisor (a test holds the
boundary).
"""
