"""Train an experiment: `python -m mlra_jax.train --experiment=mlra4_tiny`.

This first version takes optimizer steps on a fixed synthetic batch (a smoke run
of the recipe); data, checkpoints and meshes come with the training pipeline.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
from flax import nnx

from experiments import get_experiment
from mlra_jax.config import ConfigError
from mlra_jax.model import count_params, init_model
from mlra_jax.optim import make_optimizer
from mlra_jax.train_step import make_train_step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlra_jax.train", description=__doc__)
    parser.add_argument("--experiment", required=True, help="experiment name (python -m mlra_jax.info --list)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps to take")
    parser.add_argument("--batch_size", type=int, default=4)
    args = parser.parse_args(argv)
    try:
        experiment = get_experiment(args.experiment)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    cfg, train = experiment.model, experiment.train
    model = init_model(cfg, seed=train.seed)
    print(f"{experiment.name}: {count_params(model):,} parameters on {jax.devices()[0].platform}")
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(train)
    opt_state = optimizer.init(params)
    step = jax.jit(make_train_step(graphdef, optimizer))
    tokens = jax.random.randint(jax.random.key(train.seed), (args.batch_size, train.seq_len + 1), 0, cfg.vocab_size)
    start = time.time()
    for i in range(args.steps):
        params, opt_state, metrics = step(params, opt_state, tokens)
        print(f"step {i + 1:4d}  loss {float(metrics['loss']):.4f}  grad_norm {float(metrics['grad_norm']):.3f}  "
              f"{time.time() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
