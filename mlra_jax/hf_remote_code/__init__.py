"""The PyTorch modeling code of the Hugging Face export (`mlra convert to-hf`).

`configuration_mlra.py` and `modeling_mlra.py` are package data: they import torch and transformers
and nothing of mlra_jax, are copied into every exported folder, and run there through
`trust_remote_code=True`. The library never imports them (tests/test_import_rules.py checks it).
"""

REMOTE_CODE_FILES = ("configuration_mlra.py", "modeling_mlra.py")
