"""The pure training step: next-token cross-entropy, gradients, one optimizer update.

Parameters travel as an `nnx.State` of Params; the model is rebuilt from its
graphdef inside the step, so the step is a plain function of arrays.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx


def next_token_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross-entropy in float32 of logits [B, T, V] against targets [B, T]."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def loss_fn(graphdef: nnx.GraphDef, params: nnx.State, tokens: jax.Array) -> jax.Array:
    """Loss of the model on tokens [B, T + 1] (inputs tokens[:, :-1], targets tokens[:, 1:])."""
    model = nnx.merge(graphdef, params)
    return next_token_loss(model(tokens[:, :-1]), tokens[:, 1:])


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation) -> Callable[..., Any]:
    """(params, opt_state, tokens) -> (params, opt_state, metrics), un-jitted."""

    def step(params: nnx.State, opt_state: Any, tokens: jax.Array):
        loss, grads = jax.value_and_grad(lambda p: loss_fn(graphdef, p, tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, {"loss": loss, "grad_norm": global_norm(grads)}

    return step
