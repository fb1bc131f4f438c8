"""A rank whose supervisor is gone ends the job, and leaves the reason in the run folder.

Today's layout runs the supervisor on the batch host. When that node dies, nothing that Slurm
watches ends the job: the steps were started with ``--no-kill``, the batch script died with
its node, and the job stays RUNNING, with no event, until its time limit (measured on the dev
cluster: a 10-minute TIMEOUT). The ranks on the other nodes are the ones who can tell: their
control connection to the supervisor has been down (``control/linkwatch.py``: ZMTP heartbeats,
10 s) for :data:`~torchpass_slurm.config.DEFAULT_SUPERVISOR_GRACE_S` more. The first rank to
claim the record ``.torchpass/supervisor-lost.json`` in the run folder (an exclusive create:
one claim per job) cancels the job with ``scancel``; every rank that sees the loss exits with
:data:`EXIT_SUPERVISOR_LOST`. ``tp report`` and ``tp status`` read the record and say why the
job ended. The same holds when the supervisor runs in its own component of a heterogeneous
job and *its* node dies (docs/design/supervisor-component.md).

Unreachable is not dead. A rank cut off from the supervisor by a partition loses its link as
well, while the supervisor goes on (it moves that rank's node to a spare). So before it ends
the job, a rank looks at the supervisor's lease: ``status.json`` in the run folder, which the
supervisor rewrites every second (``updated``, its wall clock). A lease younger than half the
link's silence says the supervisor lives and this rank is the one cut off: it leaves alone
(:data:`EXIT_CUT_OFF`), writes no record and cancels nothing. A stale lease (a dead or frozen
supervisor) or none at all ends the job as above.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path

from torchpass_slurm import config
from torchpass_slurm.rundir.status import STATUS_FILE
from torchpass_slurm.rundir.supervisor_lost import claim_record

__all__ = ["EXIT_CUT_OFF", "EXIT_SUPERVISOR_LOST", "LEASE", "Orphan"]

#: The exit status of a rank that left because its supervisor was gone.
EXIT_SUPERVISOR_LOST = 75
#: The exit status of a rank that left because it was cut off from a supervisor that lives.
EXIT_CUT_OFF = 76
#: The supervisor's lease in the run folder (``rundir/status.py``; the supervisor writes it every second).
LEASE = Path(STATUS_FILE)
#: How long ``scancel`` may take.
SCANCEL_TIMEOUT_S = 20.0

logger = logging.getLogger(__name__)


class Orphan:
    """What a rank does once its supervisor is gone; ``check`` is called on every wake-up."""

    def __init__(
        self,
        environ: Mapping[str, str],
        *,
        node: str,
        sender: str,
        log: logging.LoggerAdapter[logging.Logger],
    ) -> None:
        self.grace = config.env_float(config.ENV_SUPERVISOR_GRACE, config.DEFAULT_SUPERVISOR_GRACE_S)
        self.run_dir = environ.get(config.ENV_RUN_DIR)
        # the whole job: a heterogeneous job is cancelled by its leader's id
        self.job_id = (
            environ.get(config.ENV_CANCEL_JOB_ID)
            or environ.get("SLURM_HET_JOB_ID")
            or environ.get(config.ENV_JOB_ID)
            or environ.get("SLURM_JOB_ID")
        )
        self.node, self.sender, self.log = node, sender, log

    def check(self, client: object) -> None:
        """Leave (this process exits) if ``client``'s link to the supervisor is down past the grace."""
        down_for = getattr(client, "link_down_for", None)
        if self.grace <= 0 or not callable(down_for):
            return
        silent = down_for()
        if silent is not None and silent >= self.grace:
            self.leave(silent)

    def leave(self, silent: float) -> None:
        lease = self.lease_age()
        if lease is not None and lease < silent / 2:
            self.log.error(
                "the supervisor has been unreachable for %.1f s, but it wrote its status %.1f s ago: "
                "it lives and this rank is cut off; leaving without ending the job",
                silent,
                lease,
            )
            logging.shutdown()
            os._exit(EXIT_CUT_OFF)
        self.log.error(
            "the supervisor has been unreachable for %.1f s and its status is %s: it is gone "
            "(its node died?); ending the job",
            silent,
            "missing" if lease is None else f"{lease:.1f} s old",
        )
        if self._claim(silent) and self.job_id:
            self._cancel()
        logging.shutdown()
        os._exit(EXIT_SUPERVISOR_LOST)

    def lease_age(self) -> float | None:
        """Seconds since the supervisor last wrote its status (``updated``), or None when there
        is no run folder or no readable status."""
        if not self.run_dir:
            return None
        path = Path(self.run_dir) / LEASE
        try:
            updated = json.loads(path.read_text())["updated"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            self.log.warning("cannot read the supervisor's lease %s: %s", path, exc)
            return None
        if isinstance(updated, bool) or not isinstance(updated, (int, float)):
            return None
        return max(0.0, time.time() - float(updated))

    def _claim(self, silent: float) -> bool:
        """Write the record unless another rank did (exclusive create); True when this rank did."""
        if not self.run_dir:
            return True
        record = {
            "kind": "supervisor_lost",
            "ts": time.time(),
            "job": self.job_id,
            "node": self.node,
            "sender": self.sender,
            "silent_s": round(silent, 2),
            "detail": f"the control connection to the supervisor was down for {silent:.1f} s; "
            f"{self.sender} on {self.node} cancelled the job",
        }
        return claim_record(Path(self.run_dir), record)

    def _cancel(self) -> None:
        """``scancel`` the whole job through the Slurm layer: the one Slurm command a rank runs,
        imported only here (a training process meets Slurm only when its supervisor is gone)."""
        from torchpass_slurm.errors import SlurmError
        from torchpass_slurm.slurm.cli_backend import CliSlurm
        from torchpass_slurm.slurm.runner import SubprocessRunner

        try:
            CliSlurm(SubprocessRunner(timeout=SCANCEL_TIMEOUT_S)).cancel(str(self.job_id))
        except SlurmError as exc:
            self.log.error("cancelling job %s failed: %s", self.job_id, exc)
