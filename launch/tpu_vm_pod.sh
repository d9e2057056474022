#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod slice; jax.distributed finds the coordinator itself.
#   TPU=my-v5p-64 ZONE=us-east5-a bash launch/tpu_vm_pod.sh --experiment=mlra4_2p9b \
#       --data.dataset=gs-mounted/fineweb_edu --workdir=/mnt/runs/mlra4
# The workdir must be shared by all workers (a GCS bucket path or a mounted filesystem).
set -euo pipefail
: "${TPU:?set TPU to the TPU VM name}" "${ZONE:?set ZONE}"
REPO=${REPO:-https://github.com/mlra-jax/mlra_jax.git}
args=$(printf ' %q' "$@")
gcloud compute tpus tpu-vm ssh "$TPU" --zone "$ZONE" --worker=all --command "
  set -e
  [ -d mlra_jax ] || git clone $REPO mlra_jax
  cd mlra_jax && python3 -m venv .venv && .venv/bin/pip install -q -e '.[tpu]'
  .venv/bin/python -m mlra_jax.train --distributed $args"
