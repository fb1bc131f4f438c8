#!/bin/bash -l
# Rendered by tp-submit from jobs/train.sbatch: 4 nodes + 2 hot spares, 8 tasks per node.
# sbatch gets its options on its command line (--nodes=6 --no-kill ...).
export TORCHPASS_NODES=4
export TORCHPASS_SPARES=2
export TORCHPASS_NTASKS_PER_NODE=8
export TORCHPASS_RUN_DIR=/shared/runs/train-20250304-050607
export TORCHPASS_SECRET_FILE=/shared/runs/train-20250304-050607/.torchpass/secret
set -- 'configs/big run.yaml'
# ---- jobs/train.sbatch, without its #! line; its #SBATCH lines are inert here ----
#SBATCH -N 4
#SBATCH --time=1:00:00
#TP --spares=2

module load pytorch
tp run python train.py --config "$1"
