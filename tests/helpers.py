"""Small experiments and subprocess runs for the training tests; the mark of the tests that need a GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import pytest
from mlra_jax.experiments import get_experiment
from xla_test_flags import SUBPROCESS

from mlra_jax.cli import apply_overrides
from mlra_jax.data.builtin import builtin_shards
from mlra_jax.data.shards import find_shards, open_shard, write_shard

ROOT = Path(__file__).parent.parent


def on_gpu(test):
    """A test that needs an NVIDIA GPU: marked `gpu` (pytest -m gpu selects them) and skipped elsewhere."""
    return pytest.mark.gpu(pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs an NVIDIA GPU")(test))


# The micro runs' vocabulary: GPT-2's 50,304 rows made the output layer 95% of a micro step's work (0.2 s of
# its 0.21 s on a CPU, and a 40 MB checkpoint of 3.3M parameters); with 512 rows a step takes 10 ms.
SMALL_VOCAB = 512


def latent_decode_inputs(heads, dr, r, blocks, slots, dtype=None, seed=0, batch=3):
    """Random (q_rope, q_latent, k_rope, latent) of the latent decode kernels: `batch` sequences, `blocks` latent
    blocks of width r with `heads` query heads each, a RoPE width dr, `slots` cache slots (bf16 by default)."""
    dtype = dtype or jax.numpy.bfloat16
    keys = jax.random.split(jax.random.key(seed), 4)
    return (
        jax.random.normal(keys[0], (batch, blocks, heads, dr), dtype),
        jax.random.normal(keys[1], (batch, blocks, heads, r), dtype),
        jax.random.normal(keys[2], (batch, slots, dr), dtype),
        jax.random.normal(keys[3], (batch, slots, blocks, r), dtype),
    )


def run_interpreted_cases(cases: Path, marker: str = "not slow") -> None:
    """The pytest cases of `cases` (a module pytest does not collect itself) in a pytest process of their own with
    PJRT_NPROC=4: Pallas's GPU interpreter runs each simulated warpgroup as an XLA CPU computation, and a barrier wait
    holds one thread of the CPU client's pool (one per core unless PJRT_NPROC says), so a kernel's three warpgroups
    can deadlock on a 2-core machine. The rest of the suite keeps the default pool."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", str(cases), "-q", "-x", "-p", "no:cacheprovider", "-m", marker],
        env={**os.environ, "PJRT_NPROC": "4"},
        cwd=cases.parents[1],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " failed" not in done.stdout, done.stdout[-2000:]


def sharded_over(model, mesh: jax.sharding.Mesh):
    """The model with its parameters placed over `mesh` as their logical axes split them."""
    from flax import nnx

    from mlra_jax.params import logical_axes
    from mlra_jax.sharding import tree_shardings

    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return nnx.merge(nnx.split(model)[0], jax.device_put(params, tree_shardings(params, logical_axes(model), mesh)))


def small_vocabulary_data() -> Path:
    """The built-in corpus's shards with each token id taken modulo SMALL_VOCAB: text-like data (the loss falls)
    for a model of SMALL_VOCAB tokens. Made once beside the built-in shards (atomically, as they are)."""
    source = builtin_shards()
    target = source.with_name(f"{source.name}-mod{SMALL_VOCAB}")
    if target.is_dir():
        return target
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        for path in find_shards(source, "*.bin"):
            write_shard(Path(tmp) / path.name, np.asarray(open_shard(path)) % SMALL_VOCAB)
        try:
            os.rename(tmp, target)
        except OSError:  # another process made it first
            if not target.is_dir():
                raise
        else:
            os.mkdir(tmp)  # TemporaryDirectory cleans up the (now moved) folder
    return target


