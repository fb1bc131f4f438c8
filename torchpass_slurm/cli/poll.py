"""The loop behind ``--watch`` and ``--follow``: poll until done, or until Ctrl-C."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)


def poll_until(step: Callable[[], bool], interval: float) -> None:
    """Call ``step`` every ``interval`` seconds until it returns True.

    Ctrl-C ends the loop quietly: for a watching command it is the normal way out.
    """
    try:
        while not step():
            time.sleep(interval)
    except KeyboardInterrupt:
        logger.debug("polling interrupted by Ctrl-C")
