"""The MPI transport's cluster test (tests/cluster/test_mpi_transport.py) on the bookworm dev
cluster: Slurm 22.05 and torch 2.13, whose ranks load no MPI of their own."""

from __future__ import annotations

import pytest

from tests.cluster.test_mpi_transport import (  # the test itself, collected on this cluster too
    test_a_node_kill_then_its_donors_death_move_the_state_over_mpi_live_and_bitwise_equal,
)

pytestmark = pytest.mark.cluster

__all__ = ["test_a_node_kill_then_its_donors_death_move_the_state_over_mpi_live_and_bitwise_equal"]
