"""Process setup for multi-host runs: `jax.distributed` from flags, SLURM, or JAX's own detection.

Under SLURM, JAX's auto-detection (jax/_src/clusters/cluster.py) sets local_device_ids=[SLURM_LOCALID]
on GPUs, so one task per node would drive only GPU 0 of its 8. Here the SLURM settings are computed
explicitly and JAX's detection is switched off (cluster_detection_method="deactivate", jax 0.10 and
0.11): one task per node sees every GPU of its node, one task per GPU sees GPU SLURM_LOCALID
(or the one GPU SLURM already bound it to through CUDA_VISIBLE_DEVICES).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

import jax

from mlra_jax.config import ConfigError

log = logging.getLogger(__name__)

_SLURM_REQUIRED = ("SLURM_JOB_ID", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")
_NODELISTS = ("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")


@dataclass(frozen=True)
class SlurmTask:
    coordinator: str
    num_processes: int
    process_id: int
    tasks_per_node: int
    local_device_ids: list[int] | None  # None: every device of the node

    @property
    def mode(self) -> str:
        return (
            "1 task per node, all its GPUs"
            if self.tasks_per_node == 1
            else f"{self.tasks_per_node} tasks per node, 1 GPU each"
        )


def first_host(nodelist: str) -> str:
    """'gpu[001-004],cpu1' -> 'gpu001'; 'node7,node9' -> 'node7' (what `scontrol show hostnames` lists first)."""
    match = re.match(r"([^,\[]+)(?:\[([^,\-\]]+))?", nodelist)
    if not match:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    return match.group(1) + (match.group(2) or "")


def expand_tasks_per_node(value: str) -> list[int]:
    """SLURM's compressed counts, '8(x4)' or '2(x2),1' -> [8, 8, 8, 8] or [2, 2, 1]."""
    counts: list[int] = []
    for part in value.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise ValueError(f"cannot read SLURM tasks per node {value!r}")
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts


def tasks_per_node(env: Mapping[str, str]) -> int:
    """Tasks on this task's node: the step's layout first, then the job's, else tasks / nodes."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        if env.get(name):
            counts = expand_tasks_per_node(env[name])
            node = int(env.get("SLURM_NODEID", 0))
            return counts[node] if node < len(counts) else max(counts)
    if env.get("SLURM_NTASKS_PER_NODE"):
        return int(env["SLURM_NTASKS_PER_NODE"])
    nodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 1)
    return max(1, int(env["SLURM_NTASKS"]) // nodes)


def slurm_task(env: Mapping[str, str], coordinator: str | None = None) -> SlurmTask | None:
    """This process's jax.distributed settings inside an `srun` step, or None outside SLURM."""
    nodelist = next((env[name] for name in _NODELISTS if env.get(name)), None)
    if nodelist is None or not all(env.get(name) for name in _SLURM_REQUIRED):
        return None
    if coordinator is None:  # JAX's choice: the first node, a port from the job id (JAX_COORDINATOR_PORT overrides)
        port = env.get("JAX_COORDINATOR_PORT") or str(int(env["SLURM_JOB_ID"]) % 2**12 + 65535 - 2**12 + 1)
        coordinator = f"{first_host(nodelist)}:{port}"
    per_node = tasks_per_node(env)
    bound = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    local_ids = None if per_node == 1 or len(bound) == 1 else [int(env["SLURM_LOCALID"])]
    return SlurmTask(coordinator, int(env["SLURM_NTASKS"]), int(env["SLURM_PROCID"]), per_node, local_ids)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--distributed, --coordinator, --num_processes and --process_id (launch/ passes them)."""
    parser.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() first (multi-host; see launch/); the coordinator is "
        "found automatically on TPU pods, SLURM (one task per node with all its GPUs, or one "
        "per GPU), Open MPI and Kubernetes, or given below",
    )
    parser.add_argument(
        "--coordinator",
        help="with --distributed: coordinator host:port (default: detected, or JAX_COORDINATOR_ADDRESS)",
    )
    parser.add_argument("--num_processes", type=int, help="with --distributed: number of processes")
    parser.add_argument("--process_id", type=int, help="with --distributed: this process's index")


def data_parallel_devices(batch_size: int) -> list[jax.Device]:
    """The devices for a batch of `batch_size` rows split evenly over every process and device used: the same
    number of local devices in every process, as many as divide the batch's share of a process."""
    processes, local = jax.process_count(), jax.local_device_count()
    if batch_size % processes:
        raise ValueError(f"batch_size={batch_size} does not split over {processes} processes")
    per_process = max(d for d in range(1, local + 1) if (batch_size // processes) % d == 0 and local % d == 0)
    return [d for p in range(processes) for d in [d for d in jax.devices() if d.process_index == p][:per_process]]


def initialize(coordinator: str | None = None, num_processes: int | None = None, process_id: int | None = None) -> None:
    """jax.distributed.initialize() for this cluster; explicit arguments win over what is detected."""
    if num_processes is not None and num_processes < 1:
        raise ConfigError(f"--num_processes={num_processes} must be at least 1")
    if process_id is not None and not 0 <= process_id < (num_processes or process_id + 1):
        raise ConfigError(f"--process_id={process_id} must lie in [0, --num_processes={num_processes})")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes talk over TCP; GPUs/TPUs unaffected
    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    task = slurm_task(os.environ, coordinator)
    if task is None:  # TPU pods, Open MPI, Kubernetes, or everything given: JAX's own detection
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
            )
        except ValueError as err:  # nothing given and no cluster detected (JAX: "coordinator_address should be ...")
            raise ConfigError(
                f"--distributed: {err} No cluster (TPU pod, SLURM, Open MPI, Kubernetes) was detected; give "
                f"--coordinator=HOST:PORT, --num_processes and --process_id (or JAX_COORDINATOR_ADDRESS)"
            ) from None
        source = "flags" if coordinator else "detected by JAX"
    else:
        jax.distributed.initialize(
            coordinator_address=task.coordinator,
            num_processes=task.num_processes if num_processes is None else num_processes,
            process_id=task.process_id if process_id is None else process_id,
            local_device_ids=task.local_device_ids,
            cluster_detection_method="deactivate",
        )
        source = f"SLURM, {task.mode}"
    coordinator_used = task.coordinator if task else coordinator or "detected by JAX"
    log.info(
        "distributed: process %d of %d (%s), coordinator %s, %d local devices (GPUs visible: %s), %d devices in all",
        jax.process_index(),
        jax.process_count(),
        source,
        coordinator_used,
        jax.local_device_count(),
        jax.config.read("jax_cuda_visible_devices"),
        jax.device_count(),
    )
