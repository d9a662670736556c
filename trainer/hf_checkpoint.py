"""Export to and import from Hugging Face ``LlamaForCausalLM`` safetensors folders.

Works on the trainer's model parts as they are: plain tensors in one process, or DTensors
(FSDP2, SimpleFSDP, TP) under ``torch.distributed``, with pipeline stages spread over ranks.
The names and layout conversion lives in ``models.llama3.hf_adapter``.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from models.llama3.hf_adapter import (
    args_from_hf_config,
    config_mismatches,
    from_hf_key,
    from_hf_state_dict,
    hf_config,
    hf_param_shapes,
    to_hf_state_dict,
)
from models.llama3.model import TransformerModelArgs
from parallelisms.names import clean_name

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # HF's default "5GB"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


# ---------------------------------------------------------------------------
# Export
# ---------------------------------------------------------------------------


def _full_cpu_state_dict(parts: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of the parts' parameters, under clean names.

    Collective: ``full_tensor`` gathers over each DTensor's mesh, so every rank of that mesh must
    call this with its parts in the same order (true for ranks of one pipeline stage).
    """
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            out[clean_name(name)] = tensor.detach().cpu()
    return out


def _gather_to_rank0(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union of every rank's ``local`` on rank 0 (empty dict elsewhere).

    Each key is sent once, by the lowest rank holding it, so data-parallel replicas of a stage
    send nothing; this only moves data between pipeline stages.
    """
    if not _distributed():
        return local
    all_keys: list[list[str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(all_keys, sorted(local))
    owner: dict[str, int] = {}
    for rank, keys in enumerate(all_keys):
        for key in keys or []:
            owner.setdefault(key, rank)
    rank = dist.get_rank()
    mine = {key: tensor for key, tensor in local.items() if owner[key] == rank}
    received: list[dict[str, torch.Tensor]] | None = [{} for _ in all_keys] if rank == 0 else None
    dist.gather_object(mine, received, dst=0)
    return {key: t for part in received for key, t in part.items()} if received is not None else {}


def _plan_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Keys grouped into files of at most ``max_shard_bytes`` (a bigger tensor gets its own file)."""
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    return shards


def _write_folder(folder: str, tensors: dict[str, torch.Tensor], config: dict, max_shard_bytes: int) -> None:
    """Writes the export into a temporary sibling folder and renames it to ``folder``, so a crash
    never leaves a half-written export under the final name."""
    folder = os.path.abspath(folder)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.tmp-", dir=parent)
    try:
        shards = _plan_shards(tensors, max_shard_bytes)
        metadata = {"format": "pt"}  # transformers refuses safetensors files without it
        if len(shards) == 1:
            save_file(tensors, os.path.join(tmp, SINGLE_FILE), metadata=metadata)
        else:
            weight_map = {}
            for i, keys in enumerate(shards):
                filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({k: tensors[k] for k in keys}, os.path.join(tmp, filename), metadata=metadata)
                weight_map.update(dict.fromkeys(keys, filename))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            with open(os.path.join(tmp, INDEX_NAME), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=2)
        if os.path.exists(folder):
            # Move the old export aside first: the final name always holds a complete folder.
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(folder)}.old-", dir=parent)
            os.rename(folder, os.path.join(old, "export"))
            os.rename(tmp, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def export_hf(
    model_parts: list[nn.Module],
    model_args: TransformerModelArgs,
    folder: str,
    dtype: torch.dtype,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Writes the model as an HF ``LlamaForCausalLM`` folder (``config.json`` + safetensors in
    ``dtype``). Collective under ``torch.distributed``: every rank calls it with its own parts;
    rank 0 writes, and every rank returns once the folder is complete (or raises if it failed)."""
    local = _full_cpu_state_dict(model_parts)
    merged = _gather_to_rank0(local)
    del local
    failure: Exception | None = None
    if _rank() == 0:
        try:
            expected = hf_param_shapes(model_args)
            hf = to_hf_state_dict(merged, model_args)
            missing = [k for k in expected if k not in hf]
            if missing:
                raise ValueError(f"HF export to {folder}: the model parts do not hold '{missing[0]}'")
            # Order as HF does (by layer); contiguous, since save_file needs it.
            tensors = {k: hf[k].to(dtype).contiguous() for k in expected}
            _write_folder(folder, tensors, hf_config(model_args, dtype), max_shard_bytes)
        except Exception as exc:
            if not _distributed():
                raise
            failure = exc
    if _distributed():
        # Share rank 0's outcome so that no rank returns believing a failed export exists.
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(outcome, src=0)
        if failure is not None:
            raise failure
        if outcome[0] is not None:
            raise RuntimeError(f"HF export to {folder} failed on rank 0: {outcome[0]}")


# ---------------------------------------------------------------------------
# Import
# ---------------------------------------------------------------------------


def is_hf_folder(path: str) -> bool:
    """True if ``path`` is a folder with a ``config.json`` and at least one ``.safetensors`` file."""
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return False
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"HF checkpoint: {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"HF checkpoint: cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"HF checkpoint: {path} is not a JSON object")
    return data


def _weight_files(folder: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF key -> (path of the safetensors file holding it, shape); reads headers only."""
    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"HF checkpoint: {index_path} has no 'weight_map'")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ValueError(f"HF checkpoint: {folder} has neither {SINGLE_FILE} nor {INDEX_NAME}")
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name in files:
        path = os.path.join(folder, name)
        try:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    out[key] = path, tuple(f.get_slice(key).get_shape())
        except FileNotFoundError:
            raise ValueError(f"HF checkpoint: {path} does not exist") from None
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"HF checkpoint: {path} is not a valid safetensors file ({exc})") from None
    return out


