"""The built-in corpus: English documentation text shipped with the package.

`assets/python_docs.jsonl.gz` holds the docstrings of CPython 3.11's standard library
and the topics of its language reference (pydoc_data), one document per line
(PSF license, see assets/NOTICE). It lets the small experiments train with no
download; `builtin_shards()` tokenizes it once into llm.c shards in a cache folder.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import json
import os
import random
import sysconfig
import tempfile
from pathlib import Path

ASSETS = Path(__file__).parent / "assets"
CORPUS = ASSETS / "python_docs.jsonl.gz"
VAL_DOCUMENTS = 200  # the first documents form the validation shard
_SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "turtledemo"}


def extract_stdlib_documents(min_chars: int = 80) -> list[str]:
    """Docstrings of the running Python's standard library and its reference topics (how CORPUS was made)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    documents = []
    for path in sorted(root.rglob("*.py")):
        if _SKIP_PARTS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= min_chars:
                    documents.append(doc)
    from pydoc_data.topics import topics

    documents.extend(topics[name] for name in sorted(topics))
    return documents


def write_corpus(documents: list[str], path: Path = CORPUS) -> None:
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in documents).encode())


def read_corpus(path: Path = CORPUS) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def cache_dir() -> Path:
    return Path(os.environ.get("MLRA_JAX_CACHE", Path.home() / ".cache" / "mlra_jax"))


def builtin_shards() -> Path:
    """A folder of llm.c shards of the built-in corpus (made once, atomically)."""
    from mlra_jax.data.prepare import write_token_shards
    from mlra_jax.data.tokenizer import gpt2_tokenizer

    digest = hashlib.sha256(CORPUS.read_bytes()).hexdigest()[:12]
    target = cache_dir() / f"builtin-{digest}"
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    documents = read_corpus()
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        tokenizer = gpt2_tokenizer()
        write_token_shards(tokenizer, documents[:VAL_DOCUMENTS], Path(tmp), "python_docs_val")
        write_token_shards(tokenizer, documents[VAL_DOCUMENTS:], Path(tmp), "python_docs_train")
        try:
            os.rename(tmp, target)
        except OSError:  # another process made it first
            if not target.is_dir():
                raise
        else:
            os.mkdir(tmp)  # TemporaryDirectory cleans up the (now moved) folder
    return target


if __name__ == "__main__":
    docs = extract_stdlib_documents()
    random.Random(0).shuffle(docs)  # so the validation documents are a fair sample
    write_corpus(docs)
    print(f"{len(docs)} documents, {sum(map(len, docs)) / 1e6:.2f}M characters -> {CORPUS}")
