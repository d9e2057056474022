"""The chunked cross-entropy against the whole one: value and gradients, and no [B, T, V] array anywhere."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlra_jax.layers import einsum
from mlra_jax.loss import chunked_next_token_loss, head_logits, next_token_loss

B, T, D, V = 2, 96, 16, 300


def inputs(seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (B, T, D)),
        0.3 * jax.random.normal(keys[1], (V, D)),
        jax.random.randint(keys[2], (B, T), 0, V),
    )


def plain_loss(hidden, embedding, targets, dtype):
    """Autodiff through the whole float32 logits."""
    logits = einsum("btd,vd->btv", hidden.astype(dtype), embedding.astype(dtype), preferred_element_type=jnp.float32)
    return next_token_loss(logits, targets)


@pytest.mark.parametrize("chunk", [16, 32, 0, 40, 96])  # 40 does not divide 96 and 0 / 96 are whole: same result
def test_float32_value_and_gradients_equal_the_whole_loss(chunk):
    hidden, embedding, targets = inputs()
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))(hidden, embedding)
    loss, grads = grad(lambda h, w: chunked_next_token_loss(h, w, targets, jnp.float32, chunk))
    want, want_grads = grad(lambda h, w: plain_loss(h, w, targets, jnp.float32))
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    for got, expected in zip(grads, want_grads):
        assert got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-7)


def test_bfloat16_chunks_equal_the_whole_bfloat16_loss_and_track_float32():
    hidden, embedding, targets = inputs(1)
    grad = lambda chunk: jax.value_and_grad(
        lambda h, w: chunked_next_token_loss(h, w, targets, jnp.bfloat16, chunk), argnums=(0, 1)
    )(hidden, embedding)
    (loss, grads), (whole, whole_grads) = grad(24), grad(0)
    np.testing.assert_allclose(float(loss), float(whole), rtol=1e-6)
    for got, expected in zip(grads, whole_grads):
        assert got.dtype == jnp.float32  # float32 gradients of the float32 parameters and hidden states
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-4, atol=1e-6)
    # the bf16 products (cotangent rounded to bf16, as under torch autocast) stay close to float32
    want, want_grads = jax.value_and_grad(lambda h, w: plain_loss(h, w, targets, jnp.float32), argnums=(0, 1))(
        hidden, embedding
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-2)
    for got, expected in zip(grads, want_grads):
        assert np.linalg.norm(got - expected) / np.linalg.norm(expected) < 2e-2


def test_no_array_holds_the_whole_logits():
    hidden, embedding, targets = inputs()
    jaxpr = jax.make_jaxpr(
        jax.grad(lambda h, w: chunked_next_token_loss(h, w, targets, jnp.bfloat16, 32), argnums=(0, 1))
    )(hidden, embedding)

    def shapes(jaxpr):
        for eqn in jaxpr.eqns:
            yield from (v.aval.shape for v in eqn.outvars)
            for param in eqn.params.values():
                inner = getattr(param, "jaxpr", param)
                if hasattr(inner, "eqns"):
                    yield from shapes(inner)

    sizes = [int(np.prod(s)) for s in shapes(jaxpr.jaxpr)]
    assert max(sizes) == B * 32 * V  # one chunk's logits, never B * T * V


def test_gradients_come_from_the_forward_pass_and_scale_with_the_cotangent():
    """The head's matmul runs three times per chunk in all (logits, d_hidden, d_embedding), never again in the
    backward; the gradients equal autodiff through head_logits (bf16 cotangent) and follow the cotangent."""
    hidden, embedding, targets = inputs(2)
    fused = lambda h, w: chunked_next_token_loss(h, w, targets, jnp.bfloat16, 32)
    jaxpr = jax.make_jaxpr(jax.grad(fused, argnums=(0, 1)))(hidden, embedding)
    assert count_dots(jaxpr.jaxpr) == 3

    def autodiff(h, w):
        return next_token_loss(head_logits(h, w, jnp.bfloat16), targets)

    (loss, grads), (want, want_grads) = (
        jax.value_and_grad(f, argnums=(0, 1))(hidden, embedding) for f in (fused, autodiff)
    )
    np.testing.assert_allclose(float(loss), float(want), rtol=1e-6)
    for got, expected in zip(grads, want_grads):
        np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-3, atol=1e-6)
    tripled = jax.grad(lambda h, w: 3.0 * fused(h, w), argnums=(0, 1))(hidden, embedding)
    for got, single in zip(tripled, grads):
        np.testing.assert_allclose(np.asarray(got), 3.0 * np.asarray(single), rtol=1e-6)
    assert float(jax.jit(fused)(hidden, embedding)) == pytest.approx(float(loss), rel=1e-6)  # undifferentiated


def count_dots(jaxpr):
    total = 0
    for eqn in jaxpr.eqns:
        total += eqn.primitive.name == "dot_general"
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                total += count_dots(inner)
    return total