def _read_tensors(files: dict[str, tuple[str, tuple[int, ...]]], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Reads ``keys`` (HF names) from their files, opening each file once."""
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(files[key][0], []).append(key)
    out = {}
    for path, file_keys in by_file.items():
        try:
            with safe_open(path, framework="pt") as f:
                for key in file_keys:
                    out[key] = f.get_tensor(key)
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"HF checkpoint: {path} is not a valid safetensors file ({exc})") from None
    return out


def _model_args(model_parts: list[nn.Module]) -> TransformerModelArgs:
    args = getattr(model_parts[0], "args", None) if model_parts else None
    if not isinstance(args, TransformerModelArgs):
        raise ValueError("HF import: the model parts must be Llama 3 Transformers (with .args)")
    return args


def check_hf_config(folder: str, args: TransformerModelArgs) -> dict:
    """The folder's ``config.json``; ValueError naming every way it differs from ``args``."""
    if not os.path.isdir(folder):
        raise ValueError(f"HF checkpoint: {folder} does not exist or is not a folder")
    config_path = os.path.join(folder, CONFIG_NAME)
    config = _read_json(config_path)
    mismatches = config_mismatches(args_from_hf_config(config, base=args, source=config_path), args)
    if mismatches:
        raise ValueError(f"HF checkpoint: {config_path} does not match the model: {'; '.join(mismatches)}")
    return config


def load_hf_weights(model_parts: list[nn.Module], folder: str) -> None:
    """Loads an HF ``LlamaForCausalLM`` folder into the model parts, in place.

    Every rank reads the files itself (only the tensors its parts hold) and keeps its shard of
    each DTensor parameter, so no communication is needed. The file must hold the full model and
    match the parts' args; otherwise ValueError naming the folder and what differs.
    """
    args = _model_args(model_parts)
    config = check_hf_config(folder, args)

    # Old HF exports also saved the (recomputable) rotary table; it is not a weight.
    files = {k: v for k, v in _weight_files(folder).items() if not k.endswith("rotary_emb.inv_freq")}
    # Tied checkpoints (e.g. Llama 3.2 1B) have no lm_head: our untied output starts as a copy.
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in files
    expected = hf_param_shapes(args, tied=tied)
    missing = [k for k in expected if k not in files]
    if missing:
        raise ValueError(f"HF checkpoint: {folder} is missing '{missing[0]}'")
    unexpected = [k for k in files if k not in expected]
    if unexpected:
        raise ValueError(f"HF checkpoint: {folder} has unexpected key '{unexpected[0]}'")
    for key, (_, shape) in files.items():
        if shape != expected[key]:
            raise ValueError(
                f"HF checkpoint: {folder}: '{key}' has shape {list(shape)}, expected {list(expected[key])}"
            )

    for part in model_parts:
        targets = part.state_dict()
        wanted = {clean_name(name) for name in targets}
        hf_keys = [k for k in expected if from_hf_key(k) in wanted]
        if tied and "output.weight" in wanted:
            hf_keys.append("model.embed_tokens.weight")
        hf_tensors = _read_tensors(files, set(hf_keys))
        if tied and "output.weight" in wanted:
            hf_tensors["lm_head.weight"] = hf_tensors["model.embed_tokens.weight"]
        ours = from_hf_state_dict(hf_tensors, args)
        new_state = {name: _like(ours[clean_name(name)], target) for name, target in targets.items()}
        part.load_state_dict(new_state, strict=True)


def _like(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``full`` with ``target``'s dtype and device, sharded like it if it is a DTensor."""
    if isinstance(target, DTensor):
        full = full.to(dtype=target.dtype, device=target.to_local().device)
        # Every rank holds the same full tensor: each slices its own shard, no broadcast.
        return distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
    return full.to(dtype=target.dtype, device=target.device)
