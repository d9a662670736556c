"""Export to and import from Hugging Face ``LlamaForCausalLM`` safetensors folders, of the model
parts as they are (plain tensors or DTensors, pipeline stages spread over ranks); the conversion
of names and layouts is ``models.llama3.hf_adapter``'s."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from config.errors import first_few
from config.job_config import JobConfig
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
from models.sizes import CONFIG_NAME, architecture_folder, is_hf_folder, missing, read_hf_config, read_json
from parallelisms.names import clean_name
from trainer.data.tokenizer import (
    DEFAULT_TOKENIZER_HF_CONFIG,
    HF_CONFIG_FILE,
    HF_TOKENIZER_FILE,
    MODEL_FILE,
    default_tokenizer_path,
    hf_tokenizer_files,
)

SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # HF's default "5GB"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _full_cpu_state_dict(parts: Iterable[nn.Module]) -> dict[str, torch.Tensor]:
    """Unsharded CPU copies of the parts' parameters, under clean names (collective on each mesh)."""
    out: dict[str, torch.Tensor] = {}
    for part in parts:
        for name, tensor in part.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            out[clean_name(name)] = tensor.detach().cpu()
    return out


def _gather_to_rank0(local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Union of every rank's ``local`` on rank 0, each key sent once (not by data-parallel replicas)."""
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


@dataclass
class ExportAssets:
    """What an export holds besides the weights, so that it loads like an official folder."""

    config: dict = field(default_factory=dict)  # fields added to config.json (bos/eos ids)
    generation_config: dict | None = None  # generation_config.json's content
    files: dict[str, str] = field(default_factory=dict)  # name in the export -> the file copied there
    tokenizer_config: dict | None = None  # tokenizer_config.json's, when no tokenizer file gives one


# The files of a Hugging Face tokenizer folder that an export copies.
TOKENIZER_FILES = (HF_TOKENIZER_FILE, HF_CONFIG_FILE, "special_tokens_map.json", MODEL_FILE)
GENERATION_CONFIG = "generation_config.json"


def job_export_assets(config: JobConfig, bos_id: int, eos_id: int) -> ExportAssets:
    """The export's assets: the bos/eos ids and generation config of the HF folder the job started
    from (its weights, else its architecture; official folders list several eos ids), else the
    tokenizer's, and the tokenizer's files (the default one's when model.tokenizer_path is empty)."""
    source = config.checkpoint.initial_load_path
    if not (source and is_hf_folder(source)):
        source = found[1] if (found := architecture_folder(config)) else ""
    model = config.model
    tokenizer_path = model.tokenizer_path or default_tokenizer_path(
        config.job.cache_dir, model.default_tokenizer_vocab_size
    )
    source_config = read_hf_config(source) if source else {}
    ids = {
        "bos_token_id": source_config.get("bos_token_id", bos_id),
        "eos_token_id": source_config.get("eos_token_id", eos_id),
    }
    generation_path = os.path.join(source, GENERATION_CONFIG)
    generation = read_json(generation_path) if source and os.path.isfile(generation_path) else dict(ids)
    if os.path.isdir(tokenizer_path):
        candidates = {name: os.path.join(tokenizer_path, name) for name in TOKENIZER_FILES}
        files = {name: path for name, path in candidates.items() if os.path.isfile(path)}
    elif tokenizer_path.endswith(".json"):
        # The loader read the tokenizer_config.json beside it too (special tokens, BOS/EOS).
        files = {HF_TOKENIZER_FILE: tokenizer_path}
        if os.path.isfile(config_path := hf_tokenizer_files(tokenizer_path)[1]):
            files[HF_CONFIG_FILE] = config_path
    else:  # a sentencepiece / tiktoken file: HF names it tokenizer.model
        files = {MODEL_FILE: tokenizer_path}
    tokenizer_config = None if model.tokenizer_path else DEFAULT_TOKENIZER_HF_CONFIG
    return ExportAssets(config=ids, generation_config=generation, files=files, tokenizer_config=tokenizer_config)


_SHARD_FILE = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def files_no_export_wrote(folder: str) -> list[str]:
    """The entries of an export ``folder`` that no export writes (a user's model card, say)."""
    if not os.path.isdir(folder):
        return []
    ours = {CONFIG_NAME, SINGLE_FILE, INDEX_NAME, GENERATION_CONFIG, *TOKENIZER_FILES}
    return sorted(
        name
        for name in os.listdir(folder)
        if not (os.path.isfile(os.path.join(folder, name)) and (name in ours or _SHARD_FILE.fullmatch(name)))
    )


def _make_folder_beside(folder: str, kind: str) -> str:
    """A new empty folder next to ``folder``, created with the umask's mode (not mkdtemp's 0700)."""
    path = os.path.join(os.path.dirname(folder), f".{os.path.basename(folder)}.{kind}-{uuid.uuid4().hex[:12]}")
    os.mkdir(path)
    return path


def _write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _write_folder(
    folder: str, tensors: dict[str, torch.Tensor], config: dict, max_shard_bytes: int, assets: ExportAssets
) -> None:
    """Writes the export beside ``folder`` and renames it: a crash leaves no half-written export."""
    folder = os.path.abspath(folder)
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = _make_folder_beside(folder, "tmp")
    try:
        _write_json(os.path.join(tmp, CONFIG_NAME), {**config, **assets.config})
        # safetensors writes 0600 files; give the weights the mode open() gave config.json (umask).
        mode = os.stat(os.path.join(tmp, CONFIG_NAME)).st_mode & 0o777
        shards = _plan_shards(tensors, max_shard_bytes)
        metadata = {"format": "pt"}  # transformers refuses safetensors files without it
        names = (
            [SINGLE_FILE]
            if len(shards) == 1
            else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
        )
        for filename, keys in zip(names, shards):
            save_file({k: tensors[k] for k in keys}, os.path.join(tmp, filename), metadata=metadata)
            os.chmod(os.path.join(tmp, filename), mode)
        if len(shards) > 1:
            weight_map = {key: filename for filename, keys in zip(names, shards) for key in keys}
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            _write_json(os.path.join(tmp, INDEX_NAME), {"metadata": {"total_size": total}, "weight_map": weight_map})
        if assets.generation_config is not None:
            _write_json(os.path.join(tmp, GENERATION_CONFIG), assets.generation_config)
        for name, path in assets.files.items():
            shutil.copyfile(path, os.path.join(tmp, name))
        if assets.tokenizer_config is not None:
            _write_json(os.path.join(tmp, HF_CONFIG_FILE), assets.tokenizer_config)
        if os.path.exists(folder):
            # Move the old export aside first: the final name always holds a complete folder.
            old = _make_folder_beside(folder, "old")
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
    assets: ExportAssets | None = None,
) -> None:
    """Writes the model as an HF folder in ``dtype``; collective: rank 0 writes, every rank raises its error."""
    local = _full_cpu_state_dict(model_parts)
    merged = _gather_to_rank0(local)
    del local
    failure: Exception | None = None
    if not _distributed() or dist.get_rank() == 0:
        try:
            expected = hf_param_shapes(model_args, tied=model_args.tie_word_embeddings)
            hf = to_hf_state_dict(merged, model_args)
            missing = [k for k in expected if k not in hf]
            if missing:
                raise ValueError(f"HF export to {folder}: the model parts do not hold '{missing[0]}'")
            # Order as HF does (by layer); contiguous, since save_file needs it.
            tensors = {k: hf[k].to(dtype).contiguous() for k in expected}
            _write_folder(folder, tensors, hf_config(model_args, dtype), max_shard_bytes, assets or ExportAssets())
        except Exception as exc:
            failure = exc
    if _distributed():
        # Share rank 0's outcome so that no rank returns believing a failed export exists.
        outcome = [None if failure is None else f"{type(failure).__name__}: {failure}"]
        dist.broadcast_object_list(outcome, src=0)
        if failure is None and outcome[0] is not None:
            raise RuntimeError(f"HF export to {folder} failed on rank 0: {outcome[0]}")
    if failure is not None:
        raise failure


