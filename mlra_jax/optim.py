"""The paper's optimizer with optax: AdamW, warmup + cosine, global-norm clipping."""

from __future__ import annotations

import optax

from mlra_jax.config import TrainConfig


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 to peak_lr over cfg.warmup steps, cosine to min_lr_ratio * peak_lr at total_steps."""
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.peak_lr,
        warmup_steps=cfg.warmup,
        decay_steps=cfg.total_steps,
        end_value=cfg.peak_lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Clip by global norm, then AdamW with weight decay on every parameter (as the reference)."""
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            learning_rate_schedule(cfg), b1=cfg.beta1, b2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay
        ),
    )
