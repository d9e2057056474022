"""lm-evaluation-harness over our model (mlra_jax/lm_eval_model.py) on local tasks (tests/lm_eval_tasks): every
log-likelihood equals the model's own token log-probabilities, computed here from its logits; rolling windows;
greedy flags; generation cut at stop sequences; the CLI's results JSON; unknown tasks refused."""

from __future__ import annotations

import functools
import json
import math
import re
from pathlib import Path

import jax
import lm_eval
import numpy as np
import pytest
from flax import nnx
from helpers import GPT2, micro_experiment
from lm_eval.api.instance import Instance

from mlra_jax import convert
from mlra_jax.data.tokenizer import EOT, gpt2_tokenizer
from mlra_jax.decode.generator import Sampling
from mlra_jax.eval import main as eval_main
from mlra_jax.eval import task_manager
from mlra_jax.generate import load_model
from mlra_jax.lm_eval_model import MlraLM
from mlra_jax.model import abstract_model
from mlra_jax.params import flat_params
from mlra_jax.zero_shot import PAPER_TASKS, paper_table, task_names

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

TASKS = Path(__file__).parent / "lm_eval_tasks"
MAX_LEN = 64  # the model's context: the long documents and questions need several windows or truncation
TOKENIZER = gpt2_tokenizer()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run of a tiny model with random weights (step 0)."""
    run_dir = tmp_path_factory.mktemp("lm_eval") / "run"
    experiment = micro_experiment("mlra4_tiny", *GPT2, f"--model.max_seq_len={MAX_LEN}")
    rng = np.random.default_rng(0)
    flat = {
        k: rng.normal(0, 0.05, v.shape).astype(np.float32)
        for k, v in flat_params(abstract_model(experiment.model)).items()
    }
    convert.write_run(run_dir, experiment, flat, "test")
    return run_dir


@pytest.fixture(scope="module")
def lm(run) -> MlraLM:
    model, step = load_model(run)
    return MlraLM(model, batch_size=4, checkpoint=str(run), step=step)


@pytest.fixture(scope="module")
def evaluated(lm) -> dict:
    return lm_eval.simple_evaluate(
        model=lm, tasks=["tiny_choice", "tiny_rolling"], task_manager=task_manager(str(TASKS)), log_samples=True
    )


@functools.cache
def _forward(lm: MlraLM):
    graphdef, state = nnx.split(lm.model)
    return functools.partial(jax.jit(lambda s, tokens: nnx.merge(graphdef, s)(tokens)), state)


def log_probs(lm: MlraLM, tokens: list[int]) -> np.ndarray:
    """log p(next token | tokens[:t + 1]) over the vocabulary, [T, V] in float64, from the model's logits
    (one row of MAX_LEN, right-padded: the model is causal)."""
    padded = np.zeros((1, MAX_LEN), np.int32)
    padded[0, : len(tokens)] = tokens
    logits = np.asarray(_forward(lm)(padded)[0, : len(tokens)], np.float64)
    logits -= logits.max(-1, keepdims=True)
    return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def score(lm: MlraLM, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    """Sum of the continuation's log-probabilities and whether each of its tokens is the argmax, with the
    sequence cut to its last MAX_LEN + 1 tokens."""
    sequence = (context + continuation)[-(MAX_LEN + 1) :]
    table = log_probs(lm, sequence[:-1])[-len(continuation) :]
    return float(table[np.arange(len(continuation)), continuation].sum()), bool(
        (table.argmax(-1) == continuation).all()
    )


def hf_style_tokens(context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The context's trailing spaces moved to the continuation, the pair encoded whole and split at the
    context's length (lm-eval's HFLM); an empty context is <|endoftext|>."""
    if not context:
        return [EOT], TOKENIZER.encode_ordinary(continuation)
    stripped = context.rstrip()
    continuation = context[len(stripped) :] + continuation
    whole, head = TOKENIZER.encode_ordinary(stripped + continuation), TOKENIZER.encode_ordinary(stripped)
    return head, whole[len(head) :]


def rolling_log_likelihood(lm: MlraLM, text: str) -> float:
    """Every token predicted once, given <|endoftext|> and as much of what precedes it as fits: chunks of
    MAX_LEN tokens, each read with the MAX_LEN tokens before its last one."""
    tokens = TOKENIZER.encode_ordinary(text)
    stream = [EOT] + tokens  # stream[j + 1] is tokens[j]
    total = 0.0
    for start in range(0, len(tokens), MAX_LEN):
        end = min(start + MAX_LEN, len(tokens))
        inputs = stream[max(0, end - MAX_LEN) : end]
        table = log_probs(lm, inputs)[-(end - start) :]
        total += table[np.arange(end - start), tokens[start:end]].sum()
    return float(total)


