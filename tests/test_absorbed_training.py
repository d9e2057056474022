"""The latent family's training forms equal the plain one (expanded, keys concatenated) in float32 loss and
gradients, alone and under tensor parallelism: the absorbed attention (which runs as grouped-query attention over
the latent blocks) and the keys built in one product (test_latent_keys)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from mlra_jax.experiments import get_experiment
from mlra_jax.experiments.tiny import tiny_model
from test_fused_attention import model_loss_and_grads

from mlra_jax.attention import latent, mlra_kernel
from mlra_jax.attention.fused import KernelUnavailable, kernels_chosen
from mlra_jax.config import ConfigError, MeshConfig
from mlra_jax.model import init_model
from mlra_jax.sharding import make_mesh
from mlra_jax.training.step import loss_fn
from mlra_jax.variants import LATENT_VARIANTS


def small(variant, form="expanded", **changes):
    return tiny_model(
        variant,
        **{"n_layer": 1, "n_head": 8, "vocab_size": 128, "output_init": "normal", "latent_form": form, **changes},
    )


def loss_and_grads(cfg, tokens, mesh=None):
    return model_loss_and_grads(cfg, "auto", tokens, mesh)


def assert_equal(got, want):
    (loss, grads), (want_loss, want_grads) = got, want
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=2e-6)
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(want_grads)):
        scale = float(jnp.abs(b).max())
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(b), atol=1e-5 * scale + 1e-9, err_msg=jax.tree_util.keystr(path)
        )


PLAIN = {"latent_form": "expanded", "latent_keys": "concat"}
FORMS = {"absorbed": {"latent_form": "absorbed"}, "product_keys": {"latent_keys": "product"}}


def random_tokens(seed, shape):
    return jax.random.randint(jax.random.key(seed), shape, 0, 128)


@functools.cache
def plain_loss_and_grads(variant, seed, shape):
    """The plain form's loss and gradients on one device, shared by the forms compared with it."""
    return loss_and_grads(small(variant, **PLAIN), random_tokens(seed, shape))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("variant", LATENT_VARIANTS)
def test_form_equals_the_plain_form_in_float32(variant, form):
    got = loss_and_grads(small(variant, **{**PLAIN, **FORMS[form]}), random_tokens(0, (2, 33)))
    assert_equal(got, plain_loss_and_grads(variant, 0, (2, 33)))


@pytest.mark.parametrize(
    "variant,tp,form",
    [("mlra4", 4, "absorbed"), ("mlra2", 2, "absorbed"), ("gla4", 8, "absorbed"), ("mla", 2, "absorbed")]
    + [("mlra4", 4, "product_keys"), ("gla4", 8, "product_keys")],  # the blocks whole, and split by heads
)
def test_form_under_tensor_parallelism_equals_the_plain_form_alone(variant, tp, form):
    mesh = make_mesh(MeshConfig(data=-1, tensor=tp), jax.devices()[:8])
    got = loss_and_grads(small(variant, **{**PLAIN, **FORMS[form]}), random_tokens(1, (8, 17)), mesh)
    assert_equal(got, plain_loss_and_grads(variant, 1, (8, 17)))


def test_absorbed_attention_is_grouped_query_attention_over_the_blocks(monkeypatch):
    """MLRA-4: 4 blocks x 8 heads of queries [latent rank || RoPE] over 4 KV heads, values the blocks; the query
    is never copied per branch (no [B, T, 4, 8, d_h] array in the step)."""
    shapes = []
    original = latent.attention
    monkeypatch.setattr(
        latent, "attention", lambda q, k, v, **kw: shapes.append((q.shape, k.shape, v.shape)) or original(q, k, v, **kw)
    )
    cfg = small("mlra4", "absorbed")
    model = init_model(cfg)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tokens = jnp.zeros((2, 17), jnp.int32)
    jaxpr = jax.make_jaxpr(jax.grad(lambda p: loss_fn(graphdef, p, tokens)))(params)
    rank, rope = cfg.kv_lora_rank // 4, cfg.qk_rope_head_dim
    assert shapes == [((2, 16, 32, rank + rope), (2, 16, 4, rank + rope), (2, 16, 4, rank))]
    copied_query = (2, 16, 4, 8, cfg.qk_nope_head_dim)
    assert copied_query not in {tuple(v.aval.shape) for eqn in jaxpr.jaxpr.eqns for v in eqn.outvars}


def test_the_expanded_form_is_the_default_and_absorbed_applies_to_the_latent_family():
    assert not any(get_experiment(f"{name}_2p9b").model.trains_absorbed for name in LATENT_VARIANTS)
    assert small("mla", "absorbed").trains_absorbed and not small("mlra4", "expanded").trains_absorbed
    with pytest.raises(ConfigError, match="latent_form='absorbed' applies to the latent family"):
        tiny_model("gqa", latent_form="absorbed")


