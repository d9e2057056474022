"""metrics.jsonl stays valid JSON: a torn last line is dropped on resume, NaN is written as null."""

import json
import logging

from mlra_jax.metrics import MetricWriter


def test_a_torn_last_line_is_dropped_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 10, "loss": 5.0}\n{"step": 20, "loss": 4.0}\n{"step": 30, "lo')
    writer = MetricWriter(tmp_path, enabled=True)
    with caplog.at_level(logging.WARNING, logger="mlra_jax.metrics"):
        writer.truncate_after(20)
    writer.close()
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [10, 20]
    assert "line 3 is not a metrics record" in caplog.text


def test_non_finite_values_are_written_as_null(tmp_path):
    writer = MetricWriter(tmp_path, enabled=True)
    writer.write(1, {"loss": float("nan"), "grad_norm": float("inf"), "lr": 1e-3})
    writer.close()
    record = json.loads(
        (tmp_path / "metrics.jsonl").read_text(), parse_constant=lambda c: c
    )  # NaN would read back as the string "NaN"
    assert record == {"step": 1, "loss": None, "grad_norm": None, "lr": 1e-3}
