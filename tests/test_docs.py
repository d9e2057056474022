"""The README stays a one-screen page of current facts, the docs' links resolve, and the configuration page
lists every field. (CI builds the site itself with `mkdocs build --strict`.)"""

import dataclasses
import importlib.util
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").rglob("*.md"))
# [text](target) and [text]: target, without the images' or code spans' look-alikes
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|^\[[^\]\n]+\]:\s*(\S+)", re.MULTILINE)


def _hook_module(name: str = "config_reference"):
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "hooks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_config_reference_module = _hook_module


def _without_code(text: str) -> str:
    """The text without fenced code blocks and inline code spans (whose brackets are not links)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.MULTILINE | re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_links(path: Path) -> list[str]:
    links = [a or b for a, b in LINK.findall(_without_code(path.read_text()))]
    return [link for link in links if not re.match(r"^[a-z][a-z0-9+.-]*:|^#|^/", link)]


def test_readme_fits_one_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; keep it at 200 or fewer (details go in docs/)"


def test_readme_states_current_facts():
    text = README.read_text()
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), (
        "a date in README.md: history goes in experiments/results/LOG.md"
    )
    for word in ("was ", "earlier", "tried", "issue"):
        assert not re.search(rf"\b{word}", text, re.IGNORECASE), f"history word {word.strip()!r} in README.md"


@pytest.mark.parametrize("path", [README, *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(path):
    assert path.read_text().strip(), f"{path} is empty"
    broken = []
    for link in _relative_links(path):
        target = link.split("#", 1)[0]
        if target and not (path.parent / target).exists():
            broken.append(link)
    assert not broken, f"{path.relative_to(ROOT)} links to missing files: {broken}"


def test_readme_links_into_the_docs():
    links = {link.split("#", 1)[0] for link in _relative_links(README)}
    assert {"docs/getting-started.md", "docs/configuration.md", "docs/training.md"} <= links


def test_configuration_page_lists_every_field():
    from mlra_jax import config

    generator = _config_reference_module()
    page = generator.config_reference()
    classes = [
        obj
        for obj in vars(config).values()
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == config.__name__
    ]
    assert {cls.__name__ for cls in classes} >= {
        "ModelConfig",
        "TrainConfig",
        "DataConfig",
        "MeshConfig",
        "CheckpointConfig",
        "MetricsConfig",
        "ProfileConfig",
        "Experiment",
    }
    for cls in classes:
        assert cls.__name__ in page, f"no table for {cls.__name__}"
        for field in dataclasses.fields(cls):
            assert re.search(rf"`(--\w+\.)?{field.name}`", page), f"{cls.__name__}.{field.name} missing from the page"


def test_configuration_page_takes_help_from_config_comments():
    page = _config_reference_module().config_reference()
    row = next(line for line in page.splitlines() if line.startswith("| `--train.global_batch_size`"))
    assert "sequences per optimizer step" in row
    assert "`dots_attn`" in next(line for line in page.splitlines() if line.startswith("| `--model.remat`"))
    assert (ROOT / "docs" / "configuration.md").read_text().count(_config_reference_module().MARKER) == 1


def test_every_config_field_has_help():
    """--help and the configuration page show each field's comment in config.py: none may lack one."""
    from mlra_jax.config_docs import field_docs

    classes = _config_reference_module().config_classes()
    fields = [(c, f.name) for c in classes for f in dataclasses.fields(c)]
    missing = [f"{c.__name__}.{name}" for c, name in fields if not field_docs(c).get(name)]
    assert not missing, f"fields without a help comment in mlra_jax/config.py: {missing}"


def test_the_site_links_the_repository_it_is_built_from(tmp_path, monkeypatch):
    """repo_url and each page's edit link come from MLRA_JAX_REPO_URL, else from the checkout's origin remote when
    it is a web address; a local remote (a fresh clone of a path) gives none."""
    hook = _hook_module("repository")
    assert hook.web_url("git@github.com:someone/mlra_jax.git\n") == "https://github.com/someone/mlra_jax"
    assert hook.web_url("ssh://git@gitlab.com/a/b/mlra_jax.git") == "https://gitlab.com/a/b/mlra_jax"
    assert hook.web_url("https://github.com/someone/mlra_jax.git") == "https://github.com/someone/mlra_jax"
    assert hook.web_url("/srv/git/mlra_jax") is None and hook.web_url("file:///srv/mlra_jax") is None
    assert hook.repository_links("https://github.com/someone/mlra_jax") == {
        "repo_url": "https://github.com/someone/mlra_jax",
        "repo_name": "someone/mlra_jax",
        "edit_uri": "edit/main/docs/",
    }
    assert hook.repository_links("https://git.example.org/mlra_jax") == {
        "repo_url": "https://git.example.org/mlra_jax",
        "repo_name": "git.example.org/mlra_jax",
    }
    checkout = tmp_path / "checkout"
    subprocess.run(["git", "init", "-q", str(checkout)], check=True)
    config = {"config_file_path": str(checkout / "mkdocs.yml")}
    monkeypatch.delenv(hook.ENV, raising=False)
    assert "repo_url" not in hook.on_config(dict(config))  # no origin
    subprocess.run(["git", "-C", str(checkout), "remote", "add", "origin", "git@github.com:o/r.git"], check=True)
    assert hook.on_config(dict(config))["edit_uri"] == "edit/main/docs/"
    monkeypatch.setenv(hook.ENV, "https://github.com/elsewhere/mlra_jax")
    assert hook.on_config(dict(config))["repo_url"] == "https://github.com/elsewhere/mlra_jax"
