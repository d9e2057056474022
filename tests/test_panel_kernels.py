"""The panel kernels (pallas_kernels.panel_products_gpu: 16-128 rows times a weight) against their jnp references:
in Pallas interpret mode on CPU (split K, tiles that divide a chunk, both products), compiled on a GPU at the
2.9B models' per-device shapes at batch 64 over 4 GPUs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_gpu
from mlra_jax.pallas_kernels import panel_products_gpu as panels
from mlra_jax.pallas_kernels.panel_products_gpu import PanelTiling

BF16 = jnp.bfloat16


def assert_close(got, expected):
    """Equal up to one bf16 rounding (the kernels and XLA sum in different orders)."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    assert got.shape == expected.shape and np.all(np.isfinite(got))
    ulp = 2.0**-7
    np.testing.assert_allclose(got, expected, rtol=ulp, atol=ulp * np.abs(expected).max())


def inputs(m, k, n, seed):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], (m, k)).astype(BF16),
        (0.05 * jax.random.normal(keys[1], (k, n))).astype(BF16),
        (0.05 * jax.random.normal(keys[2], (k, 2, n))).astype(BF16),
    )


# (M, K, N, tiling): K whole in one program; K split in 2 chunks of 4 tiles; K split in 3 chunks of 192, walked
# in tiles of 64 (the largest power of two up to block_k that divides 192)
@pytest.mark.parametrize(
    "m, k, n, tiling",
    [
        (16, 256, 64, PanelTiling(block_n=32, block_k=128)),
        (64, 512, 128, PanelTiling(block_n=64, block_k=64, split_k=2)),
        (32, 576, 64, PanelTiling(block_n=32, block_k=128, split_k=3)),
    ],
    ids=["whole_k", "split2", "split3_tail_tiles"],
)
def test_panel_products_in_interpret_mode(m, k, n, tiling):
    x, w, w2 = inputs(m, k, n, 0)
    assert_close(panels.panel_matmul(x, w, tiling=tiling, interpret=True), panels.panel_matmul_reference(x, w))
    assert_close(
        panels.swiglu_panel_matmul(x, w2, tiling=tiling, interpret=True), panels.swiglu_panel_matmul_reference(x, w2)
    )


def test_a_chunk_walks_the_largest_dividing_tile():
    assert PanelTiling(block_k=128, split_k=3).chunk_tile(576) == (192, 64)
    assert PanelTiling(block_k=256, split_k=4).chunk_tile(3072) == (768, 256)
    assert PanelTiling(block_k=128, split_k=3).chunk_tile(2496) == (832, 64)


def test_the_default_tiling_gives_every_sm_a_program():
    for k, n, groups in [(3072, 1216, 1), (1024, 4608, 1), (3072, 2496, 2), (2496, 3072, 1), (3072, 3072, 1)]:
        t = panels.default_tiling(k, n, groups)
        assert (n // t.block_n) * t.split_k >= 132 or t.split_k == 8, (k, n, t)
        assert panels.panel_problem(jnp.zeros((64, k), BF16), jnp.zeros((k, groups, n), BF16), t) is None


@pytest.mark.parametrize(
    "m, k, n, dtype, words",
    [
        (8, 256, 64, BF16, "multiples of 16"),
        (256, 256, 64, BF16, "multiples of 16 from 16 to 128"),
        (16, 256, 64, jnp.float32, "16-bit"),
        (16, 256, 48, BF16, "block_n"),
    ],
)
def test_shapes_the_panel_kernels_refuse(m, k, n, dtype, words):
    x, w = jnp.zeros((m, k), dtype), jnp.zeros((k, n), dtype)
    assert words in panels.panel_problem(x, w, PanelTiling(block_n=32))
    with pytest.raises(ValueError, match="panel_matmul"):
        panels.panel_matmul(x, w, tiling=PanelTiling(block_n=32), interpret=True)


@on_gpu
@pytest.mark.parametrize(
    "k, n, kind",
    [
        (3072, 1216, "plain"),
        (1024, 4608, "plain"),
        (3072, 3072, "plain"),
        (3072, 2496, "swiglu"),
        (2496, 3072, "plain"),
    ],
)
def test_panel_products_on_gpu_at_the_2p9b_shapes(k, n, kind):
    x, w, w2 = inputs(64, k, n, 3)
    if kind == "swiglu":
        assert_close(panels.swiglu_panel_matmul(x, w2), panels.swiglu_panel_matmul_reference(x, w2))
    else:
        assert_close(panels.panel_matmul(x, w), panels.panel_matmul_reference(x, w))
