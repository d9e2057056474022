"""The benchmark scripts run end to end on CPU devices and record device, command and date."""

import dataclasses
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mlra_jax.experiments import benchmarks, get_experiment
from mlra_jax.experiments.tiny import tiny_model
from xla_test_flags import IN_PROCESS

from mlra_jax.attention import attention_class
from mlra_jax.benchmarks import (
    attention_kernels,
    decode,
    decode_throughput,
    interleaved,
    latent_kernel,
    optimizer,
    row_products,
    train,
)
from mlra_jax.benchmarks.common import call_times, split_calls
from mlra_jax.metrics import attention_flops_per_token

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')


@pytest.fixture
def small_throughput_models(monkeypatch):
    models = {
        v: tiny_model(v, n_layer=1, n_head=8, vocab_size=128, compute_dtype="bfloat16", param_dtype="bfloat16")
        for v in ("gqa", "mla", "gla2", "mlra4")
    }
    models["gqa"] = tiny_model("gqa", n_layer=1, n_head=8, group_size=1, vocab_size=128, compute_dtype="bfloat16")
    monkeypatch.setattr(decode_throughput, "THROUGHPUT_MODELS", models)
    monkeypatch.setattr(decode_throughput, "whole_model", lambda v: tiny_model(v, n_layer=1, n_head=8, vocab_size=128))


@pytest.fixture
def tiny_vocabulary(monkeypatch):
    """mlra4_tiny with 512 tokens for the benchmarks that train or decode it: they feed random tokens, and GPT-2's
    50,304-row output layer was most of the work of each step they time."""
    from mlra_jax.experiments import registry

    experiment = registry.get_experiment("mlra4_tiny")
    small = dataclasses.replace(experiment, model=dataclasses.replace(experiment.model, vocab_size=512))
    monkeypatch.setitem(registry._EXPERIMENTS, "mlra4_tiny", small)


