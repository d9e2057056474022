#!/usr/bin/env bash
# Train on every worker of a Cloud TPU VM pod slice (a queued resource). The workdir and data must be one
# filesystem every worker sees at the same path (a Filestore NFS share, or a gs:// bucket through the gcs
# extra); the same `run` resumes from its newest checkpoint.
#   export TPU=mlra-v5p-64 ZONE=us-east5-a            # and PROJECT=... unless gcloud has a default
#   ACCELERATOR=v5p-64 VERSION=v2-alpha-tpuv5 bash launch/tpu_vm_pod.sh create [--spot]
#   bash launch/tpu_vm_pod.sh setup                    # every worker at this checkout's commit
#   bash launch/tpu_vm_pod.sh run --experiment=mlra4_2p9b --data.dataset=/mnt/shared/data/fineweb_edu \
#       --workdir=/mnt/shared/runs/mlra4
#   bash launch/tpu_vm_pod.sh logs [WORKER]  |  status  |  stop  |  delete
set -euo pipefail

usage() {
  cat >&2 <<'EOF'
usage: TPU=NAME ZONE=ZONE [PROJECT=ID] bash launch/tpu_vm_pod.sh COMMAND [ARGS]
  create [--spot ...]  request the slice as a queued resource named $TPU
                       (ACCELERATOR=v5p-64, VERSION=v2-alpha-tpuv5: the TPU type and runtime image)
  setup                on every worker: clone REPO (default: this checkout's origin), check out COMMIT
                       (default: this checkout's HEAD, which must be pushed), make .venv with Python
                       $PYTHON_VERSION (default 3.12, fetched by uv: TPU images ship 3.10) and install .[tpu,gcs]
  run TRAIN_ARGS...    first, on worker 0: python -m mlra_jax.train --compile_for=SLICE TRAIN_ARGS, the train
                       step compiled for the slice (ACCELERATOR, else the TPU's type): a run that does not fit
                       a chip's HBM is refused before it starts (PREFLIGHT=0 skips this); then on every
                       worker: python -m mlra_jax.train --distributed TRAIN_ARGS, detached (survives the ssh
                       session); log in ~/mlra_jax_train.log on each worker
  logs [WORKER]        follow one worker's log (default worker 0; LOG_LINES=100 lines of history)
  status               the queued resource's state and whether each worker is training
  stop                 SIGTERM on every worker: training saves a checkpoint and exits
  delete               delete the queued resource and its TPU
A preempted spot slice (queued resource SUSPENDED or FAILED) comes back with
  delete, create, setup, then the same run: training resumes from the newest checkpoint in the workdir.
EOF
  exit 2
}

[[ $# -ge 1 ]] || usage
command=$1; shift
case $command in create | setup | run | logs | status | stop | delete) ;; -h | --help | help) usage ;;
  *) echo "error: unknown command '$command'" >&2; usage ;;
esac
if [[ -z ${TPU:-} || -z ${ZONE:-} ]]; then
  echo "error: set TPU (the TPU VM / queued resource name) and ZONE, e.g. TPU=mlra-v5p-64 ZONE=us-east5-a" >&2
  exit 2
fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
where=(--zone "$ZONE" ${PROJECT:+--project "$PROJECT"})
log='~/mlra_jax_train.log' pidfile='~/mlra_jax_train.pid'

ssh_workers() {  # ssh_workers WORKER COMMAND: run COMMAND (bash, the workers' login shell) on one worker or all
  gcloud compute tpus tpu-vm ssh "$TPU" "${where[@]}" --worker="$1" --command "$2"
}

case $command in
  create)
    if [[ -z ${ACCELERATOR:-} || -z ${VERSION:-} ]]; then
      echo "error: set ACCELERATOR (the TPU type, e.g. v5p-64) and VERSION (the runtime image, e.g." \
        "v2-alpha-tpuv5 for v5p, v2-alpha-tpuv6e for v6e)" >&2
      exit 2
    fi
    gcloud compute tpus queued-resources create "$TPU" --node-id "$TPU" "${where[@]}" \
      --accelerator-type "$ACCELERATOR" --runtime-version "$VERSION" "$@"
    echo "requested; when 'bash launch/tpu_vm_pod.sh status' says ACTIVE, run setup"
    ;;
  setup)
    repo=${REPO:-$(git -C "$root" remote get-url origin 2>/dev/null || true)}
    if [[ -z $repo ]]; then
      echo "error: no REPO: set REPO to a URL the workers can clone (this checkout has no 'origin' remote)" >&2
      exit 2
    fi
    commit=${COMMIT:-$(git -C "$root" rev-parse HEAD)}
    commit=$(git -C "$root" rev-parse --verify "$commit^{commit}" 2>/dev/null || echo "$commit")
    python_version=${PYTHON_VERSION:-3.12}
    if [[ ! $commit =~ ^[0-9a-f]{7,40}$ || ! $python_version =~ ^3\.[0-9]+(\.[0-9]+)?$ ]]; then
      echo "error: COMMIT must be a commit of this checkout or a hash, PYTHON_VERSION like 3.12" >&2
      exit 2
    fi
    [[ -z $(git -C "$root" status --porcelain --untracked-files=no) ]] ||
      echo "warning: uncommitted changes in $root are not deployed (workers get $commit)" >&2
    [[ -n $(git -C "$root" branch -r --contains "$commit" 2>/dev/null) ]] ||
      echo "warning: $commit is on no remote branch here: push it, or workers cannot fetch it" >&2
    ssh_workers all "set -euo pipefail
      export PATH=\"\$HOME/.local/bin:\$PATH\"
      command -v uv >/dev/null || curl -LsSf https://astral.sh/uv/install.sh | sh
      [ -d ~/mlra_jax/.git ] || git clone --quiet $(printf %q "$repo") ~/mlra_jax
      cd ~/mlra_jax
      git remote set-url origin $(printf %q "$repo")
      git fetch --quiet origin
      git cat-file -e $commit^{commit} 2>/dev/null || git fetch --quiet origin $commit
      git checkout --force --quiet $commit
      uv venv --quiet --allow-existing --python $python_version .venv
      uv pip install --quiet --python .venv/bin/python -e '.[tpu,gcs]'
      echo \"\$(hostname): mlra_jax at \$(git rev-parse HEAD), \$(.venv/bin/python --version)\""
    ;;
  run)
    [[ $# -ge 1 ]] || { echo "error: run needs the training arguments, e.g. run --experiment=mlra4_2p9b" \
      "--workdir=/mnt/shared/runs/mlra4" >&2; exit 2; }
    if [[ ${PREFLIGHT:-1} != 0 ]]; then
      accelerator=${ACCELERATOR:-$(gcloud compute tpus tpu-vm describe "$TPU" "${where[@]}" \
        --format='value(acceleratorType)' 2>/dev/null || true)}
      if [[ -z $accelerator ]]; then
        echo "error: the pre-flight compile needs the slice's type: set ACCELERATOR (e.g. v5p-64), or" \
          "PREFLIGHT=0 to start without it" >&2
        exit 2
      fi
      echo "pre-flight: compiling the train step for $accelerator on worker 0 (PREFLIGHT=0 skips it)"
      if ! ssh_workers 0 "cd ~/mlra_jax && .venv/bin/python -m mlra_jax.train \
          --compile_for=$(printf %q "$accelerator")$(printf ' %q' "$@")"; then
        echo "error: the pre-flight compile for $accelerator refused this run (its message is above);" \
          "nothing was started" >&2
        exit 2
      fi
    fi
    ssh_workers all "set -euo pipefail
      cd ~/mlra_jax
      if [ -f $pidfile ] && kill -0 \"\$(cat $pidfile)\" 2>/dev/null; then
        echo \"\$(hostname): already training (pid \$(cat $pidfile)): stop it first\" >&2; exit 1
      fi
      echo \"=== \$(date -Is) mlra_jax \$(git rev-parse --short HEAD): train$(printf ' %q' "$@")\" >> $log
      setsid nohup .venv/bin/python -m mlra_jax.train --distributed$(printf ' %q' "$@") >> $log 2>&1 < /dev/null &
      echo \$! > $pidfile
      echo \"\$(hostname): training (pid \$!), log $log\""
    ;;
  logs)
    [[ $# -le 1 && ${1:-0} =~ ^[0-9]+$ && ${LOG_LINES:-100} =~ ^[0-9]+$ ]] ||
      { echo "error: logs takes one worker number (e.g. logs 3) and LOG_LINES a number" >&2; exit 2; }
    ssh_workers "${1:-0}" "tail -n ${LOG_LINES:-100} -F $log"
    ;;
  status)
    gcloud compute tpus queued-resources describe "$TPU" "${where[@]}" --format='value(state.state)'
    ssh_workers all "if [ -f $pidfile ] && kill -0 \"\$(cat $pidfile)\" 2>/dev/null; then
        echo \"\$(hostname): training (pid \$(cat $pidfile))\"; else echo \"\$(hostname): not training\"; fi
      tail -n 1 $log 2>/dev/null || true"
    ;;
  stop)
    ssh_workers all "if [ -f $pidfile ] && kill -TERM \"\$(cat $pidfile)\" 2>/dev/null; then
        echo \"\$(hostname): SIGTERM sent: training saves a checkpoint and exits\"; else
        echo \"\$(hostname): not training\"; fi"
    ;;
  delete)
    gcloud compute tpus queued-resources delete "$TPU" "${where[@]}" --force --quiet
    ;;
esac
