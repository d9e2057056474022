"""The official PyTorch code's training throughput ("REF"), as the anchor script prints it, beside ours.

The anchor script (shared with the project's maintainers; it times REF's own model with torch.compile,
bf16 autocast and fused AdamW) prints one JSON line per batch size:
    {"variant": "mlra_4", "n_layer": 8, "batch": 8, "tokens_per_s": 55139.0, "device": "NVIDIA H100 80GB HBM3", ...}
or {"variant": ..., "batch": 12, "error": "OOM"}. `read_reference` collects them (other lines are skipped),
and `compare` puts REF's best batch beside one of our results.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class AnchorFileError(ValueError):
    """The reference file cannot be used; the message says why and what it should hold."""


def read_reference(path: Path) -> dict[tuple[str, int], list[dict[str, Any]]]:
    """(REF variant, layers) -> the batch sizes timed, each the anchor script's JSON line."""
    if not path.is_file():
        raise AnchorFileError(
            f"--reference={path}: no such file; give the JSON lines that the anchor script "
            f"reference_train_step.py printed"
        )
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and {"variant", "n_layer", "batch"} <= set(record):
            runs.setdefault((record["variant"], int(record["n_layer"])), []).append(record)
    if not runs:
        raise AnchorFileError(
            f"--reference={path} holds no line of the anchor script (a JSON object with variant, "
            f"n_layer, batch and tokens_per_s)"
        )
    return runs


def best_run(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest batch among the runs that finished, or None when none did."""
    finished = [r for r in runs if "tokens_per_s" in r and "error" not in r]
    return max(finished, key=lambda r: r["tokens_per_s"]) if finished else None


def compare(
    result: dict[str, Any], reference_key: str | None, device: str, runs: dict[tuple[str, int], list[dict[str, Any]]]
) -> dict[str, Any] | None:
    """REF's figure for one of our results (same REF variant and layer count), or None when the file has none:
    its best batch, every batch tried, our tokens/s over its best, and whether both ran on the same GPU model."""
    tried = runs.get((reference_key, result["n_layer"])) if reference_key else None
    best = best_run(tried) if tried else None
    if best is None:
        return None
    return {
        "variant": reference_key,
        "best_batch": best["batch"],
        "tokens_per_s": best["tokens_per_s"],
        "batches": {str(r["batch"]): r.get("tokens_per_s", r.get("error")) for r in tried},
        "device": best.get("device"),
        "same_device": best.get("device") == device,
        "ratio": result["tokens_per_s"] / best["tokens_per_s"],
    }


def annotate(results_path: Path, reference_path: Path) -> dict[str, Any]:
    """Add REF's figures (compare) to every finished result of a saved train benchmark record, for REF timed on
    the same machine in another process; the record is rewritten with `reference_file` named."""
    from mlra_jax.experiments import get_experiment

    runs = read_reference(reference_path)
    record = json.loads(results_path.read_text())
    for result in record["results"]:
        if "error" not in result:
            result["reference"] = compare(
                result, get_experiment(result["experiment"]).reference_key, record["device"], runs
            )
    record["reference_file"] = str(reference_path)
    results_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="mlra bench reference",
        description="Put the official code's training throughput (the anchor script's "
        "JSON lines) beside a saved `benchmarks.train` record.",
    )
    parser.add_argument("results", type=Path, help="a JSON record of mlra bench train")
    parser.add_argument("reference", type=Path, help="the anchor script's output, timed on the same GPU")
    args = parser.parse_args(argv)
    if not args.results.is_file():
        parser.error(f"{args.results}: no such file; give the --out of mlra bench train")
    try:
        record = annotate(args.results, args.reference)
    except AnchorFileError as err:
        parser.error(str(err))
    for result in record["results"]:
        ref = result.get("reference")
        if ref:
            print(
                f"{result['experiment']:16} batch {result['batch_per_device']:3} {result['tokens_per_s']:10,.0f} "
                f"tok/s  REF {ref['tokens_per_s']:,.0f} (batch {ref['best_batch']}): {ref['ratio']:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