def test_multiple_choice_log_likelihoods_are_the_models_own(lm, evaluated):
    samples = evaluated["samples"]["tiny_choice"]
    assert len(samples) == 6
    correct = correct_norm = 0
    for sample in samples:
        scores = []
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            expected = score(lm, *hf_style_tokens(context, continuation))
            assert response[0][0] == pytest.approx(expected[0], rel=1e-5, abs=1e-4)
            assert response[0][1] == expected[1]
            scores.append(expected[0])
        choices = [c for _, c in sample["arguments"]]
        correct += int(np.argmax(scores)) == sample["target"]
        correct_norm += int(np.argmax([s / len(c) for s, c in zip(scores, choices)])) == sample["target"]
    results = evaluated["results"]["tiny_choice"]
    assert results["acc,none"] == pytest.approx(correct / 6) and results["acc_norm,none"] == pytest.approx(
        correct_norm / 6
    )
    # the cases that the encoding rules are about: an empty context, a context ending in a space, one too long
    contexts = {s["arguments"][0][0] for s in samples}
    assert "" in contexts and "The capital of France is " in contexts
    assert max(len(TOKENIZER.encode_ordinary(c)) for c in contexts) > MAX_LEN


def test_rolling_log_likelihood_is_the_documents_sum(lm, evaluated):
    samples = evaluated["samples"]["tiny_rolling"]
    texts = [s["arguments"][0][0] for s in samples]
    assert max(len(TOKENIZER.encode_ordinary(t)) for t in texts) > 3 * MAX_LEN  # several windows, the last partial
    expected = [rolling_log_likelihood(lm, t) for t in texts]
    assert [s["resps"][0][0] for s in samples] == pytest.approx(expected, rel=1e-5)
    results = evaluated["results"]["tiny_rolling"]
    byte_count = sum(len(t.encode()) for t in texts)
    word_count = sum(len(re.split(r"\s+", t)) for t in texts)
    assert results["byte_perplexity,none"] == pytest.approx(math.exp(-sum(expected) / byte_count), rel=1e-5)
    assert results["word_perplexity,none"] == pytest.approx(math.exp(-sum(expected) / word_count), rel=1e-4)


def test_is_greedy_marks_the_models_own_next_token(lm):
    requests, expected = [], []
    for context in ["The weather today", "Once upon a time there was", "In 1999 the", "She said that"]:
        tokens = TOKENIZER.encode_ordinary(context)
        table = log_probs(lm, tokens)[-1]
        for token in (int(table.argmax()), int(table.argmin())):
            if token >= EOT:  # padded vocabulary: no text
                continue
            continuation = TOKENIZER.decode([token])
            if hf_style_tokens(context, continuation) != (tokens, [token]):
                continue  # the text would not tokenize back to this token
            requests.append(Instance("loglikelihood", {}, (context, continuation), len(requests)))
            expected.append((float(table[token]), token == table.argmax()))
    assert sum(greedy for _, greedy in expected) >= 2 and sum(not greedy for _, greedy in expected) >= 2
    for (log_prob, greedy), (want_log_prob, want_greedy) in zip(lm.loglikelihood(requests), expected):
        assert log_prob == pytest.approx(want_log_prob, abs=1e-4) and greedy == want_greedy


def test_generate_until_stops_at_a_stop_sequence(lm):
    contexts = ["The weather today", "A list of things:"]
    prompts = [TOKENIZER.encode_ordinary(c) for c in contexts] + [[EOT]] * 2  # the adapter's batch of 4
    free = lm.generator.generate(prompts, Sampling(max_new_tokens=16, eos_id=None), width=16)[:2]
    texts = [lm.tok_decode(tokens) for tokens in free]
    stop = lm.tok_decode(free[0][3:5])  # reached with the fifth token of the first prompt
    assert stop and texts[0].index(stop) > 0
    requests = [
        Instance("generate_until", {}, (c, {"until": [stop], "max_gen_toks": 16}), i) for i, c in enumerate(contexts)
    ]
    assert lm.generate_until(requests) == [t.split(stop)[0] for t in texts]

    steps = []
    step = lm.generator.step
    lm.generator.step = lambda *a: steps.append(1) or step(*a)
    try:
        assert lm.generate_until(requests[:1]) == [texts[0].split(stop)[0]]
    finally:
        del lm.generator.step
    assert len(steps) <= 4  # decoding ended with the stop sequence's last token, not after 16 tokens


