"""mlra bench dependent_launch: its chain's arithmetic (Mosaic GPU interpret mode on CPU) and its refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mlra_jax.benchmarks import dependent_launch


def test_each_kernel_of_the_chain_adds_its_weight_tiles_to_the_last_output():
    ctas, layers = 2, 2
    shape = (layers, ctas, dependent_launch.TILES, dependent_launch.ROWS, dependent_launch.COLS)
    weights = jax.random.randint(jax.random.key(0), shape, -3, 4).astype(jnp.bfloat16)
    x = jnp.ones((ctas, dependent_launch.ROWS, dependent_launch.COLS), jnp.bfloat16)
    layer = dependent_launch.mosaic_layer("plain", ctas=ctas, interpret=True)
    got = dependent_launch.chain(layer)(weights, x)
    want = x.astype(jnp.float32) + weights.astype(jnp.float32).sum(axis=(0, 2))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))


def test_the_mixed_chain_alternates_a_triton_and_a_mosaic_kernel_of_the_same_arithmetic():
    ctas, pairs = 2, 2
    shape = (pairs, 2, ctas, dependent_launch.TILES, dependent_launch.ROWS, dependent_launch.COLS)
    weights = jax.random.randint(jax.random.key(1), shape, -3, 4).astype(jnp.bfloat16)
    x = jnp.ones((ctas, dependent_launch.ROWS, dependent_launch.COLS), jnp.bfloat16)
    layer = dependent_launch.alternating(
        dependent_launch.triton_tile_layer("plain", ctas=ctas, interpret=True),
        dependent_launch.mosaic_layer("plain", ctas=ctas, interpret=True),
    )
    got = dependent_launch.chain(layer)(weights, x)
    want = x.astype(jnp.float32) + weights.astype(jnp.float32).sum(axis=(0, 1, 3))
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want))


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kinds=cuda"], "unknown kind 'cuda'"),
        (["--layers=1"], "a chain takes at least 2 kernels"),
        (["--kinds=mixed", "--layers=5"], "an even count with kind mixed"),
        ([], "this benchmark times GPU kernels"),
    ],
)
def test_the_benchmark_refuses_bad_options_and_a_cpu(tmp_path, capsys, argv, message):
    if jax.default_backend() == "gpu" and not argv:
        pytest.skip("checks the CPU refusal")
    with pytest.raises(SystemExit) as exit_info:
        dependent_launch.main([*argv, f"--out={tmp_path / 'record.json'}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "record.json").exists()
