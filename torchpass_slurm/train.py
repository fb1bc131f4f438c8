"""What a training imports: the stable public API of torchpass-slurm for training scripts.

A training script imports from here and from nowhere else in the package::

    from torchpass_slurm.train import ElasticTrainer, Runtime, checkpoint, leave

    rt = Runtime.from_env()                  # or rt = init(): from_env() and start() in one
    model, opt = build()                     # a hot spare builds before it waits
    rt.start()                               # a spare blocks here until promoted
    state = {"train": checkpoint.TrainState(model, opt)}
    trainer = ElasticTrainer(rt, model, opt, state=state)
    trainer.fit(train_step, steps, on_commit)
    trainer.close(); rt.close()
    leave(0)                                 # exit, skipping torch's teardown at shutdown

A sharded model (FSDP2, HSDP) trains under ``ShardedTrainer(rt, build, layout)``, which
returns the same ``ElasticTrainer`` configured with a sharded training state: one loop
and one recovery path for every layout.

The names below keep their meaning across releases. The modules they come from
(``torchpass_slurm.rank.runtime``, ``.rank.elastic``, ``.rank.sharded``,
``torchpass_slurm.mesh``, ``.rank.checkpoint``, ...) are internal: they may be split,
renamed or moved without notice. ``checkpoint`` is the checkpoint module itself;
its public names are its ``__all__`` (``save``, ``load_latest``, ``latest_step``,
``TrainState``, ``RNGState``, ``step_dir``).

None of these modules imports torch (or zmq) at import time, so importing this
module stays cheap; torch is imported when a call needs it. ``import
torchpass_slurm`` alone imports none of this.
"""

from __future__ import annotations

from torchpass_slurm.mesh import MeshLayout
from torchpass_slurm.rank import checkpoint
from torchpass_slurm.rank.checkpoint import RNGState, TrainState
from torchpass_slurm.rank.elastic import ElasticTrainer
from torchpass_slurm.rank.group import leave
from torchpass_slurm.rank.rankinfo import RankInfo, Role
from torchpass_slurm.rank.runtime import Runtime, init
from torchpass_slurm.rank.sharded import ShardedTrainer

__all__ = [
    # joining the job
    "init",
    "Runtime",
    "Role",
    "RankInfo",
    # the training loops
    "ElasticTrainer",
    "ShardedTrainer",
    "MeshLayout",
    # checkpoints
    "checkpoint",
    "TrainState",
    "RNGState",
    # the end of the process
    "leave",
]