# A model and run small enough that a step takes milliseconds on a CPU.
MICRO = [
    "--model.n_layer=1",
    "--model.n_embd=64",
    "--model.intermediate_size=64",
    "--train.seq_len=32",
    "--train.global_batch_size=8",
    "--train.total_steps=12",
    "--train.warmup_steps=2",
    "--train.peak_lr=1e-2",
    "--train.log_every=1",
    "--train.eval_every=6",
    "--train.eval_batches=2",
    "--checkpoint.every=4",
    "--checkpoint.keep=3",
    f"--model.vocab_size={SMALL_VOCAB}",
    f"--data.dataset={small_vocabulary_data()}",
]
# Back to GPT-2's vocabulary and the built-in corpus, after MICRO: for a model that reads or writes text through
# GPT-2's tokenizer (prompts, exports with the tokenizer, lm-eval, the quick start as printed)
GPT2 = ["--model.vocab_size=50304", "--data.dataset=builtin"]


def micro_experiment(name: str = "mlra4_tiny", *overrides: str):
    return apply_overrides(get_experiment(name), MICRO + list(overrides))


def train_command(workdir: Path, *overrides: str, experiment: str = "mlra4_tiny") -> list[str]:
    """[python, -m, mlra_jax.train, arguments...]."""
    return [
        sys.executable,
        "-m",
        "mlra_jax.train",
        f"--experiment={experiment}",
        f"--workdir={workdir}",
        *MICRO,
        *overrides,
    ]


def subprocess_env(devices: int = 1) -> dict[str, str]:
    env = dict(
        os.environ,
        JAX_PLATFORMS="cpu",
        PYTHONUNBUFFERED="1",
        XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {SUBPROCESS}",
    )
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


def run_training(workdir: Path, *overrides: str, devices: int = 1, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        train_command(workdir, *overrides),
        env=subprocess_env(devices),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"training failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


def logged_step(workdir: Path) -> int:
    """The newest step a run's metrics.jsonl holds (0 before its first line; a line still being written is skipped)."""
    metrics = workdir / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def saved_steps(workdir: Path) -> set[int]:
    """The checkpoints Orbax has finished (it writes each under a temporary name, renamed to the step when done)."""
    return {int(p.name) for p in (workdir / "checkpoints").glob("*") if p.name.isdigit()}


def losses(workdir: Path) -> dict[int, float]:
    """step -> logged loss (each step logged once: a resumed run rewrites what it repeats)."""
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"steps logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records}


def with_train(experiment, **changes):
    return dataclasses.replace(experiment, train=dataclasses.replace(experiment.train, **changes))


def records(workdir: Path) -> dict[int, dict]:
    """step -> the logged values that do not depend on timing."""
    timing = {"tokens_per_s", "step_time_s", "mfu"}
    lines = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k not in timing} for r in lines}


def first_batch_loss(run_dir, experiment) -> float:
    """The loss of the newest checkpoint of `run_dir` on the first training batch of `experiment`."""
    import jax
    import numpy as np
    from flax import nnx

    from mlra_jax.data.pipeline import train_dataset
    from mlra_jax.generate import load_model
    from mlra_jax.training.step import loss_fn

    model, _ = load_model(run_dir)
    first = np.asarray(
        train_dataset(
            experiment.data,
            experiment.train.seq_len,
            experiment.model.vocab_size,
            experiment.train.seed,
            experiment.train.global_batch_size,
        )[0]
    )
    graphdef, params = nnx.split(model, nnx.Param)
    return float(jax.jit(loss_fn, static_argnums=0)(graphdef, nnx.to_pure_dict(params), first))


def loss_and_grads(cfg, tokens, mesh=None):
    """The training loss of a fresh model of `cfg` (seed 0) on `tokens` and its gradients, jitted; under `mesh` with
    the parameters and tokens sharded as the trainer shards them."""
    from flax import nnx

    from mlra_jax.model import init_model
    from mlra_jax.params import logical_axes
    from mlra_jax.sharding import batch_sharding, tree_shardings
    from mlra_jax.training.step import loss_fn

    model = init_model(cfg, seed=0)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    value_and_grad = jax.jit(jax.value_and_grad(lambda p, t: loss_fn(graphdef, p, t)))
    if mesh is None:
        return value_and_grad(params, tokens)
    with jax.set_mesh(mesh):
        params = jax.device_put(params, tree_shardings(params, logical_axes(model), mesh))
        return value_and_grad(params, jax.device_put(tokens, batch_sharding(mesh)))
