"""The pure training step: next-token cross-entropy, gradient accumulation, one update.

Parameters travel as a nested dict of arrays; the model is rebuilt from its graphdef
inside the step (`nnx.merge`), so the step is a plain function of arrays that jit,
shardings and checkpoints handle directly.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from mlra_jax import fp8, fp8_casts
from mlra_jax.loss import chunked_next_token_loss
from mlra_jax.params import params_for_compute

Params = dict[str, Any]


def loss_fn(
    graphdef: nnx.GraphDef,
    params: Params,
    tokens: jax.Array,
    loss_chunk: int = 0,
    training: bool = False,
    histories: dict[str, Any] | None = None,
) -> jax.Array:
    """Loss of the model on tokens [B, T + 1] (inputs tokens[:, :-1], targets tokens[:, 1:]); the
    cross-entropy runs over chunks of `loss_chunk` positions (0: whole). `training`: the train step's loss,
    whose projections take model.matmul_dtype (FP8 where asked for and available, with delayed scaling from
    the amax `histories` when given: model.fp8_histories), and the tied head too with model.fp8_head; evaluation's
    run in the compute dtype."""
    config = nnx.merge(graphdef, params).config
    dtype = config.dtype
    model = nnx.merge(graphdef, params_for_compute(params, dtype))
    enabled = training and fp8.training_matmuls(config.matmul_dtype)
    with fp8.matmuls(enabled, histories or None, config.fp8_casts):
        hidden = model.hidden(tokens[:, :-1])
    fp8_head = config.fp8_head if enabled else "off"
    cast_kernel = fp8_head != "off" and fp8_casts.kernel_runs(config.fp8_casts)
    embedding = model.embed.embedding[...]
    return chunked_next_token_loss(hidden, embedding, tokens[:, 1:], dtype, loss_chunk, fp8_head, cast_kernel)


def gathered_weights(graphdef: nnx.GraphDef, params: Params, shardings: Any, gathered: Any) -> tuple[Params, Any]:
    """The parameters cast to the model's compute dtype (params.params_for_compute) and split into layers
    (layer_pieces), each in its gathered sharding, with the sharding their gradients are reduced into."""
    weights = params_for_compute(params, nnx.merge(graphdef, params).config.dtype)
    weights, sharded, gathered = layer_pieces(weights, shardings, gathered)
    return jax.lax.with_sharding_constraint(weights, gathered), sharded


def layer_pieces(weights: Params, shardings: Any, gathered: Any) -> tuple[Params, Any, Any]:
    """The weights with each stacked block parameter whose layer axis no mesh axis splits as a tuple of its
    layers ([1, ...] each), with those pieces' shardings: the parameters' own and gathered. Under FSDP each layer
    is then gathered and its gradient reduce-scattered on its own: no stacked copy of the gathered weights, of
    their per-layer slices or of their unreduced gradients is ever whole in memory."""

    def whole_layers(sharding: NamedSharding) -> bool:
        return not sharding.spec or sharding.spec[0] is None

    def split(leaf: jax.Array, sharding: NamedSharding) -> Any:
        return tuple(jnp.split(leaf, leaf.shape[0], axis=0)) if whole_layers(sharding) else leaf

    def repeat(leaf: jax.Array, sharding: NamedSharding) -> Any:
        return (sharding,) * leaf.shape[0] if whole_layers(sharding) else sharding

    if "blocks" not in weights:
        return weights, shardings, gathered
    blocks = weights["blocks"]
    pieces = {**weights, "blocks": jax.tree.map(split, blocks, shardings["blocks"])}
    return (
        pieces,
        {**shardings, "blocks": jax.tree.map(repeat, blocks, shardings["blocks"])},
        {**gathered, "blocks": jax.tree.map(repeat, blocks, gathered["blocks"])},
    )


def stacked_layers(tree: Params) -> Params:
    """`tree` with layer_pieces' tuples of layers concatenated back into stacked parameters."""
    if "blocks" not in tree:
        return tree
    stack = lambda x: jnp.concatenate(x, axis=0) if isinstance(x, tuple) else x
    return {**tree, "blocks": jax.tree.map(stack, tree["blocks"], is_leaf=lambda x: isinstance(x, tuple))}


