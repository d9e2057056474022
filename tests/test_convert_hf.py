"""mlra convert to-hf: a Hugging Face folder that transformers loads (trust_remote_code), computes
the JAX model's logits, generates with a KV cache as our Generator does, and that train --init_from starts from."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import GPT2, first_batch_loss, losses, micro_experiment  # noqa: E402
from mlra_jax.experiments.tiny import tiny_model  # noqa: E402

from mlra_jax import convert  # noqa: E402
from mlra_jax.data.tokenizer import gpt2_tokenizer  # noqa: E402
from mlra_jax.decode.generator import Generator, Sampling  # noqa: E402
from mlra_jax.interop import model_state_dict  # noqa: E402
from mlra_jax.interop.files import parse_size  # noqa: E402
from mlra_jax.interop.hf_folder import hf_fields, write_hf_folder  # noqa: E402
from mlra_jax.model import abstract_model  # noqa: E402
from mlra_jax.params import flat_params, set_flat_params  # noqa: E402
from mlra_jax.training.loop import train  # noqa: E402

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

# every variant, the gate under both of its names (c_gated in the GQA family, gated_proj elsewhere), no-scale
CASES = [
    ("mha", {}),
    ("mqa", {}),
    ("gqa", {}),
    ("mla", {}),
    ("mfa", {}),
    ("tpa", {}),
    ("gla2", {}),
    ("gla4", {}),
    ("gta", {}),
    ("mlra2", {}),
    ("mlra4", {}),
    ("gqa", {"gated": True}),
    ("mlra4", {"gated": True}),
    ("mlra2", {"latent_scale": False}),
]
IDS = [v + "".join(f"-{k}={x}" for k, x in o.items()) for v, o in CASES]
VOCAB = 512
PROMPTS = [[5, 17, 300, 42, 7, 11], [9, 100, 3]]  # different lengths: left padding
NEW_TOKENS = 6


def random_params(cfg) -> dict[str, np.ndarray]:
    """Random weights everywhere (no zero-initialized projection hides a transpose)."""
    rng = np.random.default_rng(0)
    return {k: rng.normal(0, 0.1, v.shape).astype(np.float32) for k, v in flat_params(abstract_model(cfg)).items()}


def no_output(out: Path) -> bool:
    return not out.exists() and not list(out.parent.glob(f".{out.name}.partial-*"))


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def exported(request, tmp_path_factory):
    """(JAX model, transformers model, folder) of one tiny random model exported in float32 (the command's
    own steps around write_hf_folder are tested on one run below)."""
    variant, options = request.param
    cfg = tiny_model(variant, n_layer=2, n_embd=64, intermediate_size=96, vocab_size=VOCAB, max_seq_len=64, **options)
    model = abstract_model(cfg)
    set_flat_params(model, random_params(cfg))
    folder = tmp_path_factory.mktemp(f"hf_{variant}")
    write_hf_folder(model_state_dict(model), cfg, folder, "float32", parse_size("5GB"), {"variant": variant})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(folder), trust_remote_code=True)
    return model, hf.eval(), folder


def test_config_and_logits_equal_the_jax_model(exported):
    model, hf, folder = exported
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "mlra" and config["architectures"] == ["MLRAForCausalLM"]
    assert config["auto_map"] == {
        "AutoConfig": "configuration_mlra.MLRAConfig",
        "AutoModelForCausalLM": "modeling_mlra.MLRAForCausalLM",
    }
    assert {k: config[k] for k in hf_fields(model.config)} == hf_fields(model.config)  # every field, defaults too
    assert hf.dtype == torch.float32
    bare = type(hf.config)()  # transformers builds one to diff against (logging a loaded config does)
    assert json.loads(hf.config.to_json_string())["variant"] == model.config.variant and bare.variant
    with pytest.raises(ValueError, match="needs"):
        type(hf)(type(hf.config)(variant="mla"))  # a latent variant without its ranks: named, when a model is built
    tokens = np.random.default_rng(1).integers(0, VOCAB, (2, 16))
    expected = np.asarray(model(jnp.asarray(tokens)))
    with torch.no_grad():
        got = hf(torch.tensor(tokens), use_cache=False).logits.numpy()
    assert np.abs(got - expected).max() <= 1e-4


def test_greedy_generate_with_a_cache_equals_our_generator(exported):
    model, hf, _ = exported
    ours = Generator(model, max_len=16).generate(PROMPTS, Sampling(max_new_tokens=NEW_TOKENS))
    width = max(map(len, PROMPTS))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
            return_dict_in_generate=True,
        )
    cache = out["cache"] if "cache" in out else out["past_key_values"]  # the name from transformers 5.24, before
    assert isinstance(cache, transformers.DynamicCache)
    assert cache.get_seq_length() == width + NEW_TOKENS - 1
    assert [row[width:].tolist() for row in out.sequences] == ours


def test_cached_steps_give_the_full_forward_logits(exported):
    """A prefill and then one token at a time through the cache: the logits of one forward over the sequence."""
    _, hf, _ = exported
    tokens = torch.tensor(np.random.default_rng(2).integers(0, VOCAB, (2, 9)))
    with torch.no_grad():
        full = hf(tokens, use_cache=False).logits
        cache = transformers.DynamicCache(config=hf.config)
        steps = [hf(tokens[:, :5], past_key_values=cache, use_cache=True).logits]  # the name before 5.24
        steps += [hf(tokens[:, i : i + 1], cache=cache, use_cache=True).logits for i in range(5, 9)]
    assert torch.allclose(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="not both"):
        hf(tokens[:, :1], cache=cache, past_key_values=cache)


@pytest.fixture(scope="module")
def one_folder(tmp_path_factory):
    """An MLRA-4 run of the micro experiment (GPT-2's vocabulary) and its default export."""
    root = tmp_path_factory.mktemp("hf_one")
    experiment = micro_experiment(
        "mlra4_tiny",
        *GPT2,
        "--model.n_layer=2",
        "--train.total_steps=1",
        "--train.warmup_steps=0",
        "--train.eval_every=0",
    )
    convert.write_run(root / "run", experiment, random_params(experiment.model), "test")
    assert convert.main(["to-hf", "--checkpoint", str(root / "run"), "--out", str(root / "hf")]) == 0
    return experiment, root


def test_tokenizer_encodes_as_ours(one_folder):
    _, root = one_folder
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in (root / "hf").iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(root / "hf"))
    ours = gpt2_tokenizer()
    texts = [
        "Hello world",
        "  leading and trailing  ",
        "line\n\nbreaks\r\n x",
        "numbers 12345 3.14159",
        "unicode: héllo 世界 🙂",
        "it's we'll they've I'M",
        "tabs\tand  \t spaces   \n",
        "def f(x):\n    return x",
    ]
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        assert ids == ours.encode_ordinary(text), text
        assert tokenizer.decode(ids) == text
    assert tokenizer.eos_token_id == tokenizer.bos_token_id == 50256
    assert tokenizer("<|endoftext|>The")["input_ids"] == [50256, 464]