class StoredWeight(NamedTuple):
    """A weight as a safetensors header describes it."""

    path: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: F32, BF16, I32, ...


def _weight_files(folder: str) -> dict[str, StoredWeight]:
    """HF key -> where and how it is stored; reads headers only."""
    index_path = os.path.join(folder, INDEX_NAME)
    if os.path.isfile(index_path):
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(name, str) for name in weight_map.values()):
            raise ValueError(f"HF checkpoint: {index_path} has no 'weight_map' of tensor names to file names")
        files = sorted(set(weight_map.values()))
    elif os.path.isfile(os.path.join(folder, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ValueError(f"HF checkpoint: {folder} has neither {SINGLE_FILE} nor {INDEX_NAME}")
    out: dict[str, StoredWeight] = {}
    for name in files:
        path = os.path.join(folder, name)
        with _safetensors(path) as f:
            for key in f.keys():
                header = f.get_slice(key)
                out[key] = StoredWeight(path, tuple(header.get_shape()), header.get_dtype())
    return out


@contextlib.contextmanager
def _safetensors(path: str) -> Iterator[Any]:
    """The safetensors file at ``path``, open; ValueError when it is missing or broken."""
    try:
        with safe_open(path, framework="pt") as f:
            yield f
    except FileNotFoundError:
        raise missing(path) from None
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"HF checkpoint: {path} is not a valid safetensors file ({exc})") from None


def _read_tensors(files: dict[str, StoredWeight], keys: Iterable[str]) -> dict[str, torch.Tensor]:
    """Reads ``keys`` from their files; ValueError for NaN or infinity (every attempt's first loss)."""
    by_file: dict[str, list[str]] = {}
    for key in keys:
        by_file.setdefault(files[key].path, []).append(key)
    out = {}
    for path, file_keys in by_file.items():
        with _safetensors(path) as f:
            for key in file_keys:
                out[key] = f.get_tensor(key)
                _check_finite(out[key], path, key)
    return out


def _check_finite(tensor: torch.Tensor, path: str, key: str) -> None:
    # NaN and infinity carry through a sum, which is ~50x faster than isfinite() on a CPU; only a
    # sum that is not finite (which finite float16 values can overflow to) is looked at value by value.
    if torch.isfinite(tensor.sum()):
        return
    if bad := tensor.numel() - int(torch.isfinite(tensor).sum()):
        raise ValueError(f"HF checkpoint: {path}: {bad} of the {tensor.numel()} values of '{key}' are NaN or infinite")


# The dtypes of the weights a folder may hold: the floating-point ones torch computes in.
WEIGHT_DTYPES = ("F16", "BF16", "F32", "F64")


def check_hf_folder(folder: str, args: TransformerModelArgs) -> tuple[dict[str, StoredWeight], bool]:
    """(HF key -> how every weight is stored, whether the table is tied) of the folder the model of
    ``args`` will load; ValueError naming every way it differs."""
    config_path = os.path.join(folder, CONFIG_NAME)
    config = read_hf_config(folder)
    mismatches = config_mismatches(args_from_hf_config(config, base=args, source=config_path), args)
    if mismatches:
        raise ValueError(f"HF checkpoint: {config_path} does not match the model: {'; '.join(mismatches)}")
    # Old HF exports also saved the (recomputable) rotary table; it is not a weight.
    files = {k: v for k, v in _weight_files(folder).items() if not k.endswith("rotary_emb.inv_freq")}
    # Tied checkpoints (e.g. Llama 3.2 1B) have no lm_head: an untied output starts as a copy.
    tied = bool(config.get("tie_word_embeddings", False)) and "lm_head.weight" not in files
    expected = hf_param_shapes(args, tied=tied or args.tie_word_embeddings)
    problems = []
    if missing := [f"'{k}'" for k in expected if k not in files]:
        problems.append(f"is missing {first_few(missing)}")
    if unexpected := [f"'{k}'" for k in files if k not in expected]:
        problems.append(f"has unexpected {first_few(unexpected)}")
    for key, weight in files.items():
        if key in expected and weight.shape != expected[key]:
            problems.append(f"'{key}' has shape {list(weight.shape)}, expected {list(expected[key])}")
    # Loading would cast other dtypes without a word (integers make a model of small whole numbers).
    if wrong := [
        f"'{k}' in {os.path.basename(w.path)} is {w.dtype}" for k, w in files.items() if w.dtype not in WEIGHT_DTYPES
    ]:
        problems.append(f"{first_few(wrong)}; weights must be {', '.join(WEIGHT_DTYPES[:-1])} or {WEIGHT_DTYPES[-1]}")
    if problems:
        raise ValueError(f"HF checkpoint: {folder} {'; '.join(problems)}")
    return files, tied


def load_hf_weights(model_parts: list[nn.Module], folder: str) -> None:
    """Loads an HF folder into the model parts, in place: every rank reads only the tensors its parts
    hold and keeps its shard of each, without communication."""
    args: TransformerModelArgs = model_parts[0].args
    files, tied = check_hf_folder(folder, args)
    expected = hf_param_shapes(args, tied=tied or args.tie_word_embeddings)
    for part in model_parts:
        targets = part.state_dict()
        wanted = {clean_name(name) for name in targets}
        from_embedding = "lm_head.weight" not in expected and "output.weight" in wanted
        hf_keys = [k for k in expected if from_hf_key(k) in wanted] + ["model.embed_tokens.weight"] * from_embedding
        hf_tensors = _read_tensors(files, set(hf_keys))
        if from_embedding:
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
