#!/bin/bash
# Rendered by tp-submit from the command line: 2 nodes + 1 hot spare.
# sbatch gets its options on its command line (--nodes=3 --no-kill ...).
export TORCHPASS_NODES=2
export TORCHPASS_SPARES=1
export TORCHPASS_NTASKS_PER_NODE=1
export TORCHPASS_RUN_DIR='/home/u/my runs/r1'
export TORCHPASS_SECRET_FILE='/home/u/my runs/r1/.torchpass/secret'
exec tp run -- python train.py --note 'it'"'"'s $HOME'
