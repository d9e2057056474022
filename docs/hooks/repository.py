"""The site's repository link and each page's edit link, from the checkout the site is built in.

A mkdocs hook (`hooks:` in mkdocs.yml): `on_config` sets `repo_url` (the header's link to the repository) and
`edit_uri` (each page's edit button) from MLRA_JAX_REPO_URL when set, else from the checkout's `origin` remote
when it is a web address (https, or GitHub/GitLab's ssh form). A checkout without such a remote builds the site
without these links.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ENV = "MLRA_JAX_REPO_URL"
BRANCH = "main"
# git@host:owner/name(.git) and ssh://git@host/owner/name(.git)
SSH = re.compile(r"^(?:ssh://)?git@(?P<host>[^:/]+)[:/](?P<path>.+?)(?:\.git)?/?$")


def web_url(remote: str) -> str | None:
    """The https address of a git remote, or None when it names no web host (a local path, a file: URL)."""
    remote = remote.strip()
    if remote.startswith(("https://", "http://")):
        return remote.removesuffix("/").removesuffix(".git")
    match = SSH.match(remote)
    return f"https://{match['host']}/{match['path']}" if match else None


def origin_url(root: Path) -> str | None:
    """The web address of the checkout's `origin` remote, or None."""
    try:
        remote = subprocess.run(
            ["git", "-C", str(root), "remote", "get-url", "origin"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return web_url(remote)


def repository_links(url: str | None) -> dict[str, str]:
    """mkdocs settings for a repository at `url`: repo_url, repo_name and (GitHub, GitLab) edit_uri."""
    if not url:
        return {}
    links = {"repo_url": url, "repo_name": "/".join(url.split("/")[-2:])}
    if "github" in url or "gitlab" in url:
        links["edit_uri"] = f"edit/{BRANCH}/docs/"
    return links


def on_config(config, **kwargs):
    root = Path(config["config_file_path"]).parent
    for key, value in repository_links(os.environ.get(ENV) or origin_url(root)).items():
        if not config.get(key):
            config[key] = value
    return config
