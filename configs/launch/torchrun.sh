#!/usr/bin/env bash
# Multi-node training with torchrun and its c10d rendezvous. Run the same command on every node;
# the nodes meet at the rendezvous endpoint (host:port of any one of them, usually the first).
#
#   NNODES=4 NPROC_PER_NODE=8 RDZV_ENDPOINT=node0:29400 RDZV_ID=pretrain-42 \
#     bash configs/launch/torchrun.sh --config recipes/pretrain.yaml --trainer.strategy fsdp
#
# The arguments go to `uma fit`. torchrun starts NPROC_PER_NODE processes per node and numbers
# them; Lightning reads those ranks (its TorchElasticEnvironment) and checks them against
# trainer.num_nodes and trainer.devices, which this script sets to match.
set -euo pipefail
: "${NNODES:?set NNODES, the number of nodes}"
: "${NPROC_PER_NODE:?set NPROC_PER_NODE, the processes (GPUs) per node}"
: "${RDZV_ENDPOINT:?set RDZV_ENDPOINT, a host:port every node can reach}"
exec "${PYTHON:-python3}" -m torch.distributed.run \
  --nnodes "$NNODES" \
  --nproc-per-node "$NPROC_PER_NODE" \
  --rdzv-backend c10d \
  --rdzv-endpoint "$RDZV_ENDPOINT" \
  --rdzv-id "${RDZV_ID:-uma}" \
  --max-restarts "${MAX_RESTARTS:-0}" \
  -m uma_lightning.command fit "$@" \
  --trainer.num_nodes "$NNODES" \
  --trainer.devices "$NPROC_PER_NODE"