def global_norm(tree: Any) -> jax.Array:
    return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def micro_batches(tokens: jax.Array, steps: int, sharding: NamedSharding | None) -> jax.Array:
    """[B, T + 1] -> [steps, B / steps, T + 1], taking rows i, i + steps, ... for micro-batch i so
    that every micro-batch stays spread over the data-parallel devices."""
    batch = tokens.shape[0]
    micro = tokens.reshape(batch // steps, steps, -1).swapaxes(0, 1)
    return micro if sharding is None else jax.lax.with_sharding_constraint(micro, sharding)


def make_train_step(
    graphdef: nnx.GraphDef,
    optimizer: optax.GradientTransformation,
    accumulation_steps: int = 1,
    micro_sharding: NamedSharding | None = None,
    loss_chunk: int = 0,
    weight_shardings: tuple[Any, Any] | None = None,
) -> Callable[..., Any]:
    """(params, opt_state, histories, tokens [B, T + 1]) -> (params, opt_state, histories, metrics), un-jitted.
    The metrics say on device whether the loss, the gradient norm and every updated parameter are finite
    (`finite`). `histories` are the FP8 amax histories (model.fp8_histories; {} without delayed scaling): their
    "gradients" are their updated values (fp8's overwrite-with-gradient convention), which replace them.

    With accumulation_steps > 1 the batch is split into micro-batches whose gradients
    are averaged in float32 (a scan, so memory holds one micro-batch of activations); their updated histories
    are merged (fp8.merge_histories: the batch's amax). Each micro-batch casts the float32 weights to the
    compute dtype as it reads them. With `weight_shardings` = (the parameters' shardings, those of the
    compute-dtype weights held through the micro-batches: under FSDP the same without `fsdp`) they are cast
    and gathered once per step, layer by layer (layer_pieces), and held through the micro-batches, whose
    gradients are reduced into the parameters' sharding in the compute dtype: the same gradients, bit for bit
    (the cast's own gradient is a cast back to float32)."""
    value_and_grad = jax.value_and_grad(
        lambda p, h, t: loss_fn(graphdef, stacked_layers(p), t, loss_chunk, training=True, histories=h),
        argnums=(0, 1),
    )

    def step(params: Params, opt_state: Any, histories: dict[str, Any], tokens: jax.Array):
        if accumulation_steps == 1:
            loss, (grads, histories) = value_and_grad(params, histories, tokens)
        else:
            held_weights = None if weight_shardings is None else gathered_weights(graphdef, params, *weight_shardings)

            def gradients(micro: jax.Array) -> tuple[jax.Array, tuple[Params, Any]]:
                if held_weights is None:
                    return value_and_grad(params, histories, micro)
                weights, sharded = held_weights
                # tied to this micro-batch, so that XLA cannot hoist copies it derives from the weights out of the
                # loop and hold them through every micro-batch (on the CPU: 0.8-1.4 GiB at 2 layers of the 2.9B)
                weights, micro = jax.lax.optimization_barrier((weights, micro))
                loss, (grads, updated) = value_and_grad(weights, histories, micro)
                grads = stacked_layers(jax.lax.with_sharding_constraint(grads, sharded))  # reduced in the compute dtype
                return loss, (jax.tree.map(lambda g: g.astype(jnp.float32), grads), updated)

            def accumulate(carry, micro):
                loss_sum, grad_sum, merged = carry
                loss, (grads, updated) = gradients(micro)
                merged = jax.tree.map(fp8.merge_histories, merged, updated)
                return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads), merged), None

            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
            (loss, grads, histories), _ = jax.lax.scan(
                accumulate,
                (jnp.zeros((), jnp.float32), zeros, jax.tree.map(jnp.zeros_like, histories)),
                micro_batches(tokens, accumulation_steps, micro_sharding),
            )
            loss, grads = loss / accumulation_steps, jax.tree.map(lambda g: g / accumulation_steps, grads)
        params, opt_state, metrics = apply_gradients(optimizer, params, opt_state, grads, loss)
        return params, opt_state, histories, metrics

    return step


def apply_gradients(
    optimizer: optax.GradientTransformation, params: Params, opt_state: Any, grads: Params, loss: jax.Array
) -> tuple[Params, Any, dict[str, jax.Array]]:
    """The update of a train step: (params, opt_state, metrics) after `grads`, with the metrics that say whether
    the loss, the gradient norm and every updated parameter are finite."""
    updates, opt_state = optimizer.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    grad_norm = global_norm(grads)
    params_finite = jnp.all(jnp.stack([jnp.isfinite(p).all() for p in jax.tree.leaves(params)]))
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & params_finite
    return params, opt_state, {"loss": loss, "grad_norm": grad_norm, "params_finite": params_finite, "finite": finite}


def micro_batch_sharding(mesh: jax.sharding.Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec(None, ("data", "fsdp"), None))
