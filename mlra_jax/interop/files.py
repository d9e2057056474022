"""The official code's checkpoint files: `config.json` + `pytorch_model.bin` (or its shards with
`pytorch_model.bin.index.json`), as `GPT.from_pretrained` (transformers' PreTrainedModel) reads them.

Reading accepts a `.pt`/`.bin` state dict, a `.safetensors` file, or a folder holding one of those
(sharded with an index or not). Only safe loaders are used: `torch.load(weights_only=True)` and
safetensors. torch is imported inside the functions, so the library works without it.
"""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from mlra_jax.guards import error_summary
from mlra_jax.interop.names import EMBEDDING_KEY, TIED_KEY

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "pytorch_model.bin", "pytorch_model.bin.index.json"
SAFETENSORS_FILE, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"
_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


class ReferenceFileError(ValueError):
    """A reference checkpoint file or folder cannot be read (missing, truncated, unsafe); the message says which."""


def parse_size(text: str) -> int:
    """'10GB' -> 10**9 * 10 bytes (transformers' convention: GB decimal, GiB binary); '4096' -> 4096."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"{text!r} is not a size (e.g. 10GB, 500MB, 4096)")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ReferenceFileError(
            "reading and writing PyTorch checkpoints needs torch: pip install 'mlra_jax[torch]'"
        ) from None
    return torch


def to_torch(array: np.ndarray) -> Any:
    """A numpy array (bfloat16 included) as a CPU torch tensor."""
    torch = _torch()
    array = np.ascontiguousarray(array)
    if not array.flags.writeable:  # a view of a jax array: torch wants memory it may write
        array = array.copy()
    if array.dtype.name == "bfloat16":  # no numpy bfloat16 in torch.from_numpy: move the bits
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def _shards(names: list[str], sizes: Mapping[str, int], limit: int) -> list[list[str]]:
    """Consecutive groups of at most `limit` bytes (a larger tensor gets a shard of its own)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        if shards[-1] and used + sizes[name] > limit:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += sizes[name]
    return shards


