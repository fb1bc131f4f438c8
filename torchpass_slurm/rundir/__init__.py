"""The run folder: what each process of a job writes there, and how it is read back.

Every process of a job shares one folder (``tp-submit --run-dir``, on a shared file
system). This package holds its files' formats, so that the writers (the supervisor on
the batch host, the ranks) and the readers (``tp status``, ``tp events``, ``tp report``
on a login node) meet here instead of importing each other:

* :mod:`~torchpass_slurm.rundir.events`: ``events.jsonl``, the append-only event log
  (the history);
* :mod:`~torchpass_slurm.rundir.status`: ``status.json``, the supervisor's snapshot
  (the present, and its lease);
* :mod:`~torchpass_slurm.rundir.supervisor_lost`: the record a rank leaves when the
  supervisor is gone;
* :mod:`~torchpass_slurm.rundir.locate`: finding a job's run folder from a path or a
  Slurm job id.

Nothing here is imported by ``import torchpass_slurm.rundir`` alone.
"""
