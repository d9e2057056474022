"""Every notebook runs top to bottom on a CPU under MLRA_JAX_SMOKE=1 (nbclient; any cell error fails), is
stored with the outputs of one clean run (or none), and starts each code cell with a one-line comment of what it
does."""

from __future__ import annotations

import os

import nbformat
import pytest
from helpers import ROOT, subprocess_env
from nbclient import NotebookClient

pytestmark = pytest.mark.slow  # trains, launches or compiles: not in the fast subset (pytest -m 'not slow')

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# What each notebook must leave in RUNS (the quickstart's plot cell writes its image)
IMAGES = {
    "quickstart": ["quickstart_curves.png"],
    "tpu_vm_pod": ["pod_rehearsal_curves.png"],
    "decode_kernels": ["paper_tables.png"],
}


def test_the_three_notebooks_are_there():
    assert sorted(path.stem for path in NOTEBOOKS) == sorted(IMAGES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_stored_valid_each_cell_saying_what_it_does_with_the_outputs_of_one_clean_run(path):
    """Stored either without outputs or with those of one run top to bottom (a reader sees them before running
    anything): no error, no traceback, no line of the TPU runtime's."""
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert notebook.nbformat == 4
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in code]
    assert code and (counts == list(range(1, len(code) + 1)) or counts == [None] * len(code))
    outputs = [output for cell in code for output in cell.outputs]
    assert counts[0] is not None or not outputs
    assert not [output for output in outputs if output.output_type == "error"]
    text = "".join(output.get("text", "") for output in outputs)
    assert not [noise for noise in ("Traceback", "E0000", "accelerator type") if noise in text], text[:2000]
    for cell in code:
        first = cell.source.splitlines()[0]
        assert first.startswith("# ") and len(first) > 10, first


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_runs_top_to_bottom_on_a_cpu(path, tmp_path, monkeypatch):
    for key, value in {
        **subprocess_env(),
        "MLRA_JAX_SMOKE": "1",
        "MLRA_JAX_RUNS": str(tmp_path),
        "TPU": "",
        "ZONE": "",
    }.items():
        monkeypatch.setenv(key, value)  # the kernel inherits this environment
    notebook = nbformat.read(path, as_version=4)
    client = NotebookClient(
        notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    for image in IMAGES[path.stem]:
        assert (tmp_path / image).read_bytes().startswith(b"\x89PNG"), image
    text = "".join(output.get("text", "") for cell in notebook.cells for output in cell.get("outputs", []))
    assert "Traceback" not in text
    if path.stem == "quickstart":
        assert "step 8/8  loss" in text and "[step 8] The return value" in text
        gap = float(text.split("max |transformers - JAX| logits: ")[1].split()[0])  # the Hugging Face export
        assert gap <= 1e-4 and "transformers, greedy:" in text
        assert any(
            "image/png" in output.get("data", {}) for cell in notebook.cells for output in cell.get("outputs", [])
        )  # the curves inline
    if path.stem == "tpu_vm_pod":
        assert "stop signal received: saving a checkpoint" in text and "complete checkpoints at steps [" in text
        assert "resumed from" in text and "finished at step 8" in text
        assert "skipped: bash" in text  # the slice cells, with no slice configured
    if path.stem == "decode_kernels":
        assert "Paper Tables 1-2" in text and ("skipped: no GPU" in text or os.environ.get("JAX_PLATFORMS") == "cuda")
