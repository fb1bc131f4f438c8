"""After-the-fact analysis: a job's report from its event log, totals over many
jobs, the goodput model, and finding a job's run folder. Read-only: nothing
here changes a running job.
"""
