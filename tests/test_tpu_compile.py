"""Compiling for TPU slices on this CPU machine (libtpu, from the test extra): the train step with splash
attention and the serving steps with the latent decode kernel lowered by Mosaic, the per-chip report, and the
exit-2 errors of `train --compile_for`."""

import dataclasses
import json

import pytest
from mlra_jax.experiments import get_experiment

from mlra_jax import tpu_topology
from mlra_jax.cli import apply_overrides
from mlra_jax.config import ConfigError
from mlra_jax.tpu_compile import compile_serving, mosaic_kernels
from mlra_jax.tpu_topology import parse_topology
from mlra_jax.train import main as train_main

pytest.importorskip("libtpu", reason="compiling for TPUs needs libtpu (pip install 'jax[tpu]'; in the test extra)")
pytestmark = [pytest.mark.tpu, pytest.mark.slow]

SPLASH = {"splash_mha_fwd_residuals", "splash_mha_dq_no_residuals", "splash_mha_dkv_no_residuals"}


@pytest.mark.parametrize(
    "name,generation,grid,slice_name",
    [
        ("v5p-128", "v5p", (4, 4, 4), "v5p-128"),
        ("v5e-256", "v5e", (16, 16), "v5e-256"),
        ("v4-32", "v4", (2, 2, 4), "v4-32"),
        ("v6e-64", "v6e", (8, 8), "v6e-64"),
        ("v5p:2x2x2", "v5p", (2, 2, 2), "v5p-16"),
        ("v5litepod-4", "v5e", (2, 2), "v5e-4"),
    ],
)
def test_slice_names(name, generation, grid, slice_name):
    topology = parse_topology(name)
    assert (topology.chip.generation, topology.grid, topology.slice_name) == (generation, grid, slice_name)


@pytest.mark.parametrize(
    "name,message",
    [
        ("v9-8", "unknown TPU generation 'v9'"),
        ("v5p-6", "count TensorCores"),
        ("v5e:2x2x2", "2 positive dimensions"),
        ("h100", "not a TPU slice name"),
    ],
)
def test_bad_slice_names_name_the_fix(name, message):
    with pytest.raises(ConfigError, match=message):
        parse_topology(name)


def tiny(*overrides):
    return apply_overrides(get_experiment("mlra4_tiny"), ["--model.compute_dtype=bfloat16", *overrides])


def test_train_step_compiles_for_a_tpu_slice_with_splash_lowered_by_mosaic(tmp_path, capsys):
    """The backend here is the CPU, yet the step takes splash (not interpret mode) because it compiles for a TPU;
    the report gives per-chip memory within the chip's HBM, the kernels and an estimate; the CLI exits 0."""
    out = tmp_path / "report.json"
    assert (
        train_main(
            [
                "--experiment=mlra4_tiny",
                "--compile_for=v5e-4",
                f"--compile_report={out}",
                "--model.compute_dtype=bfloat16",
                "--mesh.data=1",
                "--mesh.fsdp=-1",
            ]
        )
        == 0
    )
    report = json.loads(out.read_text())
    assert report["chosen"] == {"splash": 1} and set(report["kernels"]) == SPLASH
    assert report["fits"] and 0 < report["memory"]["total"] < report["hbm_bytes"] and report["mesh"]["fsdp"] == 4
    estimate = report["estimate"]
    assert report["flops"] > 0 and 0 < estimate["mfu_no_overlap"] < estimate["mfu"] <= 1 and estimate["step_s"] > 0
    assert report["topology"] == "v5e-4" and "fits" in capsys.readouterr().out


# The suite's persistent compilation cache holds the first GLA-2 compile's weight layout; the next one with the same
# mesh finds it, cannot load a TPU program without a TPU client, says so and compiles again.
@pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry for 'jit_prepare'")
def test_serving_steps_compile_with_the_tpu_decode_kernel():
    """MLRA-4 at TP=4 (one latent block per chip): the decode step runs the Mosaic latent decode kernel in every
    layer; the prefill chunk attends under its cache mask on XLA. GLA-2 at TP=2 x DP=2: the decode step holds no
    copy of its cache."""
    cfg = dataclasses.replace(tiny().model, n_head=8, n_layer=2)
    prefill, decode = compile_serving(cfg, parse_topology("v5e:2x2"), tp=4, batch=2, context=256, prefill_chunk=128)
    assert decode.kernels == {"latent_decode_tpu": 2} and prefill.kernels == {}
    assert decode.fits and decode.settings["bytes read per step per chip (GiB)"] > 0
    assert decode.mesh == {"data": 1, "fsdp": 1, "tensor": 4}
    gla2 = dataclasses.replace(cfg, variant="gla2")  # TP=2, batch 1: two chips of the four, batch 2: all four

    def decode_step(batch: int, context: int, chunk: int):
        return compile_serving(gla2, parse_topology("v5e:2x2"), 2, batch, context, prefill_chunk=chunk)[1]

    # (a prefill chunk of 512 tokens is longer than 256 slots: the prefill takes a chunk the cache holds)
    steps = {
        (b, context): decode_step(b, context, c) for b, context, c in ((1, 256, 128), (2, 256, 512), (2, 4096, 128))
    }
    assert [steps[b, 256].mesh for b in (1, 2)] == [
        {"data": 1, "fsdp": 1, "tensor": 2},
        {"data": 2, "fsdp": 1, "tensor": 2},
    ]
    # the cache is written in place and read where it is stored (the kernel takes the RoPE key's stored layout,
    # slots minor): no copy of it among the temporaries, which stay as they are at 16x the context
    assert steps[2, 4096].memory["temporaries"] == steps[2, 256].memory["temporaries"]
    with pytest.raises(ConfigError, match="TP=3 does not divide the 4 chips"):
        compile_serving(cfg, parse_topology("v5e:2x2"), tp=3, batch=3, context=256)


