"""No TPU runtime on a machine without a TPU: importing mlra_jax keeps JAX from loading libtpu there, and the
platform list it sets keeps the GPU plugins."""

import importlib.util
import os
import subprocess
import sys

import pytest

from mlra_jax import backends

TPU_NOISE = ("E0000", "accelerator type", "TPU_WORKER_HOSTNAMES")


def test_the_platforms_keep_the_gpu_plugins(monkeypatch):
    monkeypatch.setattr(backends, "_plugin_names", lambda: ["xla_cuda12"])
    assert backends.platforms_without_tpu() == "cuda,cpu"
    monkeypatch.setattr(backends, "_plugin_names", lambda: [])
    assert backends.platforms_without_tpu() == "cpu"
    monkeypatch.setattr(backends, "_plugin_names", lambda: ["xla_cuda12", "some_other_accelerator"])
    assert backends.platforms_without_tpu() is None  # an unknown plugin: JAX chooses as it would


def test_tpu_settings_count_as_a_tpu(monkeypatch):
    monkeypatch.setenv("TPU_ACCELERATOR_TYPE", "v5p-8")
    assert backends.tpu_may_be_attached()


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the test extra) not installed")
@pytest.mark.skipif(backends.tpu_may_be_attached(), reason="a TPU is attached here")
def test_no_tpu_runtime_starts_without_a_tpu():
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    code = "import mlra_jax, jax; print(jax.default_backend(), jax.config.jax_platforms)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert not [noise for noise in TPU_NOISE if noise in result.stdout + result.stderr], result.stderr
    assert result.stdout.split()[1] in ("cpu", "cuda,cpu")


@pytest.mark.tpu
@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu (the test extra) not installed")
@pytest.mark.skipif(backends.tpu_may_be_attached(), reason="a TPU is attached here")
def test_compiling_for_a_slice_loads_libtpu_quietly_and_leaves_no_settings():
    code = (
        "import os, mlra_jax\n"
        "from mlra_jax.tpu_topology import parse_topology, topology_devices\n"
        "print(len(topology_devices(parse_topology('v5e-4'))), len(topology_devices(parse_topology('v5p-8'))))\n"
        "print('TPU_ACCELERATOR_TYPE' in os.environ, 'TPU_WORKER_HOSTNAMES' in os.environ)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("TPU_")}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["4", "4", "False", "False"]  # one device per chip; child processes see none
    assert not [noise for noise in TPU_NOISE if noise in result.stdout + result.stderr], result.stderr
