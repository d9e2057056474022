"""Decoding: caches, absorbed steps, left padding, sampling, generation and its errors."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import GPT2, micro_experiment
from mlra_jax.experiments.paper_tables import TABLE_VARIANTS, analysis_config
from mlra_jax.experiments.tiny import tiny_model
from test_info import TABLE1

from mlra_jax.decode.generator import GenerationError, Generator, Sampling, sample
from mlra_jax.generate import main as generate_main
from mlra_jax.kv_cache import init_cache
from mlra_jax.model import init_model
from mlra_jax.training.loop import train
from mlra_jax.variants import LATENT_VARIANTS, VARIANTS


def small(variant):
    return init_model(tiny_model(variant, n_layer=2, vocab_size=128, output_init="normal"), seed=0)


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_by_token_equals_full_forward(variant):
    model = small(variant)
    tokens = jax.random.randint(jax.random.key(0), (2, 9), 0, 128)
    full = np.asarray(model(tokens))
    generator = Generator(model, max_len=16)
    logits, state = generator.prefill(np.asarray(tokens[:, :1]).tolist())
    outputs = [logits]
    for i in range(1, 9):
        logits, state = generator.step(tokens[:, i : i + 1], state)
        outputs.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(outputs, axis=1)), full, atol=2e-5)
    assert int(state.index) == 9 and state.lengths.tolist() == [9, 9]


@pytest.mark.parametrize("variant", VARIANTS)
def test_left_padded_batch_equals_each_sequence_alone(variant):
    model = small(variant)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 128, n).tolist() for n in (3, 7, 5)]
    follow = rng.integers(0, 128, (3, 3))
    generator = Generator(model, max_len=12)
    logits, state = generator.prefill(prompts)
    batch_steps = [np.asarray(generator.step(jnp.asarray(follow[:, i : i + 1]), state)[0]) for i in range(1)]
    for i in range(3):
        step_logits, state = generator.step(jnp.asarray(follow[:, i : i + 1]), state)
        batch_steps.append(np.asarray(step_logits))
    for row, prompt in enumerate(prompts):
        alone = np.asarray(model(jnp.asarray([prompt + follow[row].tolist()])))[0]
        n = len(prompt)
        np.testing.assert_allclose(np.asarray(logits)[row, -n:], alone[:n], atol=2e-5)  # prefill, left-padded
        for i in range(3):
            np.testing.assert_allclose(batch_steps[i + 1][row, 0], alone[n + i], atol=2e-5)


def shapes_in(jaxpr):
    """Every intermediate shape of a jaxpr, sub-jaxprs (scan bodies, jits) included."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from shapes_in(inner)


@pytest.mark.parametrize("variant", sorted(LATENT_VARIANTS))
def test_absorbed_decode_never_builds_per_head_keys_or_values(variant):
    cfg = tiny_model(variant, n_layer=1, vocab_size=128, qk_nope_head_dim=40)  # d_h = 40: no other width is 40
    model = init_model(cfg)
    graphdef, params = nnx.split(model)[0], nnx.to_pure_dict(nnx.state(model, nnx.Param))
    state = init_cache(cfg, 2, 56)  # 56 cached slots: no other dimension is 56

    def per_head_kv(absorbed):
        jaxpr = jax.make_jaxpr(lambda p, t, s: nnx.merge(graphdef, p).forward_cached(t, s, absorbed))(
            params, jnp.zeros((2, 1), jnp.int32), state
        ).jaxpr
        return [s for s in shapes_in(jaxpr) if 56 in s and 40 in s]

    assert per_head_kv(absorbed=True) == []
    assert per_head_kv(absorbed=False)  # the check can see them: the unabsorbed path forms [B, 56, ..., 40]


@pytest.mark.parametrize("variant", TABLE_VARIANTS)
def test_cache_memory_per_token_is_the_papers_kv_cache(variant):
    cfg = analysis_config(variant)
    state = init_cache(cfg, batch=2, max_len=3)
    assert state.max_len == 8  # rounded up to whole TMA row tiles
    elements = sum(a.size for a in state.kv.values()) / (cfg.n_layer * 2 * state.max_len)
    assert elements / 128 == TABLE1[variant][0]


