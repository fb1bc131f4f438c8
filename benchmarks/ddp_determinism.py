"""Moved to :mod:`benchmarks.experiments.ddp_determinism` (the dated experiments).

This name is kept while ``tests/unit/runtime/test_ddp_determinism.py`` and the comment at
``torchpass_slurm/rank/elastic.py`` (``DEFAULT_DDP_KWARGS``) still name it; remove it once
both name the new module.
"""

from benchmarks.experiments.ddp_determinism import Plan, check_rewrap, main

__all__ = ["Plan", "check_rewrap", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
