#!/usr/bin/env bash
# One machine, N processes under torchrun (the self-launcher `mpoverlap-train` does the same
# without torchrun):  launch/local.sh 4 parallel.dp=4 overlap.dp=true
# CUDA_DEVICE_MAX_CONNECTIONS needs no export: each worker sets it to 1 before CUDA starts when
# TP or CP overlap is on; a value other than 1 you export turns overlap.tp/cp=auto off (see the plan).
set -euo pipefail
NPROC=${1:?usage: launch/local.sh NPROC [hydra overrides...]}
shift
exec torchrun --standalone --nproc-per-node="$NPROC" -m mpoverlap.train "$@"