def test_decode_throughput_on_8_devices(tmp_path, small_throughput_models, monkeypatch):
    """Both scopes (one attention layer, a whole model on the serving path) on the 8 CPU devices, and the
    4-device deployment of the study on the first four."""
    assert jax.device_count() == 8
    out = tmp_path / "throughput.json"
    # a bandwidth-reference copy of 10 MB, not the CPU cap of 64 MiB (a second of each call): it scales the floors only
    argv = ["--cpu", "--contexts=64", "--repeats=1", "--copy_gb=0.01", "--steps_per_call=2", f"--out={out}"]
    decode_throughput.main([*argv, "--no_isolate"])
    record = json.loads(out.read_text())
    assert record["device_count"] == 8 and record["command"].startswith("python -m") and record["date"]
    assert all("error" not in r for r in record["results"]), record["results"]
    for scope in ("attention", "model"):
        deployed = {r["variant"]: (r["tp"], r["dp"], r["batch"]) for r in record["results"] if r["scope"] == scope}
        assert deployed == {"gqa": (8, 1, 128), "mla": (1, 8, 128), "gla2": (2, 4, 128), "mlra4": (4, 2, 128)}
    assert all(r["tokens_per_s"] > 0 for r in record["results"])
    # both scopes also time calls of steps (the attention scope's layer unrolled in one program)
    assert all(r["steps_per_call"] == 2 and r["call_step_s"] > 0 for r in record["results"])
    # the roofline of every row: bytes and FLOPs per device, the floor at the measured ceilings, the collectives
    for r in record["results"]:
        assert r["weight_bytes"] > 0 and r["cache_bytes"] > 0 and r["flops"] > 0, r
        # the compiled step's bytes per device: the cache it was handed is donated and written in place
        assert r["argument_bytes"] >= r["alias_bytes"] >= r["cache_bytes"] > 0 and r["temp_bytes"] >= 0, r
        assert r["floor_time_s"] == max(r["memory_floor_s"], r["compute_floor_s"]) > 0
        assert r["time_over_floor"] == pytest.approx(r["step_time_s"] / r["floor_time_s"])
    rows = {(r["scope"], r["variant"]): r for r in record["results"]}
    # MLA at DP=8 holds the whole cache of its 16 sequences; MLRA-4 at TP=4 x DP=2 one latent block (and the RoPE
    # key) of its 64: per device, (16 * (R_total + r)) against (64 * (R_total / 4 + r)) elements per token
    mla, mlra4 = decode_throughput.THROUGHPUT_MODELS["mla"], decode_throughput.THROUGHPUT_MODELS["mlra4"]
    per_token = {
        "mla": 16 * (mla.kv_lora_rank + mla.qk_rope_head_dim),
        "mlra4": 64 * (mlra4.kv_lora_rank // 4 + mlra4.qk_rope_head_dim),
    }
    for variant, elements in per_token.items():
        assert rows["attention", variant]["cache_bytes"] == 64 * elements * 2, variant
    assert rows["model", "mla"]["collectives"] == {}  # data parallel: nothing crosses devices
    # MLRA-4 at TP=4: per layer one all-reduce after the attention and one after the MLP, one for the embedding
    assert rows["model", "mlra4"]["collectives"] == {"all-reduce": 3} and rows["model", "mlra4"]["collective_bytes"]
    decode_throughput.main(
        [
            "--cpu",
            "--devices=4",
            "--scopes=attention",
            "--variants=gla2",
            "--contexts=64",
            "--repeats=1",
            "--copy_gb=0.01",
            f"--out={out}",
        ]
    )
    deployed = {r["variant"]: (r["tp"], r["dp"], r["batch"]) for r in json.loads(out.read_text())["results"]}
    assert deployed == {"gla2": (2, 2, 128)}
    # a context that fails (out of memory, say) is recorded after the ones measured before it
    time_step = decode_throughput.time_step
    calls = []

    def fail_second(run, repeats):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")
        return time_step(run, repeats)

    monkeypatch.setattr(decode_throughput, "time_step", fail_second)
    decode_throughput.main(
        [
            "--cpu",
            "--devices=4",
            "--scopes=attention",
            "--variants=gla2",
            "--contexts=64,128",
            "--repeats=1",
            "--copy_gb=0.01",
            f"--out={out}",
        ]
    )
    results = json.loads(out.read_text())["results"]
    assert [r["context"] for r in results] == [64, 128] and "RESOURCE_EXHAUSTED" in results[1]["error"]
    # --merge measures the failed context again and keeps the one measured before
    decode_throughput.main(
        [
            "--cpu",
            "--devices=4",
            "--scopes=attention",
            "--variants=gla2",
            "--contexts=128",
            "--repeats=1",
            "--copy_gb=0.01",
            f"--out={out}",
            "--merge",
        ]
    )
    merged = json.loads(out.read_text())
    assert [(r["variant"], r["context"]) for r in merged["results"]] == [("gla2", 64), ("gla2", 128)]
    assert merged["results"][0] == results[0] and "error" not in merged["results"][1] and len(merged["runs"]) == 2
    assert benchmarks.deployment("mlra4", 4) == (4, 1, 64) and benchmarks.deployment("gqa", 2) == (2, 1, 32)


def test_decode_throughput_refuses_a_cpu_at_once(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode_throughput.main([f"--out={tmp_path / 'throughput.json'}"])
    assert exit_info.value.code == 2 and "--cpu measures it anyway" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("variant", ["mla", "mlra4"])
def test_the_attention_scope_reads_the_latent_weights_as_serving_holds_them(variant):
    """Without TP the scope's step reads x_proj, q_up and the head-major kv_up (decode.layouts) as serving does, the
    same elements as the projections as trained; under TP, and for GQA, it runs the module's own weights."""
    from flax import nnx

    from mlra_jax.model import init_model

    latent = nnx.to_pure_dict(nnx.state(init_model(tiny_model(variant), seed=0).blocks.attn, nnx.Param))
    latent = jax.tree.map(lambda a: a[0], latent)  # one layer
    held = decode_throughput.scope_held_weights(latent, tp=1)
    assert set(held) == {"x_proj", "q_up", "kv_up"}
    assert held["kv_up"].shape[0] == 2  # W_UK and W_UV apart, head-major
    read = decode_throughput.scope_read_weights(latent, held)
    as_trained = decode_throughput.scope_read_weights(latent, None)
    size = lambda tree: sum(a.size for a in jax.tree.leaves(tree))  # noqa: E731
    assert size(read) == size(as_trained) and not {"q_down", "kv_down", "k_rope_proj"} & set(read)
    assert decode_throughput.scope_held_weights(latent, tp=2) is None
    gqa = nnx.to_pure_dict(nnx.state(init_model(tiny_model("gqa"), seed=0).blocks.attn, nnx.Param))
    assert decode_throughput.scope_held_weights(jax.tree.map(lambda a: a[0], gqa), tp=1) is None


def test_decode_throughput_refuses_calls_that_the_shortest_context_cannot_hold(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        decode_throughput.main(["--cpu", "--contexts=64,1024", "--repeats=10", f"--out={tmp_path / 'out.json'}"])
    assert exit_info.value.code == 2 and "steps_per_call x (repeats + 6) = 128" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_decode_throughput_measures_each_setting_in_a_process_of_its_own(tmp_path, monkeypatch):
    """--isolate (the default for several settings): one process per (scope, variant); a process that dies (out of
    memory) is recorded as its setting's failure, and the others' rows are kept."""
    script = (
        "import json, sys; out, variant = sys.argv[1], sys.argv[2]\n"
        "if variant == 'gqa': sys.exit(3)\n"
        "json.dump({'device': 'cpu', 'date': 'd', 'jax_version': 'j', 'devices_used': 4, "
        "'results': [{'scope': 'model', 'variant': variant, 'context': 64, 'tokens_per_s': 1.0}]}, open(out, 'w'))\n"
    )
    seen = []

    def child(args, scope, variant, out):
        seen.append((scope, variant))
        return [sys.executable, "-c", script, str(out), variant]

    monkeypatch.setattr(decode_throughput, "child_argv", child)
    out = tmp_path / "isolated.json"
    assert decode_throughput.main(["--cpu", "--scopes=model", "--variants=mla,gqa,mlra4", f"--out={out}"]) == 0
    record = json.loads(out.read_text())
    assert seen == [("model", "mla"), ("model", "gqa"), ("model", "mlra4")]
    assert [(r["variant"], "error" in r) for r in record["results"]] == [
        ("mla", False),
        ("gqa", True),
        ("mlra4", False),
    ]
    assert "exited with 3" in record["results"][1]["error"] and record["device"] == "cpu"


def test_decode_attention_and_model_modes(tmp_path, tiny_vocabulary):
    out = tmp_path / "attention.json"
    decode.main(
        [
            "attention",
            "--variants=mlra4,gqa",
            "--batch1_contexts=256",
            "--batch128_contexts=",
            "--repeats=1",
            "--copy_gb=0.01",
            f"--out={out}",
        ]
    )
    record = json.loads(out.read_text())
    assert {r["variant"] for r in record["results"]} == {"mlra4", "gqa"}
    assert record["results"][0]["bytes"] == 256 * (128 + 64) * 2 and record["copy_bandwidth_bytes_per_s"] > 0
    first_mlra4 = [r for r in record["results"] if r["variant"] == "mlra4"]
    decode.main(
        [
            "attention",
            "--variants=gqa",
            "--batch1_contexts=256",
            "--batch128_contexts=",
            "--repeats=1",
            "--copy_gb=0.01",
            f"--out={out}",
            "--merge",
        ]
    )  # re-measure GQA only, keep MLRA-4
    merged = json.loads(out.read_text())
    assert [r for r in merged["results"] if r["variant"] == "mlra4"] == first_mlra4
    assert sum(r["variant"] == "gqa" for r in merged["results"]) == 1 and len(merged["runs"]) == 2
    out = tmp_path / "model.json"
    decode.main(
        [
            "model",
            "--experiments=mlra4_tiny",
            "--batch=2",
            "--context=64",
            "--impls=xla",
            "--repeats=1",
            "--copy_gb=0.01",
            "--generate_tokens=24",
            "--timeline",
            f"--out={out}",
        ]
    )
    result = json.loads(out.read_text())["results"][0]
    assert result["tokens_per_s"] > 0 and result["weight_bytes"] > 0 and result["time_over_floor"] > 0
    assert result["generate_tokens"] == 24 and result["generate_s_per_token"] > 0
    with pytest.raises(SystemExit) as exit_info:  # as many new tokens as the context: refused before any work
        decode.main(["model", "--experiments=mlra4_tiny", "--context=64", "--generate_tokens=64", f"--out={out}"])
    assert exit_info.value.code == 2
    assert result["cache_bytes"] == 2 * 64 * (64 + 16) * 2 * 4  # batch, context, latent + RoPE key, bf16, layers


def test_profiled_calls_are_split_at_idle_gaps_and_the_median_call_gives_the_timeline():
    """Three calls of two kernels (ns), 20 ms apart, with spans of 31, 51 and 41 us: the median span, each
    kernel's median time, and the ordered kernels of the 41 us call relative to its start (us)."""
    events = []
    for call, (first, second) in enumerate([(10_000, 20_000), (20_000, 30_000), (15_000, 25_000)]):
        base = call * 20_000_000
        events += [(base + first + 1_000, base + first + 1_000 + second, "gemm"), (base, base + first, "norm")]
    calls = split_calls(events, repeats=3)
    assert [len(c) for c in calls] == [2, 2, 2] and calls[0][0][2] == "norm"
    result = call_times(calls)
    assert result["time_s"] == pytest.approx(41e-6)
    assert result["kernels_s"] == pytest.approx({"norm": 15e-6, "gemm": 25e-6})
    assert result["timeline"] == [("norm", 0.0, 15.0), ("gemm", 16.0, 25.0)]
    with pytest.raises(RuntimeError, match="found 3 calls in the GPU trace, expected 2"):
        split_calls(events, repeats=2)


def test_train_benchmark_settings(tmp_path, tiny_vocabulary):
    """TP over the 8 devices, FSDP with accumulation to a global batch, and a setting that fails is recorded."""
    out = tmp_path / "train.json"
    common = ["--experiments=mlra4_tiny", "--n_layer=1", "--seq_len=16", "--steps=1", "--warmup=0", f"--out={out}"]
    train.main([*common, "--tp=1,4", "--batch_per_device=1", "--remat=dots_attn"])
    results = json.loads(out.read_text())["results"]
    assert [(r["mesh"]["tensor"], r["mesh"]["data"], r["batch_per_device"]) for r in results] == [(1, 8, 1), (4, 2, 1)]
    assert sum(r.get("best", False) for r in results) == 1
    assert all(r["tokens_per_s"] > 0 and set(r["kernels"]) == {"xla"} and r["compiled_bytes"] > 0 for r in results)
    assert all("gpu_clocks" in r for r in results)  # None here: no nvidia-smi on a CPU machine
    assert all(r["warmup_steps"] == 0 for r in results)
    train.main([*common, "--fsdp", "--global_batch=32", "--batch_per_device=2,3", "--warmup_s=0.5"])
    fsdp, bad = json.loads(out.read_text())["results"]
    assert fsdp["mesh"]["fsdp"] == 8 and fsdp["accumulation_steps"] == 2 and fsdp["micro_batch"] == 16
    assert fsdp["fsdp_gather"] == "step" and results[0]["fsdp_gather"] is None  # remat none; no FSDP
    assert "not a multiple" in bad["error"]
    assert fsdp["warmup_steps"] >= 1  # --warmup=0: steps ran to fill --warmup_s


def test_train_benchmark_profile_sums_kernel_families_and_lists_the_longest():
    kernels = {"nvjet_sm90_tst": 3.0, "loop_add_fusion": 1.0, "entry_mosaic_gpu_kernel": 2.0, "ncclAllReduce": 0.5}
    profile = train.top_kernels({**kernels, "Memset": 0.25}, 2)
    assert profile["longest_s"] == {"nvjet_sm90_tst": 3.0, "entry_mosaic_gpu_kernel": 2.0}
    assert profile["by_family_s"] == {
        "matmul": 3.0,
        "other (fusions)": 1.0,
        "attention": 2.0,  # our MLRA kernel
        "collective": 0.5,
        "copy": 0.25,
    }
    assert train.build_parser().parse_args(["--profile", "--profile_kernels=400"]).profile_kernels == 400


def test_train_benchmark_that_measures_nothing_exits_non_zero_and_writes_beside_the_user(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not a checkout: no experiments/results/ here
    argv = ["--experiments=mlra4_tiny", "--n_layer=1", "--seq_len=16", "--steps=1", "--override=--train.seed=-1"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert "error: none of the 1 settings was measured" in err and "seed=-1 must be" in err
    assert [p.name for p in tmp_path.iterdir()] == ["bench_train.json"]


def test_train_benchmark_auto_batch_leaves_the_micro_batch_to_the_trainer():
    args = train.argparse.Namespace(
        global_batch=32, fsdp=True, n_layer=1, attention_impl="auto", seq_len=16, loss_chunk=0, override=[]
    )
    assert train.per_device_batches("2,auto") == [2, 0]
    auto = train.setting_overrides(args, 8, 1, "auto", 0)
    assert "--train.global_batch_size=32" in auto and not any("micro_batch_size" in o for o in auto)
    assert "--train.micro_batch_size=16" in train.setting_overrides(args, 8, 1, "auto", 2)
    with pytest.raises(ValueError, match="needs --global_batch"):
        train.setting_overrides(train.argparse.Namespace(**{**vars(args), "global_batch": 0}), 8, 1, "", 0)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--batch_per_device=auto"], "--batch_per_device=auto needs --global_batch"),
        (["--batch_per_device=4,x"], "is not a list of integers and 'auto'"),
        (["--profile", "--profile_kernels=0"], "--profile_kernels=0 lists no kernel; give 1 or more"),
        (["--experiments=mlra4_tiny,nope", "--global_batch=8"], "unknown experiment 'nope'; valid experiments: "),
    ],
)
def test_train_benchmark_bad_options_exit_2_with_one_message(tmp_path, capsys, argv, message):
    out = tmp_path / "train.json"
    with pytest.raises(SystemExit) as exit_info:
        train.main([*argv, f"--out={out}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err and not out.exists()


def test_optimizer_benchmark_unknown_experiment_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        optimizer.main(["--experiments=nope", f"--out={tmp_path / 'o.json'}"])
    assert exit_info.value.code == 2 and "unknown experiment 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_optimizer_benchmark_times_the_update_against_its_floor(tmp_path):
    from mlra_jax.model import abstract_model, count_params

    out = tmp_path / "optimizer.json"
    optimizer.main(["--experiments=mlra4_tiny", "--n_layer=1", "--steps=2", f"--out={out}"])
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert record["benchmark"] == "optimizer" and record["device"] == "cpu" and record["date"] and record["command"]
    model = abstract_model(tiny_model("mlra4", n_layer=1))
    assert result["n_layer"] == 1 and result["parameters"] == count_params(model)
    floor = optimizer.BYTES_PER_PARAMETER * result["parameters"] / result["copy_bandwidth_bytes_per_s"]
    assert result["floor_s"] == pytest.approx(floor) and result["passes"] == pytest.approx(result["time_s"] / floor)


def test_row_products_benchmark_reads_its_tilings_and_refuses_a_cpu(tmp_path, capsys):
    """The tune result in experiments/results names each product's fastest tiling (the chain's --tuned); the
    kernels themselves run on GPUs only, so the benchmark exits 2 here with the reason."""
    tuned = row_products.best_tilings(Path(__file__).parents[1] / "experiments/results/row_products_h100.json")
    assert tuned["gate_up"].engine == "dot" and tuned["down"].engine == "fma"  # alone; the model takes fma
    assert row_products.parse_tiling("dot,32,128,4,3") == row_products.Tiling("dot", 32, 128, 4, 3)
    assert row_products.parse_tiling("fma,1,2048,4,3,1,1") == row_products.Tiling("fma", 1, 2048, 4, unroll=True)
    assert {p.name.split(" ")[0] for p in row_products.PRODUCTS} == {"x_proj", "q_up", "o_proj", "gate_up", "down"}
    with pytest.raises(SystemExit) as exit_info:
        row_products.main(["tune", f"--out={tmp_path / 'tune.json'}"])
    assert exit_info.value.code == 2 and "run on GPUs" in capsys.readouterr().err
    assert not (tmp_path / "tune.json").exists()
    (tmp_path / "other.json").write_text('{"results": [{"product": "down"}]}')
    for argv, message in (
        (["--tuned", str(tmp_path / "missing.json")], "missing.json is not a result of"),
        (["--tuned", str(tmp_path / "other.json")], "other.json is not a result of"),
        (["--gate_up_tiling=wide,4,512"], "invalid parse_tiling value: 'wide,4,512'"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            row_products.main(["chain", *argv, f"--out={tmp_path / 'chain.json'}"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "chain.json").exists()


def test_latent_kernel_benchmark_refuses_a_cpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        latent_kernel.main(["bound", f"--out={tmp_path / 'bound.json'}"])
    assert exit_info.value.code == 2 and "Hopper GPUs" in capsys.readouterr().err
    assert not (tmp_path / "bound.json").exists()


def test_latent_kernel_merge_times_each_heads_per_cta_against_its_bytes(tmp_path, monkeypatch):
    """`mlra bench latent_kernel merge` on CPU: the merge kernel in interpret mode, a fixed timer; a row per divisor
    of the heads up to 8 and the kernel's own choice, each exact against combine, with the bytes it moves."""
    import functools
    import json

    monkeypatch.setattr(latent_kernel, "combine_gpu", functools.partial(latent_kernel.combine_gpu, interpret=True))
    monkeypatch.setattr(latent_kernel, "profiled_time", lambda fn, repeats: (fn(), {"time_s": 2e-6})[1])
    monkeypatch.setattr(latent_kernel, "MERGE_SHAPES", (("tiny", 1, 1, 3, 16, 8, 128),))
    out = tmp_path / "merge.json"
    latent_kernel.merge(out)
    rows = json.loads(out.read_text())["results"]
    assert [row["heads_per_cta"] for row in rows] == [None, 1, 2, 4, 8]
    assert all(row["chosen"] == 1 for row in rows)  # 8 CTAs of one row each on the CPU's stand-in 132 SMs
    assert all(row["max_abs_error"] < 1e-2 and row["time_s"] == 2e-6 for row in rows)
    assert rows[0]["cache_bytes"] == 8 * (3 * (128 * 2 + 4) + 128 * 2)


@pytest.mark.parametrize("experiment", ["gqa_2p9b", "mlra4_2p9b", "mla_2p9b"])
def test_attention_kernels_count_the_flops_that_mfu_counts(experiment):
    """One causal forward + backward of a layer's attention over one sequence is a layer's share of
    metrics.attention_flops_per_token for each of its tokens."""
    e = get_experiment(experiment)
    heads, dk, dv = attention_class(e.model.variant).core_shape(e.model)
    length = e.train.seq_len
    per_layer = attention_flops_per_token(e.model, length) / e.model.n_layer * length
    assert attention_kernels.model_flops(1, heads, length, dk, dv, causal=True, backward=True) == pytest.approx(
        per_layer
    )
    forward = attention_kernels.model_flops(1, heads, length, dk, dv, causal=True, backward=False)
    assert forward * 3 == pytest.approx(per_layer)
    assert attention_kernels.model_flops(1, heads, length, dk, dv, causal=False, backward=False) > 1.99 * forward


def test_attention_kernels_lays_out_the_mlra_layers_for_our_kernel():
    """MLRA-4: one head group of 4 branches over 24 heads; MLRA-2: 2 groups of 2 branches over 12 heads; the same
    heads and widths as the layer's (so the same model FLOPs); none for layers without branches or whose absorbed
    keys are wider than the trained heads'."""
    layouts = {
        "mlra4_2p9b": {"groups": 1, "blocks": 4, "heads": 24, "rank": 128, "rope": 64},
        "mlra2_2p9b": {"groups": 2, "blocks": 2, "heads": 12, "rank": 128, "rope": 64},
        "mla_2p9b": None,
        "gla2_2p9b": None,
        "gqa_2p9b": None,
    }
    for name, want in layouts.items():
        model = get_experiment(name).model
        layout = attention_kernels.mlra_layout(model)
        assert layout == want, name
        if layout:
            heads, dk, dv = attention_class(model.variant).core_shape(model)
            assert layout["groups"] * layout["blocks"] * layout["heads"] == heads
            assert (layout["rank"] + layout["rope"], layout["rank"]) == (dk, dv)


def test_attention_kernels_benchmark_refuses_a_cpu_and_bad_options(tmp_path, capsys):
    for argv, message in (
        ([], "need an NVIDIA GPU"),
        (["--experiments=gqa_2p9b,nope"], "unknown experiment 'nope'"),
        (["--batch=0"], "at least 1"),
        (["--kernels=cudnn,nope"], "--kernels='cudnn,nope': name some of cudnn, cudnn_fp8, pallas_triton, mosaic_gpu"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            attention_kernels.main([*argv, f"--out={tmp_path / 'attention.json'}"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "attention.json").exists()


def test_train_benchmark_puts_the_official_codes_best_batch_beside_ours(tmp_path, tiny_vocabulary, monkeypatch, capsys):
    """--reference: the anchor script's JSON lines (other output skipped); REF's best batch of the same variant and
    layer count, every batch it tried, and our tokens/s over its best. A file without such lines exits 2."""
    from mlra_jax.experiments import registry

    experiment = registry.get_experiment("mlra4_tiny")
    monkeypatch.setitem(registry._EXPERIMENTS, "mlra4_tiny", dataclasses.replace(experiment, reference_key="mlra_4"))
    device = jax.devices()[0].device_kind
    ref = tmp_path / "ref.jsonl"
    ref.write_text(
        "compiling...\n"
        + "\n".join(
            json.dumps(line)
            for line in [
                dict(variant="mlra_4", n_layer=1, batch=4, tokens_per_s=100.0, device=device),
                dict(variant="mlra_4", n_layer=1, batch=8, tokens_per_s=150.0, device=device),
                dict(variant="mlra_4", n_layer=1, batch=12, error="OOM"),
                dict(variant="mlra_4", n_layer=8, batch=8, tokens_per_s=9e9, device=device),
                dict(variant="mla", n_layer=1, batch=8, tokens_per_s=9e9, device=device),
            ]
        )
        + "\n"
    )
    out = tmp_path / "train.json"
    train.main(
        [
            "--experiments=mlra4_tiny",
            "--n_layer=1",
            "--seq_len=16",
            "--steps=1",
            "--batch_per_device=1",
            f"--reference={ref}",
            f"--out={out}",
        ]
    )
    record = json.loads(out.read_text())
    (result,) = record["results"]
    assert record["reference_file"] == str(ref)
    assert result["reference"] == {
        "variant": "mlra_4",
        "best_batch": 8,
        "tokens_per_s": 150.0,
        "batches": {"4": 100.0, "8": 150.0, "12": "OOM"},
        "device": device,
        "same_device": True,
        "ratio": pytest.approx(result["tokens_per_s"] / 150.0),
    }
    assert "REF 150 (batch 8):" in capsys.readouterr().out
    empty = tmp_path / "empty.jsonl"
    empty.write_text("no figures here\n")
    for bad, message in ((empty, "holds no line of the anchor script"), (tmp_path / "missing", "no such file")):
        with pytest.raises(SystemExit) as exit_info:
            train.main([f"--reference={bad}", f"--out={out}"])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_reference_annotates_a_saved_record(tmp_path, capsys):
    """REF timed in another process on the same machine: its figures are added to a saved record."""
    from mlra_jax.benchmarks import reference

    record = {
        "benchmark": "train",
        "device": "GPU X",
        "results": [
            {"experiment": "mlra4_2p9b", "n_layer": 8, "batch_per_device": 12, "tokens_per_s": 60.0},
            {"experiment": "gqa_2p9b", "n_layer": 8, "batch_per_device": 8, "tokens_per_s": 90.0},
            {"experiment": "mla_2p9b", "error": "OOM"},
        ],
    }
    results, ref = tmp_path / "train.json", tmp_path / "ref.jsonl"
    results.write_text(json.dumps(record))
    ref.write_text(json.dumps(dict(variant="mlra_4", n_layer=8, batch=8, tokens_per_s=50.0, device="GPU X")) + "\n")
    assert reference.main([str(results), str(ref)]) == 0
    mlra4, gqa, failed = json.loads(results.read_text())["results"]
    assert mlra4["reference"]["ratio"] == pytest.approx(1.2) and mlra4["reference"]["same_device"]
    assert gqa["reference"] is None and "reference" not in failed
    assert "mlra4_2p9b" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        reference.main([str(tmp_path / "none.json"), str(ref)])
    assert exit_info.value.code == 2 and "no such file" in capsys.readouterr().err


def test_gemm_calls_are_counted_by_kind():
    from mlra_jax.benchmarks.train import gemm_calls

    text = (
        '%a = custom-call(), custom_call_target="__cublas$lt$matmul$f8"\n'
        '%b = custom-call(), custom_call_target="__cublas$lt$matmul"\n'
        '%c = custom-call(), custom_call_target="__cublas$gemm"\n'
        '%d = custom-call(), custom_call_target="__cudnn$fmha"\n'
    )
    assert gemm_calls(text) == {"fp8": 1, "other": 2}


def test_refilled_writes_into_the_donated_buffers_in_their_shardings():
    """A cache filled for timing takes the place of the one it was handed: same shapes, dtypes and shardings, the
    given arrays donated (deleted) and their buffers written in place, the values one random row repeated."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from mlra_jax.benchmarks.common import refilled

    mesh = jax.make_mesh((4,), ("tensor",), devices=jax.devices()[:4])
    given = {"k": jax.device_put(jnp.zeros((2, 8, 4, 16), jnp.bfloat16), NamedSharding(mesh, P(None, None, "tensor")))}
    buffers = [shard.data.unsafe_buffer_pointer() for shard in given["k"].addressable_shards]
    filled = refilled(given)
    assert given["k"].is_deleted()
    assert [shard.data.unsafe_buffer_pointer() for shard in filled["k"].addressable_shards] == buffers
    assert filled["k"].shape == (2, 8, 4, 16) and filled["k"].dtype == jnp.bfloat16
    assert filled["k"].sharding.is_equivalent_to(NamedSharding(mesh, P(None, None, "tensor")), 4)
    values = np.asarray(filled["k"], np.float32)
    assert np.all(values == values[:1, :1, :1]) and np.any(values != 0)


def test_interleaved_benchmark_alternates_two_settings_on_one_state(tmp_path, tiny_vocabulary):
    out = tmp_path / "ab.json"
    interleaved.main(
        ["--experiment=mlra4_tiny", "--n_layer=1", "--seq_len=16", "--batch_per_device=1", "--pairs=3", "--warmup=1"]
        + ["--a=--model.latent_keys=product", "--b=--model.latent_keys=concat", f"--out={out}"]
    )
    (result,) = json.loads(out.read_text())["results"]
    assert result["overrides"]["a"] == ["--model.latent_keys=product"] and result["pairs"] == 3
    assert [len(result["step_times_s"][side]) for side in ("a", "b")] == [3, 3]
    assert 0 <= result["pairs_a_won"] <= 3 and result["b_over_a"] > 0
    for side in ("a", "b"):
        assert result["median_step_s"][side] == sorted(result["step_times_s"][side])[1]
        assert result["tokens_per_s"][side] == pytest.approx(8 * 16 / result["median_step_s"][side])


@pytest.mark.parametrize(
    "sides,message",
    [
        (["--a=--model.remat=dots", "--b=--model.remat=dots"], "--a and --b are the same setting"),
        (["--a=--model.n_layer=2"], "train states of different shapes"),
        (["--a=--model.remat=dots", "--experiment=mlra4_tiny,mla_tiny"], "--experiment takes one experiment; got 2"),
    ],
)
def test_interleaved_benchmark_refuses_settings_it_cannot_compare(tmp_path, capsys, sides, message):
    with pytest.raises(SystemExit) as exit_info:
        interleaved.main(["--experiment=mlra4_tiny", "--n_layer=1", "--seq_len=16", *sides, f"--out={tmp_path / 'x'}"])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_throughput_figure_draws_the_study_with_its_floors(tmp_path, capsys):
    from mlra_jax.benchmarks import throughput_figure

    def row(variant, tp, dp, context, tokens, floor_tokens):
        return {
            "scope": "model",
            "variant": variant,
            "tp": tp,
            "dp": dp,
            "batch": 64,
            "context": context,
            "tokens_per_s": tokens,
            "floor_tokens_per_s": floor_tokens,
            "time_over_floor": floor_tokens / tokens,
        }

    record = {
        "device": "NVIDIA H100 80GB HBM3",
        "devices_used": 4,
        "results": [
            row("mlra4", 4, 1, 8192, 20000.0, 30000.0),
            {**row("mlra4", 4, 1, 2048, 10000.0, 40000.0), "call_tokens_per_s": 25000.0, "call_over_floor": 1.6},
            row("mla", 1, 4, 2048, 15000.0, 26000.0),
            {**row("mla", 1, 4, 2048, 1.0, 26000.0), "superseded": "an earlier version's"},
            {"scope": "model", "variant": "gqa", "context": 2048, "error": "JaxRuntimeError: RESOURCE_EXHAUSTED"},
        ],
    }
    path = tmp_path / "throughput.json"
    path.write_text(json.dumps(record))
    out = tmp_path / "figure.png"
    assert throughput_figure.main([str(path), f"--out={out}"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    lines = [line.split() for line in printed.splitlines() if line.startswith("model")]
    assert [(line[1], line[-4]) for line in lines] == [("MLRA-4", "2048"), ("MLRA-4", "8192"), ("MLA", "2048")]
    assert lines[0][-1] == "1.60" and lines[0][-3] == "25,000*"  # generate's calls where the row timed them
    assert lines[1][-1] == "1.50"  # 30,000 / 20,000: the single step over its floor
    record["results"] = record["results"][4:]
    path.write_text(json.dumps(record))
    with pytest.raises(SystemExit) as exit_info:
        throughput_figure.main([str(path), f"--out={tmp_path / 'none.png'}"])
    assert exit_info.value.code == 2 and not (tmp_path / "none.png").exists()


def test_collective_census_counts_every_form_of_a_collective():
    from mlra_jax.benchmarks.roofline import collective_census

    hlo = """
      %all-reduce-start = bf16[64,1,3072]{2,1,0} all-reduce-start(bf16[64,1,3072]{2,1,0} %x), channel_id=1
      %all-reduce-done = bf16[64,1,3072]{2,1,0} all-reduce-done(%all-reduce-start)
      %rs = ((bf16[64,1,128,128]{3,2,1,0}), bf16[64,1,32,128]{3,2,1,0}) reduce-scatter-start(%y), dimensions={2}
      %ag = f32[8,24,128]{2,1,0} all-gather(f32[8,6,128]{2,1,0} %z), dimensions={1}
      %f = f32[8] fusion(%a), kind=kLoop, calls=%all-reduce.3
    """
    census = collective_census(hlo)
    assert census["collectives"] == {"all-reduce": 1, "reduce-scatter": 1, "all-gather": 1}
    assert census["collective_bytes"] == 64 * 3072 * 2 + 64 * 32 * 128 * 2 + 8 * 24 * 128 * 4


CHILD = """
import sys
from mlra_jax.benchmarks import decode_throughput
from mlra_jax.experiments.tiny import tiny_model
decode_throughput.whole_model = lambda v: tiny_model(v, n_layer=1, n_head=8, vocab_size=128)
decode_throughput.THROUGHPUT_MODELS = {v: decode_throughput.whole_model(v) for v in ("mlra4", "gla2")}
sys.exit(decode_throughput.main(sys.argv[1:]))
"""


def _two_process_row(tmp_path: Path, monkeypatch, scope: str, variant: str) -> dict:
    """The one row of decode_throughput --processes=2 (2 CPU devices each) for `scope` and `variant`, from the record
    that process 0 writes."""
    child = tmp_path / "child.py"
    child.write_text(CHILD)
    monkeypatch.setattr(decode_throughput, "PROCESS_COMMAND", [sys.executable, str(child)])
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=2 {IN_PROCESS}")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    out = tmp_path / "throughput.json"
    argv = ["--cpu", f"--scopes={scope}", f"--variants={variant}", "--contexts=64", "--repeats=1", "--copy_gb=0.01"]
    assert decode_throughput.main([*argv, "--processes=2", f"--out={out}"]) == 0
    record = json.loads(out.read_text())
    assert record["processes"] == 2 and record["devices_used"] == 4, record
    (row,) = record["results"]
    return row


def test_decode_throughput_in_one_process_per_device_group(tmp_path, monkeypatch, capfd):
    """--processes=2: two processes of 2 CPU devices each joined by jax.distributed (gloo), MLRA-4's TP=4 step
    spanning both; process 0 alone prints the rows and writes the record."""
    row = _two_process_row(tmp_path, monkeypatch, "model", "mlra4")
    assert (row["tp"], row["dp"], row["collectives"]) == (4, 1, {"all-reduce": 3}) and row["tokens_per_s"] > 0
    assert capfd.readouterr().out.count("model     mlra4  TP=4") == 1


def test_decode_throughput_measures_the_attention_scope_across_processes(tmp_path, monkeypatch):
    """--processes applies to both scopes: each scope's child process is told to measure in processes, and the
    attention scope's one layer (GLA-2 at TP=2 x DP=2, its data axis across the two processes of 2 CPU devices each)
    gives its row with its parameters, input and cache made in their shardings."""
    args = decode_throughput.build_parser().parse_args(["--processes=4"])
    argv = {s: decode_throughput.child_argv(args, s, "mlra4", tmp_path / "x.json") for s in decode_throughput.SCOPES}
    assert all("--processes=4" in a for a in argv.values())
    row = _two_process_row(tmp_path, monkeypatch, "attention", "gla2")
    assert (row["scope"], row["tp"], row["dp"]) == ("attention", 2, 2) and row["tokens_per_s"] > 0
    assert row["call_step_s"] > 0 and row["call_over_floor"] == pytest.approx(row["call_step_s"] / row["floor_time_s"])