def test_cli_writes_lm_evals_results_json(run, tmp_path, capsys):
    out, before = tmp_path / "results.json", sorted(run.rglob("*"))
    arguments = [
        "lm-eval",
        "--checkpoint",
        str(run),
        "--tasks",
        "tiny_choice,tiny_rolling",
        "--include_path",
        str(TASKS),
        "--batch_size",
        "4",
        "--limit",
        "3",
    ]
    assert eval_main([*arguments, "--out", str(out)]) == 0
    assert sorted(run.rglob("*")) == before  # --out: nothing in the run
    assert eval_main(arguments) == 0
    printed = capsys.readouterr().out
    assert "tiny_choice" in printed and "word_perplexity" in printed
    for path in (out, run / "eval" / "lm_eval_step0.json"):
        results = json.loads(path.read_text())
        assert set(results["results"]) == {"tiny_choice", "tiny_rolling"}
        assert results["n-samples"]["tiny_choice"] == {"original": 6, "effective": 3}
        assert results["config"]["variant"] == "mlra4" and results["config"]["step"] == 0
        assert 0 <= results["results"]["tiny_choice"]["acc_norm,none"] <= 1


def test_an_unknown_task_exits_2_naming_it(run, tmp_path, capsys):
    out, before = tmp_path / "results.json", sorted(run.rglob("*"))
    code = eval_main(
        [
            "lm-eval",
            "--checkpoint",
            str(run),
            "--tasks",
            "tiny_choise,paper",
            "--include_path",
            str(TASKS),
            "--out",
            str(out),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "does not know the task 'tiny_choise' (close: tiny_choice" in err
    assert not out.exists() and sorted(run.rglob("*")) == before
    code = eval_main(
        ["lm-eval", "--checkpoint", str(run), "--tasks", "tiny_choice", "--include_path", str(tmp_path / "missing")]
    )
    assert code == 2 and "missing is not a folder of task YAML files" in capsys.readouterr().err


def test_paper_suite_and_table():
    assert task_names("paper,arc_easy, piqa,mmlu") == [t.task for t in PAPER_TASKS] + ["mmlu"]
    values = {
        "arc_easy": 0.6763,
        "arc_challenge": 0.4138,
        "openbookqa": 0.43,
        "boolq": 0.6174,
        "hellaswag": 0.6216,
        "winogrande": 0.6148,
        "piqa": 0.7448,
    }  # the paper's MLRA-4 row
    # the other metric is present too (as lm-eval reports both) and must not be taken
    results = {
        "results": {
            t.task: {"acc,none": 0.0, "acc_norm,none": 0.0, f"{t.metric},none": values[t.task]} for t in PAPER_TASKS
        }
    }
    table = paper_table(results, "MLRA-4").splitlines()
    assert table[0] == "| Method | ARC-E | ARC-C | OpenBookQA | BoolQ | HellaSwag | Winogrande | PIQA | Avg |"
    assert table[2] == "| MLRA-4 | 67.63 | 41.38 | 43.00 | 61.74 | 62.16 | 61.48 | 74.48 | 58.84 |"
    del results["results"]["piqa"]
    assert paper_table(results, "MLRA-4") is None


def test_registered_with_lm_eval(lm):
    assert lm_eval.api.registry.get_model("mlra_jax") is MlraLM
    assert lm.scorer.mesh.size == 4  # the test process's 8 CPU devices: batches of 4 rows over 4 of them


def test_lm_evals_hf_model_on_the_exported_folder_gives_the_same_numbers(run, evaluated, tmp_path):
    """The same tasks through lm-eval's own `hf` model on `convert to-hf`'s folder (our PyTorch modeling code,
    float32): the same log-likelihood per request and the same metrics as our adapter."""
    folder = tmp_path / "hf"
    assert convert.main(["to-hf", "--checkpoint", str(run), "--out", str(folder), "--dtype", "float32"]) == 0
    through_hf = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={folder},trust_remote_code=True,dtype=float32,max_length={MAX_LEN}",
        tasks=["tiny_choice", "tiny_rolling"],
        task_manager=task_manager(str(TASKS)),
        log_samples=True,
        batch_size=4,
        device="cpu",
    )
    for task in ("tiny_choice", "tiny_rolling"):
        ours = sorted(evaluated["samples"][task], key=lambda s: s["doc_id"])
        theirs = sorted(through_hf["samples"][task], key=lambda s: s["doc_id"])
        assert [s["arguments"] for s in ours] == [s["arguments"] for s in theirs]  # the same requests
        for mine, hf in zip(ours, theirs):
            for a, b in zip(mine["resps"], hf["resps"]):
                value_a, value_b = (a[0][0], b[0][0]) if task == "tiny_choice" else (a[0], b[0])
                assert value_a == pytest.approx(value_b, rel=1e-5, abs=1e-4)
                if task == "tiny_choice":
                    assert a[0][1] == b[0][1]  # is_greedy
        for metric, value in evaluated["results"][task].items():
            if isinstance(value, float):
                assert through_hf["results"][task][metric] == pytest.approx(value, rel=1e-5, abs=1e-6), metric
