"""The README's quick start and CI stay in step."""

from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ci_runs_the_readme_test_command():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    test_command = next(line for line in ci.splitlines() if "pytest" in line)
    assert test_command in readme
