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


def test_tensorboard_logging_does_not_import_torch(tmp_path):
    """tensorboardX's writer imports torch when installed (2 s at every training start); the writer keeps it out
    and still writes TensorBoard event files. Checked in a fresh interpreter, where nothing imported torch."""
    import subprocess
    import sys

    code = (
        "import sys; from mlra_jax.metrics import MetricWriter; "
        f"w = MetricWriter({str(tmp_path)!r}); w.write(1, {{'loss': 2.0}}); w.close(); "
        "print('torch' in sys.modules, w.tensorboard is not None)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["False", "True"]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    import importlib.util

    assert importlib.util.find_spec("torch") is not None, "torch is not installed: this test checks nothing"
