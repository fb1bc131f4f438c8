"""The supervisor, ``tp run``: runs on the batch host, owns the job's control plane.

Detect, plan, act: detectors (:mod:`.detect`) turn messages, step exits,
Slurm node states and the clock into typed faults; a pure planner
(:mod:`.plan`) turns faults plus membership into one recovery plan; the
loop (:mod:`.loop`) carries plans out as states with deadlines. Nothing here
imports torch: the batch host may have none (a test holds the boundary).
"""
