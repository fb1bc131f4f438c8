#!/usr/bin/env python3
"""One FSDP2 step on a 2x2 (replicate x shard) mesh over gloo, one rank per node, under plain
srun: what the bookworm image exists for (Debian's torch 2.6 fails it; design.md, 1b).
Prints one line per rank: ``probe rank=R coord=(i, j) local=[32, 64] torch=V``."""

from __future__ import annotations

import datetime

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from torchpass_slurm.rank import runtime


def main() -> None:
    rt = runtime.init()
    rt.init_process_group("gloo", datetime.timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    fully_shard(model, mesh=mesh)
    model(torch.ones(2, 64)).sum().backward()
    local = list(model.weight.to_local().shape)  # type: ignore[operator]
    print(
        f"probe rank={rt.rank} coord={tuple(mesh.get_coordinate() or ())} local={local} "
        f"torch={torch.__version__}",
        flush=True,
    )
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
