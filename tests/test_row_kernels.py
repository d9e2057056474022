"""The batch-1 row kernels (pallas_kernels.row_products_gpu and latent_rows_gpu) against their jnp references:
in Pallas interpret mode on CPU (both engines, K tails, offsets), compiled on a GPU at the 2.9B models' shapes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import on_gpu
from mlra_jax.pallas_kernels import latent_rows_gpu as latent_rows
from mlra_jax.pallas_kernels import row_products_gpu as rows
from mlra_jax.pallas_kernels.row_products_gpu import Tiling

BF16 = jnp.bfloat16
# (N, K, tiling): each engine and option over whole K tiles and over a K tail (1408 = 5 x 256 + 128, or unrolled
# 1024 + 256 + 128; 208 = 128 + 64 + 16 below a 256-wide tile)
CASES = [
    (96, 384, Tiling("fma", 8, 128)),
    (64, 1408, Tiling("fma", 4, 256, prefetch=2)),
    (32, 208, Tiling("fma", 2, 256, unroll=True)),
    (16, 1408, Tiling("fma", 1, 1024, num_warps=8, unroll=True)),
    (96, 384, Tiling("dot", 16, 128)),
    (64, 1408, Tiling("dot", 32, 256)),
    (32, 208, Tiling("dot", 16, 256)),
]


def assert_close(got, expected, dtype):
    """Equal up to one rounding of `dtype` (the kernels and XLA sum in different orders)."""
    got, expected = np.asarray(got, np.float32), np.asarray(expected, np.float32)
    assert got.shape == expected.shape and np.all(np.isfinite(got))
    ulp = 2.0**-7 if dtype == BF16 else 1e-5
    np.testing.assert_allclose(got, expected, rtol=ulp, atol=ulp * np.abs(expected).max())


def assert_added(got, expected, residual):
    """matvec_add's result: the residual plus a bf16 product, equal up to one rounding of the product."""
    assert_close(got - residual, expected - residual, BF16)


def inputs(n, k, seed, dtype=BF16):
    keys = jax.random.split(jax.random.key(seed), 5)
    return (
        3 * jax.random.normal(keys[0], (k,), jnp.float32),  # a residual row (float32)
        1 + 0.1 * jax.random.normal(keys[1], (k,), jnp.float32),  # norm scale
        (0.05 * jax.random.normal(keys[2], (n, k))).astype(dtype),
        (0.05 * jax.random.normal(keys[3], (2, n, k))).astype(dtype),
        jax.random.normal(keys[4], (n,), jnp.float32),
    )


@pytest.mark.parametrize(
    "n, k, tiling",
    CASES,
    ids=lambda c: (
        f"{c.engine}{c.block_rows}x{c.block_k}p{c.prefetch}u{int(c.unroll)}" if isinstance(c, Tiling) else str(c)
    ),
)
def test_row_products_in_interpret_mode(n, k, tiling):
    x, scale, w, w2, residual = inputs(n, k, n + k)
    assert_close(
        rows.norm_matvec(x, w, scale, extra=1.3, tiling=tiling, interpret=True),
        rows.norm_matvec_reference(x, w, scale, extra=1.3),
        BF16,
    )
    assert_close(
        rows.swiglu_norm_matvec(x, w2, scale, tiling=tiling, interpret=True),
        rows.swiglu_norm_matvec_reference(x, w2, scale),
        BF16,
    )
    h = x.astype(BF16)
    assert_added(
        rows.matvec_add(h, w, residual, tiling=tiling, interpret=True),
        rows.matvec_add_reference(h, w, residual),
        residual,
    )


def test_norm_matvec_reads_its_row_at_an_offset_without_a_norm_and_returns_float32_logits():
    x, scale, w, _, _ = inputs(64, 128, 0)
    longer = jnp.concatenate([jnp.full((48,), 100.0), x, jnp.full((16,), -7.0)]).astype(BF16)
    for tiling in (Tiling("fma", 4, 64), Tiling("fma", 2, 64, unroll=True)):  # a loop, and unrolled
        assert_close(
            rows.norm_matvec(longer, w, scale, offset=48, tiling=tiling, interpret=True),
            rows.norm_matvec_reference(longer, w, scale, offset=48),
            BF16,
        )
    assert_close(
        rows.norm_matvec(longer, w, None, offset=48, interpret=True),
        rows.norm_matvec_reference(longer[48:176], w),
        BF16,
    )
    logits = rows.norm_matvec(x, w, scale, out_dtype=jnp.float32, interpret=True)
    assert logits.dtype == jnp.float32
    # float32 sums of a bf16 row, whose roundings a GPU's approximate rsqrt may flip: up to one bf16 rounding
    assert_close(logits, rows.norm_matvec_reference(x, w, scale, out_dtype=jnp.float32), BF16)


def test_float32_weights_and_the_dot_engine_that_refuses_them():
    x, scale, _, w2, _ = inputs(32, 128, 1, jnp.float32)
    assert_close(
        rows.swiglu_norm_matvec(x, w2, scale, interpret=True),
        rows.swiglu_norm_matvec_reference(x, w2, scale),
        jnp.float32,
    )
    with pytest.raises(ValueError, match="16-bit weights"):
        rows.swiglu_norm_matvec(x, w2, scale, tiling=Tiling("dot", 16, 128), interpret=True)
    with pytest.raises(ValueError, match="takes 200 values of the row from 0"):
        rows.norm_matvec(x, jnp.zeros((8, 200)), scale, interpret=True)


