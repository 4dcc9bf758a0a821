#!/usr/bin/env bash
# One machine, N processes under torchrun (the self-launcher `mpoverlap-train` does the same
# without torchrun):  launch/local.sh 4 parallel.dp=4 overlap.dp=true
set -euo pipefail
NPROC=${1:?usage: launch/local.sh NPROC [hydra overrides...]}
shift
exec torchrun --standalone --nproc-per-node="$NPROC" -m mpoverlap.train "$@"
