"""The decoding-throughput study's figure (the paper's Sec. 5): tokens/s against context for each variant, ours and
their floors, one panel per scope, from a `benchmarks.decode_throughput` record.

    mlra bench throughput_figure experiments/results/decode_throughput_h100x4_b64.json \
        --out docs/assets/decode_throughput_h100x4_b64.png

It also prints the table the figure draws (tokens/s, the floor's tokens/s and the step over its floor).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mlra_jax.command import command

NAMES = {"mlra4": "MLRA-4", "mla": "MLA", "gla2": "GLA-2", "gqa": "GQA", "mlra2": "MLRA-2", "gla4": "GLA-4"}
ORDER = list(NAMES)


def rank(variant: str) -> int:
    return ORDER.index(variant) if variant in ORDER else len(ORDER)


def measured_rows(record: dict[str, Any]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The record's measured rows (no failures, none marked `superseded` by a later version's) by scope and variant,
    in context order."""
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for row in record["results"]:
        if "error" not in row and "superseded" not in row and "floor_tokens_per_s" in row:
            rows.setdefault(row["scope"], {}).setdefault(row["variant"], []).append(row)
    for variants in rows.values():
        for series in variants.values():
            series.sort(key=lambda r: r["context"])
    return rows


def measured(row: dict[str, Any]) -> tuple[float, float]:
    """A row's tokens/s and step over its floor: those of `generate`'s calls of several steps where the row timed
    them (`call_tokens_per_s`, decode_throughput --steps_per_call), else of its single step."""
    if "call_tokens_per_s" in row:
        return row["call_tokens_per_s"], row["call_over_floor"]
    return row["tokens_per_s"], row["time_over_floor"]


def deployment(row: dict[str, Any]) -> str:
    return f"TP={row['tp']}" + (f" DP={row['dp']}" if row["dp"] > 1 else "")


def table(record: dict[str, Any]) -> str:
    """One line per row: scope, variant, deployment, context, tokens/s, the floor's tokens/s, step / floor (`measured`:
    of the calls of several steps where the row has them, marked *)."""
    lines = [
        f"{'scope':9} {'variant':7} {'deployment':11} {'context':>7} {'tokens/s':>11} {'floor':>10} {'x floor':>8}"
    ]
    rows = measured_rows(record)
    for scope, variants in rows.items():
        for variant, series in variants.items():
            for r in series:
                tokens, over = measured(r)
                mark = "*" if "call_tokens_per_s" in r else " "
                lines.append(
                    f"{scope:9} {NAMES.get(variant, variant):7} {deployment(r):11} {r['context']:>7} "
                    f"{tokens:>10,.0f}{mark} {r['floor_tokens_per_s']:>10,.0f} {over:>8.2f}"
                )
    if any("call_tokens_per_s" in r for variants in rows.values() for series in variants.values() for r in series):
        lines.append("* calls of several decode steps, as generate runs them")
    return "\n".join(lines)


def draw(record: dict[str, Any], out: Path) -> None:
    """The figure: a panel per scope, each variant's tokens/s (solid) and its floor's (dashed) against context."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = measured_rows(record)
    figure, axes = plt.subplots(1, len(rows), figsize=(6 * len(rows), 4.5), squeeze=False)
    batch = next(r["batch"] for variants in rows.values() for series in variants.values() for r in series)
    for ax, (scope, variants) in zip(axes[0], rows.items()):
        for variant, series in sorted(variants.items(), key=lambda item: rank(item[0])):
            color = f"C{rank(variant)}"  # one color per variant in every panel
            contexts = [r["context"] for r in series]
            label = f"{NAMES.get(variant, variant)} ({deployment(series[0])})"
            ax.plot(contexts, [measured(r)[0] for r in series], "o-", color=color, label=label)
            ax.plot(contexts, [r["floor_tokens_per_s"] for r in series], "--", color=color, alpha=0.6)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("tokens/s")
        ax.set_title(f"{scope}: batch {batch} on {record.get('devices_used', '?')} x {record.get('device', '?')}")
        ax.grid(alpha=0.3)
        ax.legend(title="solid: measured, dashed: floor", fontsize=8)
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=120)
    plt.close(figure)


@command
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="mlra bench throughput_figure",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("record", type=Path, help="a benchmarks.decode_throughput record (JSON)")
    parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
    args = parser.parse_args(argv)
    if not args.record.is_file():
        parser.error(f"{args.record}: no such record; pass a decode_throughput JSON")
    record = json.loads(args.record.read_text())
    if not measured_rows(record):
        parser.error(f"{args.record}: no measured row with a floor (a record of decode_throughput with its roofline)")
    print(table(record))
    try:
        draw(record, args.out)
    except ImportError as err:
        print(f"error: {err.name or 'matplotlib'} is missing: pip install -e '.[plot]'", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