# ----------------------------------------------------------------------------- our MLRA kernel (attention.mlra_kernel)
def kernel_sized(variant, **changes):
    """A one-layer model within the MLRA kernel's constraints: latent blocks and RoPE 64 wide."""
    return small(variant, **{"form": "absorbed", "n_head": 2, "kv_lora_rank": 256, "qk_rope_head_dim": 64, **changes})


def kernel_stand_in(monkeypatch, chosen_shapes=None):
    """The kernel's jnp reference in its place, as if the device took it (the kernel itself, in interpret mode:
    mlra_attention_kernel_cases.py)."""
    from mlra_jax.pallas_kernels.mlra_attention_gpu import mlra_attention_reference

    def reference(*args, scale, groups, tuning):
        assert tuning in ("stored_ds", "recomputed_ds")  # ModelConfig.mlra_backward
        if chosen_shapes is not None:
            chosen_shapes.append((groups, *(x.shape for x in args)))
        return mlra_attention_reference(*args, scale=scale, groups=groups)[0]

    monkeypatch.setattr(mlra_kernel, "kernel", lambda: reference)
    monkeypatch.setattr(mlra_kernel, "device_problem", lambda dtype: None)


def test_the_kernels_backward_stores_ds_where_a_layers_tiles_take_at_most_8_gib():
    """mlra_backward="auto": dS stored for MLRA-4's 96 query heads and branches at 2,048 tokens up to 20 sequences a
    device and at 8,192 one; recomputed beyond; the explicit choices as given."""
    bf16 = jnp.bfloat16
    assert mlra_kernel.stored_ds_bytes(8, 96, 2048, bf16) == 8 * 96 * (32 * 33 // 2) * 64 * 64 * 2  # 3.3 GB
    assert mlra_kernel.backward_tuning("auto", mlra_kernel.stored_ds_bytes(20, 96, 2048, bf16)) == "stored_ds"
    assert mlra_kernel.backward_tuning("auto", mlra_kernel.stored_ds_bytes(21, 96, 2048, bf16)) == "recomputed_ds"
    assert mlra_kernel.backward_tuning("auto", mlra_kernel.stored_ds_bytes(1, 96, 8192, bf16)) == "stored_ds"
    assert mlra_kernel.backward_tuning("auto", mlra_kernel.stored_ds_bytes(2, 96, 8192, bf16)) == "recomputed_ds"
    assert mlra_kernel.backward_tuning("recomputed_ds", 0) == "recomputed_ds"
    assert mlra_kernel.backward_tuning("stored_ds", 1 << 40) == "stored_ds"


def test_remat_auto_counts_one_layers_stored_ds_tiles(monkeypatch):
    """remat="auto"'s estimate holds one block's stored dS tiles beside the layers' saved activations (the kernel's
    reference standing in, as on a Hopper GPU); nothing where dS is recomputed or the kernel does not run."""
    from mlra_jax.training import remat_choice

    experiment = get_experiment("mlra4_tiny")
    cfg = kernel_sized("mlra4")
    recomputed = dataclasses.replace(cfg, mlra_backward="recomputed_ds")
    with_model = lambda model: dataclasses.replace(
        experiment, model=model, train=dataclasses.replace(experiment.train, seq_len=256)
    )
    remat_choice._traced_layer.cache_clear()  # its traces depend on the device the kernel sees
    try:
        assert remat_choice.backward_workspace_bytes(cfg, 3, 256) == 0  # the CPU: no kernel
        kernel_stand_in(monkeypatch)
        remat_choice._traced_layer.cache_clear()
        tiles = mlra_kernel.stored_ds_bytes(3, cfg.n_head * 4, 256, cfg.dtype)
        assert tiles == 3 * 8 * (4 * 5 // 2) * 64 * 64 * 4  # 2 heads x 4 branches, four 64-token tiles a side
        assert remat_choice.backward_workspace_bytes(cfg, 3, 256) == tiles
        assert remat_choice.backward_workspace_bytes(recomputed, 3, 256) == 0
        for remat in ("none", "dots", "full"):
            stored_step = remat_choice.step_bytes(with_model(cfg), 0, 3, remat)
            assert stored_step == remat_choice.step_bytes(with_model(recomputed), 0, 3, remat) + tiles
    finally:
        remat_choice._traced_layer.cache_clear()


def chosen_kernels(cfg, tokens):
    with kernels_chosen() as chosen:
        loss_and_grads(cfg, tokens)
    return chosen


def test_auto_keeps_the_fused_kernels_choice_on_the_cpu():
    assert chosen_kernels(kernel_sized("mlra4"), random_tokens(0, (1, 129))) == {"xla": 1}
    with pytest.raises(KernelUnavailable, match="the backend is 'cpu'"):
        model_loss_and_grads(kernel_sized("mlra4"), "mlra_kernel", random_tokens(0, (1, 129)))


@pytest.mark.parametrize("variant, groups", [("mlra4", 1), ("mlra2", 2)])
def test_the_kernel_path_equals_the_fused_path(monkeypatch, variant, groups):
    """With the kernel (its reference standing in) the float32 loss and gradients are the XLA attention's: every
    model's tensors as they are, MLRA-2's two head groups (one head each, two branches each) the kernel's `groups`."""
    shapes = []
    kernel_stand_in(monkeypatch, shapes)
    cfg, tokens = kernel_sized(variant), random_tokens(3, (2, 129))
    assert_equal(model_loss_and_grads(cfg, "mlra_kernel", tokens), model_loss_and_grads(cfg, "xla", tokens))
    assert shapes == [(groups, (2, 2, 128, 4 // groups, 64), (2, 128, 2, 64), (2, 128, 4, 64), (2, 128, 64))]


def test_auto_takes_the_kernel_for_models_with_branches_where_it_runs(monkeypatch):
    kernel_stand_in(monkeypatch)  # as on a Hopper GPU
    tokens = random_tokens(0, (1, 129))
    assert chosen_kernels(kernel_sized("mlra4"), tokens) == {"mlra_kernel": 1}
    assert chosen_kernels(kernel_sized("mlra2"), tokens) == {"mlra_kernel": 1}
    assert chosen_kernels(small("mla", "absorbed", kv_lora_rank=64, qk_rope_head_dim=64), tokens) == {"xla": 1}
    assert chosen_kernels(kernel_sized("mlra4"), random_tokens(0, (1, 65))) == {"xla": 1}  # 64 tokens
    assert chosen_kernels(kernel_sized("mlra4", kv_lora_rank=512, qk_rope_head_dim=128), tokens) == {"xla": 1}
    assert chosen_kernels(kernel_sized("mlra4", form="expanded"), tokens) == {"xla": 1}
    with pytest.raises(KernelUnavailable, match="multiple of 128 tokens; got 64 queries"):
        model_loss_and_grads(kernel_sized("mlra4"), "mlra_kernel", random_tokens(0, (1, 65)))


def test_the_kernel_choice_names_what_it_needs():
    with pytest.raises(ConfigError, match="set --model.latent_form=absorbed"):
        small("mlra4", "expanded", attention_impl="mlra_kernel")
    with pytest.raises(ConfigError, match="set --model.latent_form=absorbed"):
        tiny_model("gqa", attention_impl="mlra_kernel")
    mesh = make_mesh(MeshConfig(data=-1, tensor=4), jax.devices()[:8])
    with pytest.raises(KernelUnavailable, match="under tensor parallelism"):
        model_loss_and_grads(kernel_sized("mlra4"), "mlra_kernel", random_tokens(1, (8, 129)), mesh)


def test_the_kernel_runs_on_each_devices_sequences_under_a_mesh(monkeypatch):
    """Under data parallelism the kernel (its reference standing in) runs in one shard_map, each device on its own
    sequences; loss and gradients are the unsharded XLA attention's."""
    shapes = []
    kernel_stand_in(monkeypatch, shapes)
    cfg, tokens = kernel_sized("mlra2"), random_tokens(4, (4, 129))
    mesh = make_mesh(MeshConfig(data=2, fsdp=2), jax.devices()[:4])
    assert_equal(model_loss_and_grads(cfg, "mlra_kernel", tokens, mesh), model_loss_and_grads(cfg, "xla", tokens))
    assert [s[1][1] for s in shapes] == [1]  # one of four sequences per device


@pytest.mark.parametrize("spec", ["btcgir", "gibtcr"])
def test_the_branch_merge_differentiates_in_the_compute_dtype(spec):
    """latent.merged_heads (W_UV and the branch sum of absorbed training, on z laid out as the XLA path or the
    kernel has it): float32 gradients equal autodiff's of the same product; in bfloat16 both gradient products
    take bf16 operands (autodiff carries the cotangent in float32 and multiplies z and W_UV in float32) and stay
    within bf16 rounding of autodiff's."""
    sizes = dict(b=2, t=8, c=4, g=1, i=3, r=16, k=8)
    keys = jax.random.split(jax.random.key(5), 3)
    z = jax.random.normal(keys[0], tuple(sizes[a] for a in spec))
    w_uv = jax.random.normal(keys[1], tuple(sizes[a] for a in "cgrik"))
    cotangent = jax.random.normal(keys[2], tuple(sizes[a] for a in "btgik"))

    def autodiff(z, w, dtype):
        out = jnp.einsum(f"{spec},cgrik->btgik", z, w, preferred_element_type=jnp.float32, precision="highest")
        return (out * 0.5).astype(dtype)

    for dtype, tolerance in ((jnp.float32, 1e-6), (jnp.bfloat16, 2e-2)):
        args = (z.astype(dtype), w_uv.astype(dtype))
        got_out, vjp = jax.vjp(lambda z, w: latent.merged_heads(z, w, spec, 0.5, dtype), *args)
        want_out, want_vjp = jax.vjp(lambda z, w: autodiff(z, w, dtype), *args)
        np.testing.assert_array_equal(np.asarray(got_out, np.float32), np.asarray(want_out, np.float32))
        for got, want in zip(vjp(cotangent.astype(dtype)), want_vjp(cotangent.astype(dtype))):
            assert got.dtype == dtype
            scale = float(jnp.abs(want.astype(jnp.float32)).max())
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(want, np.float32), atol=tolerance * scale
            )
    backward = jax.make_jaxpr(vjp)(cotangent.astype(jnp.bfloat16))
    dots = [e for e in backward.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 2 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars)
    autodiff_backward = jax.make_jaxpr(want_vjp)(cotangent.astype(jnp.bfloat16))
    assert any(
        v.aval.dtype == jnp.float32
        for e in autodiff_backward.jaxpr.eqns
        if e.primitive.name == "dot_general"
        for v in e.invars
    )


def test_the_auto_form_trains_absorbed_where_the_kernel_runs(monkeypatch):
    """latent_form="auto" (the default): absorbed on our MLRA kernel where it takes the call (its reference standing
    in, as on a Hopper GPU), with the expanded form's loss and gradients; expanded wherever it does not (the CPU,
    64 tokens, a model without branches, another attention_impl)."""
    absorbed = []
    original = latent.LatentAttention.absorbed_attention

    def counted(self, *args):
        absorbed.append(self.branches)
        return original(self, *args)

    monkeypatch.setattr(latent.LatentAttention, "absorbed_attention", counted)
    tokens = random_tokens(3, (2, 129))
    auto = kernel_sized("mlra4", form="auto")
    assert chosen_kernels(auto, tokens) == {"xla": 1} and absorbed == []  # the CPU
    kernel_stand_in(monkeypatch)
    assert chosen_kernels(auto, tokens) == {"mlra_kernel": 1} and absorbed == [4]
    assert_equal(model_loss_and_grads(auto, "auto", tokens), model_loss_and_grads(auto, "xla", tokens))
    absorbed.clear()
    assert chosen_kernels(auto, random_tokens(0, (1, 65))) == {"xla": 1}  # 64 tokens
    assert chosen_kernels(small("mla", "auto", kv_lora_rank=64, qk_rope_head_dim=64), tokens) == {"xla": 1}
    model_loss_and_grads(auto, "xla", tokens)
    assert absorbed == []
    assert kernel_sized("mlra4", form="auto", attention_impl="mlra_kernel").trains_absorbed


def test_remat_policies_keep_the_mlra_kernels_outputs_by_name():
    """The kernel's forward (traced for the GPU, not run) sits in a call that remat policies cannot see into; its
    output and logsumexp carry names that dots_attn and the policies above it keep, so that the backward does not
    run the forward again. `dots` keeps neither (it recomputes the attention)."""
    from jax._src.ad_checkpoint import saved_residuals
    from mlra_jax.pallas_kernels.mlra_attention_gpu_backward import mlra_attention

    from mlra_jax.model import REMAT_POLICIES

    args = [jnp.zeros(shape, jnp.bfloat16) for shape in ((2, 1, 128, 2, 64), (1, 128, 2, 64), (1, 128, 2, 64))]
    args.append(jnp.zeros((1, 128, 64), jnp.bfloat16))

    def loss(*x):
        return jnp.sum(jnp.sin(mlra_attention(*x, scale=0.1).astype(jnp.float32)))

    for policy, kept in [("dots_attn", 2), ("dots_attn_kv", 2), ("dots_attn_qkv", 2), ("dots", 0)]:
        residuals = saved_residuals(jax.checkpoint(loss, policy=REMAT_POLICIES[policy]), *args)
        named = [source for _, source in residuals if source.startswith("named 'mlra_attention_")]
        assert len(named) == kept, (policy, [source for _, source in residuals])
