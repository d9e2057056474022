"""Every variant trains: AdamW steps on a tiny batch make the loss fall."""

import jax
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments.tiny import tiny_model

from mlra_jax.config import TrainConfig
from mlra_jax.model import init_model
from mlra_jax.optim import learning_rate_schedule, make_optimizer
from mlra_jax.training.step import make_train_step
from mlra_jax.variants import VARIANTS

STEPS = 25


def train_losses(cfg):
    model = init_model(cfg, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    optimizer = make_optimizer(TrainConfig(total_steps=STEPS, warmup_steps=3, peak_lr=1e-2, seq_len=32))
    opt_state = optimizer.init(params)
    step = jax.jit(make_train_step(graphdef, optimizer))
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
    losses = []
    for _ in range(STEPS):
        params, opt_state, _, metrics = step(params, opt_state, {}, tokens)
        losses.append(float(metrics["loss"]))
    return losses


@pytest.mark.parametrize("variant", VARIANTS)
def test_loss_falls(variant):
    losses = train_losses(tiny_model(variant, n_layer=2, n_embd=64, intermediate_size=128, vocab_size=256))
    assert np.isfinite(losses).all()
    assert losses[0] == pytest.approx(np.log(256), abs=0.05)  # zero output projections: uniform start
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "options",
    [dict(gated=True), dict(latent_scale=False), dict(output_init="normal"), dict(compute_dtype="bfloat16")],
    ids=str,
)
def test_options_train(options):
    losses = train_losses(tiny_model("mlra4", n_layer=2, n_embd=64, intermediate_size=128, vocab_size=256, **options))
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0]


def test_schedule_is_the_papers():
    schedule = learning_rate_schedule(TrainConfig())
    assert float(schedule(0)) == 0.0
    assert float(schedule(1000)) == pytest.approx(0.8e-4)
    assert float(schedule(2000)) == pytest.approx(1.6e-4)
    assert float(schedule(51000)) == pytest.approx(0.55 * 1.6e-4, rel=1e-4)  # cosine midpoint
    assert float(schedule(100_000)) == pytest.approx(1.6e-5)


def test_gradient_accumulation_matches_one_big_batch():
    cfg = tiny_model("mlra4", n_layer=2, n_embd=64, intermediate_size=128, vocab_size=256)
    graphdef, params = nnx.split(init_model(cfg, seed=0), nnx.Param)
    optimizer = make_optimizer(TrainConfig(total_steps=10, warmup_steps=1, peak_lr=1e-2, seq_len=16))
    tokens = jax.random.randint(jax.random.key(2), (8, 17), 0, 256)
    results = []
    for steps in (1, 4):
        step = jax.jit(make_train_step(graphdef, optimizer, accumulation_steps=steps))
        new_params, _, _, metrics = step(params, optimizer.init(params), {}, tokens)
        results.append((jax.tree.leaves(new_params), metrics))
    (one, m1), (four, m4) = results
    np.testing.assert_allclose(float(m4["loss"]), float(m1["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m4["grad_norm"]), float(m1["grad_norm"]), rtol=1e-5)
    for a, b in zip(four, one):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