def test_a_step_that_does_not_fit_exits_2_with_what_to_change(monkeypatch, capsys):
    small_chip = dataclasses.replace(tpu_topology.CHIPS["v5e"], hbm_bytes=2**20)
    monkeypatch.setitem(tpu_topology.CHIPS, "v5e", small_chip)
    assert (
        train_main(["--experiment=mlra4_tiny", "--compile_for=v5e-4", "--model.n_layer=1", "--model.vocab_size=256"])
        == 2
    )
    err = capsys.readouterr().err
    assert "more than the 0.0 GiB of HBM per chip of v5e-4" in err and "--train.max_micro_batch_per_device" in err


def test_bad_slice_mesh_and_missing_libtpu_exit_2(monkeypatch, capsys):
    assert train_main(["--experiment=mlra4_tiny", "--compile_for=v5e-3"]) == 2
    assert "the sizes are v5e-1, v5e-4" in capsys.readouterr().err
    assert train_main(["--experiment=mlra4_tiny", "--compile_for=v5e-4", "--mesh.tensor=3"]) == 2
    assert "4 devices are not divisible by 3" in capsys.readouterr().err
    from jax.experimental import topologies

    monkeypatch.setattr(topologies, "get_topology_desc", lambda **_: (_ for _ in ()).throw(RuntimeError("no")))
    monkeypatch.setattr(tpu_topology, "_libtpu_installed", lambda: False)
    assert train_main(["--experiment=mlra4_tiny", "--compile_for=v5e-4"]) == 2
    assert "needs libtpu, which is not installed here: pip install 'jax[tpu]'" in capsys.readouterr().err


def test_mosaic_kernels_are_named_by_their_op():
    text = (
        '%a = custom-call(), custom_call_target="tpu_custom_call", metadata={op_name="jit(f)/shard_map/'
        'latent_decode_tpu/pallas_call"}\n%b = custom-call(), custom_call_target="tpu_custom_call", '
        'metadata={op_name="jit(f)/splash_mha_fwd_residuals/pallas_call"}\n'
    )
    assert mosaic_kernels(text) == {"latent_decode_tpu": 1, "splash_mha_fwd_residuals": 1}


@pytest.mark.parametrize("heads,dr,r,page", [(24, 64, 128, 64), (128, 64, 512, 128)])  # MLRA-4's block, MLA
def test_paged_decode_kernel_compiles_for_tpu(heads, dr, r, page):
    """The Mosaic TPU latent decode kernel on a paged cache (a KV block is one page), lowered by the TPU compiler
    inside a shard_map over four v5e chips, not interpreted."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from mlra_jax.pallas_kernels.latent_decode_tpu import latent_decode_tpu

    mesh = Mesh(np.array(tpu_topology.topology_devices(parse_topology("v5e:2x2"))), ("data",))
    batch, pages_per_sequence, pool = 8, 16, 4 * (2 * 16 + 4)  # two sequences per chip, spare pages
    shape = jax.ShapeDtypeStruct
    args = (
        shape((batch, 1, heads, dr), jnp.bfloat16),
        shape((batch, 1, heads, r), jnp.bfloat16),
        shape((pool, page, dr), jnp.bfloat16),
        shape((pool, page, 1, r), jnp.bfloat16),
        shape((batch,), jnp.int32),
        shape((batch,), jnp.int32),
        shape((batch, pages_per_sequence), jnp.int32),
    )

    def decode(q_rope, q_latent, k_pages, latent_pages, starts, ends, table):
        return latent_decode_tpu(q_rope, q_latent, k_pages, latent_pages, starts, ends, scale=0.1, page_table=table)

    sharded = jax.shard_map(decode, mesh=mesh, in_specs=(P("data"),) * 7, out_specs=P("data"), check_vma=False)
    compiled = jax.jit(sharded).lower(*args).compile()
    assert mosaic_kernels(compiled.as_text()) == {"latent_decode_tpu": 1}
