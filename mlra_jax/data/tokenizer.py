"""The GPT-2 tokenizer through tiktoken, from the BPE ranks shipped with the package (offline)."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import tiktoken
from tiktoken.load import load_tiktoken_bpe

BPE_FILE = Path(__file__).parent / "assets" / "gpt2.tiktoken"
BPE_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"  # == tiktoken's r50k_base
EOT = 50256  # <|endoftext|>, prepended to every document
# GPT-2's pre-tokenization pattern (tiktoken's r50k_pat_str)
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


@functools.cache
def gpt2_tokenizer(bpe_file: str | None = None) -> tiktoken.Encoding:
    ranks = load_tiktoken_bpe(str(bpe_file or BPE_FILE), expected_hash=None if bpe_file else BPE_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=GPT2_PATTERN,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": EOT},
        explicit_n_vocab=EOT + 1,
    )


def encode_documents(tokenizer: tiktoken.Encoding, texts: list[str], threads: int = 8) -> list[np.ndarray]:
    """Each document as uint16 tokens with <|endoftext|> prepended (the reference's convention)."""
    return [
        np.array([EOT, *ids], dtype=np.uint16) for ids in tokenizer.encode_ordinary_batch(texts, num_threads=threads)
    ]
