#!/usr/bin/env bash
# N training processes on this machine, each with its own CPU devices, joined by jax.distributed:
# a rehearsal of a multi-host run (data sharding per process, collectives, checkpoints).
#   bash launch/local.sh 2 --experiment=mlra4_tiny --workdir=runs/two_hosts
# MODULE=mlra_jax.eval runs another command the same way:
#   MODULE=mlra_jax.eval bash launch/local.sh 2 ppl --checkpoint runs/two_hosts --data val=FILE
set -euo pipefail
processes=$1; shift
devices_per_process=${DEVICES_PER_PROCESS:-4}
python=${PYTHON:-python3}
module=${MODULE:-mlra_jax.train}
port=${PORT:-$((20000 + RANDOM % 20000))}
pids=()
for ((i = 0; i < processes; i++)); do
  JAX_PLATFORMS=cpu XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=${devices_per_process}" \
    "$python" -m "$module" --distributed --coordinator="localhost:${port}" \
      --num_processes="${processes}" --process_id="${i}" "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
