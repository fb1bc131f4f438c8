"""tp-submit's core: command line and ``#SBATCH`` lines -> JobSpec -> batch script -> job id.

The flow, the module of each step, and which steps are pure::

    argv ──parse_submit_args──► SubmitRequest ─┐           command_line.py  (pure)
    SCRIPT text ──parse_batch_script──► BatchScript ─┤      batch_script.py  (pure)
                                                 ▼          (both read options with options.py)
                            resolve_job_spec ──► JobSpec    spec.py  (frozen, every value resolved; pure)
                                                 │
         check_script_interpreter / check_command / check_run_dir / check_partition_fits
                                                 │          checks.py  (look at this node; refuse
                                                 ▼                      before submitting)
                 render_batch_script(spec), sbatch_arguments(spec)     render.py  (pure; golden-file tested)
                                                 │
                              submit(spec, submitter, create_secret) ──► job id    submission.py

Precedence is sbatch's: the command line wins over ``#SBATCH`` / ``#TP`` lines
of the script, and for an option given twice the later one wins. Options that
tp-submit does not need to understand go to sbatch unchanged and in order.

The names below are re-exported from those modules; ``tp-submit`` itself is
:mod:`torchpass_slurm.cli.submit`.
"""

from __future__ import annotations

from torchpass_slurm.submit.batch_script import BatchScript, parse_batch_script
from torchpass_slurm.submit.checks import (
    check_command,
    check_partition_fits,
    check_run_dir,
    check_script_interpreter,
    partition_unknown_warning,
    read_batch_script,
)
from torchpass_slurm.submit.command_line import SubmitRequest, parse_submit_args
from torchpass_slurm.submit.options import Option
from torchpass_slurm.submit.render import (
    RUN_DIR_COMMENT_PREFIX,
    describe_layout,
    render_batch_script,
    run_dir_comment,
    sbatch_arguments,
    sbatch_command_line,
)
from torchpass_slurm.submit.spec import JobSpec, resolve_job_spec
from torchpass_slurm.submit.submission import SubmitResult, Submitter, submit

__all__ = [
    "RUN_DIR_COMMENT_PREFIX",
    "BatchScript",
    "JobSpec",
    "Option",
    "SubmitRequest",
    "SubmitResult",
    "Submitter",
    "check_command",
    "check_partition_fits",
    "partition_unknown_warning",
    "check_run_dir",
    "check_script_interpreter",
    "describe_layout",
    "parse_batch_script",
    "parse_submit_args",
    "read_batch_script",
    "render_batch_script",
    "resolve_job_spec",
    "run_dir_comment",
    "sbatch_arguments",
    "sbatch_command_line",
    "submit",
]