def test_sampling():
    logits = jnp.array([[0.0, 3.0, 1.0, 2.9], [5.0, 0.0, 0.0, 0.0]])
    key = jax.random.key(0)
    assert sample(logits, key, 0.0, 0, 1.0).tolist() == [1, 0]
    assert sample(logits, key, 1.0, 1, 1.0).tolist() == [1, 0]  # top-1 is greedy
    assert sample(logits, key, 1.0, 0, 0.05).tolist() == [1, 0]  # a tiny nucleus keeps the top token
    draws = jnp.stack([sample(logits, k, 2.0, 2, 1.0) for k in jax.random.split(key, 200)])
    assert set(np.asarray(draws[:, 0]).tolist()) == {1, 3}  # top-2 of row 0: tokens 1 and 3 only
    np.testing.assert_array_equal(sample(logits, key, 1.0, 0, 1.0), sample(logits, key, 1.0, 0, 1.0))


def test_generation_stops_at_eos_and_errors():
    model = small("mlra4")
    generator = Generator(model, max_len=16)
    greedy = generator.generate([[1, 2, 3]], Sampling(max_new_tokens=5, eos_id=None))[0]
    assert len(greedy) == 5
    first_seen = [i for i, token in enumerate(greedy) if token not in greedy[:i]]
    k = first_seen[-1]  # the latest position whose token appears there first
    stopped = generator.generate([[1, 2, 3]], Sampling(max_new_tokens=5, eos_id=greedy[k]))[0]
    assert stopped == greedy[: k + 1]
    with pytest.raises(
        GenerationError,
        match=r"longest prompt \(12 tokens\) plus max_new_tokens=5 exceeds the "
        r"cache length max_len=16",
    ):
        generator.generate([list(range(12))], Sampling(max_new_tokens=5))
    with pytest.raises(GenerationError, match="prompt 1 is empty"):
        generator.generate([[1], []], Sampling())
    with pytest.raises(GenerationError, match=r"token id 128, outside the vocabulary \[0, 128\)"):
        generator.generate([[1, 128]], Sampling())


@pytest.mark.slow
def test_generate_command_from_a_training_run(tmp_path, capsys):
    experiment = micro_experiment("mlra4_tiny", *GPT2, "--train.total_steps=4", "--train.eval_every=0")
    train(experiment, tmp_path, devices=jax.devices()[:1])
    assert (
        generate_main(
            [
                "--checkpoint",
                str(tmp_path),
                "--prompt",
                "Hello",
                "--prompt",
                "A longer prompt here",
                "--max_new_tokens",
                "4",
                "--json",
            ]
        )
        == 0
    )
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prompt"] for r in records] == ["Hello", "A longer prompt here"]
    assert all(r["step"] == 4 and 1 <= len(r["tokens"]) <= 4 for r in records)
    one_per_call = ["--checkpoint", str(tmp_path), "--prompt", "Hello", "--max_new_tokens", "4", "--json"]
    assert generate_main([*one_per_call, "--steps_per_call", "1"]) == 0  # one decode step per call: the same tokens
    assert json.loads(capsys.readouterr().out)["tokens"] == records[0]["tokens"]
    assert generate_main(["--checkpoint", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "is not a run directory" in capsys.readouterr().err


@pytest.mark.slow
def test_generate_command_serves_over_a_tensor_parallel_mesh(tmp_path, capsys):
    """mlra generate --tensor 4: MLRA-4's blocks as regions over 4 devices (W_UK and W_UV folded into its
    projections), the same greedy tokens as one device (float32); --data splits the prompts; too many devices exit 2
    with how many there are."""
    float32 = ("--model.compute_dtype=float32", "--train.total_steps=3", "--train.eval_every=0")
    train(micro_experiment("mlra4_tiny", *GPT2, *float32), tmp_path, devices=jax.devices()[:1])
    prompts = ["--prompt", "Hello", "--prompt", "A longer prompt here"]
    base = ["--checkpoint", str(tmp_path), *prompts, "--max_new_tokens", "6", "--json"]
    tokens = {}
    for mesh in ([], ["--tensor", "4"], ["--tensor", "2", "--data", "2"]):
        assert generate_main([*base, *mesh]) == 0
        tokens[" ".join(mesh)] = [json.loads(line)["tokens"] for line in capsys.readouterr().out.splitlines()]
    assert tokens["--tensor 4"] == tokens[""] and tokens["--tensor 2 --data 2"] == tokens[""], tokens
    assert generate_main([*base, "--tensor", "16"]) == 2
    assert f"--tensor 16 x --data 1 needs 16 devices; this process has {len(jax.local_devices())}" in (
        capsys.readouterr().err
    )