def test_new_models_initialize_as_the_reference(one_folder):
    """from_config (pretraining in transformers): N(0, 0.02), zero output projections, RMSNorm ones, TPA's factors
    xavier-uniform on their 3-D views."""
    _, root = one_folder
    config = transformers.AutoConfig.from_pretrained(str(root / "hf"), trust_remote_code=True)
    latent = {"q_lora_rank": None, "kv_lora_rank": None, "qk_nope_head_dim": None, "qk_rope_head_dim": None}
    tpa = transformers.AutoConfig.from_pretrained(
        str(root / "hf"), trust_remote_code=True, variant="tpa", head_dim=32, tpa_rank=2, tpa_q_rank=4, **latent
    )
    torch.manual_seed(0)
    for cfg in (config, tpa):
        weights = transformers.AutoModelForCausalLM.from_config(cfg, trust_remote_code=True).state_dict()
        layer = {k.removeprefix("transformer.h.0."): v for k, v in weights.items() if k.startswith("transformer.h.0.")}
        assert not layer["attn.c_proj.weight"].any() and not layer["mlp.c_proj.weight"].any()
        assert torch.equal(layer["input_layernorm.weight"], torch.ones(cfg.n_embd))
        assert float(weights["transformer.wte.weight"].std()) == pytest.approx(0.02, rel=0.02)
    assert float(layer["mlp.c_fc1.weight"].std()) == pytest.approx(0.02, rel=0.05)
    bound = (6 / (tpa.n_head * 4 + tpa.n_embd * 4)) ** 0.5  # W_A_q viewed (in, heads, q_rank)
    assert bound * 0.98 < float(layer["attn.c_qkv.W_A_q.weight"].abs().max()) <= bound


