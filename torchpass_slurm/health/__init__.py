"""Node health for admins: gather facts once, judge them with pure checks, drain politely.

::

    sources/ (nvml, amdsmi, simulated) ─┐
    host.py (memory, disk) ─────────────┼─► run.gather_facts ─► Facts (frozen)
    state.py (earlier ECC samples) ─────┘                          │
                                                                   ▼
                                 checks.check_<area>_<thing>(facts, config) -> [CheckResult]
                                                                   │
                                                      run.HealthReport (worst = exit code)
                                                                   │
              drain.py (reasons "torchpass: ...", undrain plan) ◄──┴──► admin.py (Prolog/Epilog,
                                                                          HealthCheckProgram)

Statuses are Nagios': OK 0, WARNING 1, CRITICAL 2 (the node is bad), UNKNOWN 3
(the check broke). See docs/admin-guide.md.
"""

from __future__ import annotations

from torchpass_slurm.health.checks import CHECKS, CheckResult, Status, run_checks
from torchpass_slurm.health.config import HealthConfig, load_config, parse_config
from torchpass_slurm.health.facts import Facts, GpuFacts, HostFacts
from torchpass_slurm.health.run import HealthReport, gather_facts, run_health

__all__ = [
    "CHECKS",
    "CheckResult",
    "Facts",
    "GpuFacts",
    "HealthConfig",
    "HealthReport",
    "HostFacts",
    "Status",
    "gather_facts",
    "load_config",
    "parse_config",
    "run_checks",
    "run_health",
]