def test_a_k_tail_is_whole_power_of_two_tiles():
    assert rows._k_tiles(9984, 512) == (19, [(9728, 256)])
    assert rows._k_tiles(1536, 1024) == (1, [(1024, 512)])
    assert rows._k_tiles(208, 256) == (0, [(0, 128), (128, 64), (192, 16)])
    with pytest.raises(ValueError, match="multiples of 16"):
        rows._k_tiles(200, 128)


# (blocks, branches, heads per block, rank, d_h, d_h^R): MLRA-4, MLA, GLA-2, MLRA-2 layouts, small
LATENT_LAYOUTS = [(4, 4, 6, 32, 32, 32), (1, 1, 6, 64, 32, 32), (2, 1, 3, 64, 32, 32), (4, 2, 3, 32, 32, 32)]


def latent_inputs(n, branches, heads, r, dh, dr, seed=0):
    keys = jax.random.split(jax.random.key(seed), 7)
    h = n // branches * heads
    angles = jnp.arange(dr // 2) * 0.37 + 1.1
    return dict(
        q=jax.random.normal(keys[0], (h, dh + dr)).astype(BF16),
        kv_up=(0.1 * jax.random.normal(keys[1], (2, n, heads, r, dh))).astype(BF16),
        cos=jnp.cos(angles),
        sin=jnp.sin(angles),
        z=jax.random.normal(keys[2], (n, heads, r)).astype(BF16),
        projected=jax.random.normal(keys[3], (48 + n * r + dr + 16,)).astype(BF16),
        norm_scale=1 + 0.1 * jax.random.normal(keys[4], (n, r)),
        latent_cache=jax.random.normal(keys[5], (1, 40, n, r)).astype(BF16),
        k_rope_cache=jax.random.normal(keys[6], (1, 40, 1, dr)).astype(BF16),
    )


def check_latent_kernels(layout, interpret):
    """latent_queries (with the cache entry) and latent_output against their references."""
    n, branches, heads, r, *_ = layout
    a = latent_inputs(*layout)
    entry = latent_rows.LatentEntry(a["projected"], a["norm_scale"], offset=48, eps=1e-5, latent_scale=1.7)
    caches, slot = (a["latent_cache"], a["k_rope_cache"]), jnp.array([17], jnp.int32)
    got = jax.jit(
        lambda *args: latent_rows.latent_queries(
            *args, branches=branches, entry=entry, caches=caches, slot=slot, interpret=interpret
        )
    )(a["q"], a["kv_up"], a["cos"], a["sin"])
    expected = (
        *latent_rows.latent_queries_reference(a["q"], a["kv_up"], a["cos"], a["sin"], branches=branches),
        *latent_rows.write_latent_entry_reference(entry, a["cos"], a["sin"], *caches, slot),
    )
    for g, e in zip(got, expected):
        assert_close(g, e, BF16)
    for g, before in zip(got[2:], caches):  # the slot was written, no other
        assert not np.array_equal(np.asarray(g[:, 17]), np.asarray(before[:, 17]))
        np.testing.assert_array_equal(np.delete(np.asarray(g), 17, axis=1), np.delete(np.asarray(before), 17, axis=1))
    options = dict(branches=branches, branch_scale=branches**-0.5)
    assert_close(
        latent_rows.latent_output(a["z"], a["kv_up"], **options, interpret=interpret),
        latent_rows.latent_output_reference(a["z"], a["kv_up"], **options),
        BF16,
    )


@pytest.mark.parametrize("layout", LATENT_LAYOUTS, ids=["mlra4", "mla", "gla2", "mlra2"])
def test_latent_row_kernels_in_interpret_mode(layout):
    check_latent_kernels(layout, interpret=True)


def test_latent_shapes_the_kernels_refuse():
    latent_rows.check_latent_shapes(1024, 128, 64, 128)
    with pytest.raises(ValueError, match="power-of-two latent rank per block"):
        latent_rows.check_latent_shapes(1024, 96, 64, 128)
    with pytest.raises(ValueError, match="d_c' in multiples of 16"):
        latent_rows.check_latent_shapes(1000, 128, 64, 128)


@on_gpu
@pytest.mark.parametrize(
    "n, k, kind",
    [
        (1600, 3072, "norm"),
        (4608, 1024, "norm"),
        (3072, 3072, "add"),
        (9984, 3072, "swiglu"),
        (3072, 9984, "add"),
        (50304, 3072, "head"),
    ],
)
def test_row_products_on_gpu_at_the_2p9b_shapes(n, k, kind):
    x, scale, w, w2, residual = inputs(n, k, 7)
    if kind == "swiglu":
        assert_close(rows.swiglu_norm_matvec(x, w2, scale), rows.swiglu_norm_matvec_reference(x, w2, scale), BF16)
    elif kind == "add":
        h = x.astype(BF16)
        assert_added(rows.matvec_add(h, w, residual), rows.matvec_add_reference(h, w, residual), residual)
    else:
        out = jnp.float32 if kind == "head" else None
        assert_close(
            rows.norm_matvec(x, w, scale, out_dtype=out), rows.norm_matvec_reference(x, w, scale, out_dtype=out), BF16
        )


@on_gpu
@pytest.mark.parametrize(
    "layout",
    [(4, 4, 24, 128, 128, 64), (1, 1, 24, 512, 128, 64), (2, 1, 12, 256, 128, 64)],
    ids=["mlra4", "mla", "gla2"],
)
def test_latent_row_kernels_on_gpu_at_the_2p9b_shapes(layout):
    check_latent_kernels(layout, interpret=False)