def test_sharded_bfloat16_export_loads(one_folder, tmp_path):
    experiment, root = one_folder
    out = tmp_path / "sharded"
    assert (
        convert.main(
            ["to-hf", "--checkpoint", str(root / "run"), "--out", str(out), "--dtype", "bf16", "--shard_size", "1MB"]
        )
        == 0
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and not (out / "model.safetensors").exists()
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]  # once
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), trust_remote_code=True)
    assert hf.dtype == torch.bfloat16
    assert hf.lm_head.weight.data_ptr() == hf.transformer["wte"].weight.data_ptr()  # tied again
    float32 = transformers.AutoModelForCausalLM.from_pretrained(str(root / "hf"), trust_remote_code=True)
    for name, tensor in float32.state_dict().items():  # the float32 weights rounded to bfloat16
        assert torch.equal(hf.state_dict()[name], tensor.to(torch.bfloat16)), name


def test_train_init_from_the_hf_folder(one_folder, tmp_path):
    """The first step's loss is the exported model's loss on the first batch."""
    experiment, root = one_folder
    result = train(experiment, tmp_path / "new", devices=jax.devices()[:1], init_from=root / "hf")
    assert result.step == 1
    expected = first_batch_loss(root / "run", experiment)
    assert losses(tmp_path / "new")[1] == pytest.approx(expected, rel=1e-5)
    other = micro_experiment("mlra4_tiny", *GPT2, "--model.n_layer=2", "--model.gated=true")
    with pytest.raises(Exception, match="model.gated is False there, True here"):
        train(other, tmp_path / "other", devices=jax.devices()[:1], init_from=root / "hf")
    assert not (tmp_path / "other").exists()


@pytest.mark.parametrize("kind", ["no_run", "existing_out", "bad_shard_size", "bad_push", "bad_dtype"])
def test_errors_exit_2_and_write_nothing(one_folder, tmp_path, capsys, kind):
    _, root = one_folder
    out = tmp_path / "out"
    args = ["to-hf", "--checkpoint", str(root / "run"), "--out", str(out)]
    if kind == "no_run":
        args[2] = str(root / "hf")
    elif kind == "existing_out":
        out.mkdir()
    elif kind == "bad_shard_size":
        args += ["--shard_size", "five"]
    elif kind == "bad_push":
        args += ["--push", "not a repo"]
    else:
        args += ["--dtype", "float8"]
    if kind == "bad_dtype":
        with pytest.raises(SystemExit) as exit_:
            convert.main(args)
        assert exit_.value.code == 2 and "--dtype" in capsys.readouterr().err
    else:
        assert convert.main(args) == 2
        message = capsys.readouterr().err
        assert {
            "no_run": "is not a run directory",
            "existing_out": "exists; choose another --out",
            "bad_shard_size": "--shard_size",
            "bad_push": "is not a Hub repository id",
        }[kind] in message
    if kind == "existing_out":
        assert list(out.iterdir()) == []
    else:
        assert no_output(out)


@pytest.mark.parametrize("fails", [False, True])
def test_push_creates_the_repository_and_uploads_the_folder(one_folder, tmp_path, monkeypatch, capsys, fails):
    """--push through huggingface_hub (a stand-in HfApi here: the tests run offline)."""
    import huggingface_hub

    calls = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, **kwargs):
            files = sorted(p.name for p in Path(kwargs["folder_path"]).iterdir())
            calls.append(("upload_folder", kwargs["repo_id"], files))
            if fails:
                raise OSError("no network")
            return f"https://huggingface.co/{kwargs['repo_id']}/commit/1"

    monkeypatch.setattr(huggingface_hub, "HfApi", FakeApi)
    _, root = one_folder
    out = tmp_path / "pushed"
    code = convert.main(["to-hf", "--checkpoint", str(root / "run"), "--out", str(out), "--push", "someone/mlra4-tiny"])
    assert calls[0] == ("create_repo", "someone/mlra4-tiny", {"repo_type": "model", "exist_ok": True})
    assert calls[1][:2] == ("upload_folder", "someone/mlra4-tiny") and "model.safetensors" in calls[1][2]
    assert (out / "config.json").is_file()  # the folder is written before the upload, and kept if it fails
    if fails:
        assert code == 2 and f"hf upload someone/mlra4-tiny {out}" in capsys.readouterr().err
    else:
        assert code == 0 and "uploaded to https://huggingface.co/someone/mlra4-tiny" in capsys.readouterr().out