def write_reference(
    state_dict: Mapping[str, np.ndarray], config: Mapping[str, Any], out: Path, shard_size: int
) -> list[str]:
    """Write `config.json` and the weights into the (existing, empty) folder `out`; the files written.

    The tied `lm_head.weight` shares the embedding's storage, as in the reference model, and is saved
    in the embedding's shard."""
    torch = _torch()
    tensors = {k: to_torch(v) for k, v in state_dict.items() if k != TIED_KEY}
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    (out / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n")
    total = sum(sizes.values())
    groups = _shards(list(tensors), sizes, shard_size)
    for group in groups:
        if EMBEDDING_KEY in group:
            group.append(TIED_KEY)
    tensors[TIED_KEY] = tensors[EMBEDDING_KEY]
    if len(groups) == 1:
        torch.save(tensors, out / WEIGHTS_FILE)
        return [CONFIG_FILE, WEIGHTS_FILE]
    files, weight_map = [], {}
    for i, group in enumerate(groups, 1):
        name = f"pytorch_model-{i:05d}-of-{len(groups):05d}.bin"
        torch.save({k: tensors[k] for k in group}, out / name)
        files.append(name)
        weight_map.update({k: name for k in group})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [CONFIG_FILE, *files, INDEX_FILE]


def _check_torch_header(path: Path) -> None:
    """torch.save writes a zip archive (a pickle in the legacy format): anything else is named as what it is."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as err:
        raise ReferenceFileError(
            f"{path} cannot be read ({err.strerror or err}); check the path and its permissions"
        ) from None
    if not head:
        raise ReferenceFileError(
            f"{path} is empty (0 bytes): a copy or download that did not finish? Copy the checkpoint file again"
        )
    if not head.startswith((b"PK\x03\x04", b"\x80")):
        raise ReferenceFileError(
            f"{path} is not a PyTorch checkpoint (it starts with {head!r}, neither torch.save's "
            f"zip archive nor its legacy pickle); give the .pt/.bin file that torch.save wrote"
        )


def _load_torch_file(path: Path) -> dict[str, Any]:
    torch = _torch()
    _check_torch_header(path)
    try:
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # tensors stay on disk
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            loaded = torch.load(path, map_location="cpu", weights_only=True)  # the legacy (non-zip) format
    except pickle.UnpicklingError as err:
        raise ReferenceFileError(
            f"{path} is refused by torch.load(weights_only=True): it holds more than tensors "
            f"(arbitrary pickled objects are never loaded) ({error_summary(err)})"
        ) from None
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, EOFError, IndexError, ... on damaged files
        raise ReferenceFileError(
            f"{path} is not a readable PyTorch checkpoint (truncated or damaged?): {error_summary(err)}"
        ) from None
    return _tensor_dict(loaded, path)


def _tensor_dict(loaded: Any, path: Path) -> dict[str, Any]:
    torch = _torch()
    if not isinstance(loaded, dict) or not all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in loaded.items()
    ):
        raise ReferenceFileError(f"{path} does not hold a state_dict (a dict of tensor names to tensors)")
    return loaded


def _load_safetensors(path: Path) -> dict[str, Any]:
    _torch()
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types
        raise ReferenceFileError(
            f"{path} is not a readable safetensors file (truncated or damaged?): {error_summary(err)}"
        ) from None


def _load_file(path: Path) -> dict[str, Any]:
    return _load_safetensors(path) if path.suffix == ".safetensors" else _load_torch_file(path)


def _load_sharded(folder: Path, index_file: str) -> dict[str, Any]:
    try:
        weight_map = json.loads((folder / index_file).read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ReferenceFileError(f"{folder / index_file} is not a shard index ({type(err).__name__}: {err})") from None
    wrong = (
        f"is a {type(weight_map).__name__}"
        if not isinstance(weight_map, dict)
        else next((f"maps {k!r} to {v!r}" for k, v in weight_map.items() if not isinstance(v, str)), None)
    )
    if wrong is not None:
        raise ReferenceFileError(
            f"{folder / index_file}: its weight_map {wrong}, where it maps each tensor name to "
            f"the file name of its shard; restore the index the checkpoint came with"
        )
    shards = sorted(set(weight_map.values()))
    missing = [s for s in shards if not (folder / s).is_file()]
    if missing:
        raise ReferenceFileError(
            f"{folder} lacks {len(missing)} of the {len(shards)} shards its {index_file} names: "
            f"{', '.join(missing[:4])}"
        )
    tensors: dict[str, Any] = {}
    for shard in shards:
        tensors.update(_load_file(folder / shard))
    absent = [k for k, s in weight_map.items() if k not in tensors]
    if absent:
        raise ReferenceFileError(
            f"{len(absent)} tensors of {index_file} are not in their shards "
            f"(e.g. {absent[0]} in {weight_map[absent[0]]})"
        )
    return tensors


def read_reference(src: Path) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """({name: torch tensor}, the config.json beside the weights or None) of a file or folder."""
    if src.is_dir():
        for index in (INDEX_FILE, SAFETENSORS_INDEX):
            if (src / index).is_file():
                tensors = _load_sharded(src, index)
                break
        else:
            found = [src / f for f in (WEIGHTS_FILE, SAFETENSORS_FILE) if (src / f).is_file()]
            if not found:
                raise ReferenceFileError(
                    f"{src} holds none of {INDEX_FILE}, {SAFETENSORS_INDEX}, {WEIGHTS_FILE}, {SAFETENSORS_FILE}"
                )
            tensors = _load_file(found[0])
        config_path = src / CONFIG_FILE
    elif src.is_file():
        tensors, config_path = _load_file(src), src.parent / CONFIG_FILE
    else:
        raise ReferenceFileError(f"{src} does not exist")
    if not config_path.is_file():
        return tensors, None
    try:
        config = json.loads(config_path.read_text())
        if not isinstance(config, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as err:
        raise ReferenceFileError(f"{config_path} is not a config.json ({err})") from None
    return tensors, config
