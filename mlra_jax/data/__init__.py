"""Token data: llm.c shards, the GPT-2 tokenizer, the built-in corpus and grain pipelines."""
