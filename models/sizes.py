"""A job's model sizes: the flavor's, a Hugging Face folder's ``config.json``, then [model]'s fields."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any

from config.errors import ConfigError, user_input
from config.job_config import MODEL_SIZE_FIELDS, JobConfig
from models.registry import get_flavor, get_model_spec

logger = logging.getLogger(__name__)


def model_args(
    config: JobConfig, vocab_size: int | None = None, hf_config: dict | None = None, source: str = ""
) -> Any:
    """The flavor's sizes, replaced by ``hf_config``'s, then by the [model] fields set. The vocabulary is the
    tokenizer's unless a [model] field or the file gives one, which must then hold every token id."""
    spec = get_model_spec(config.model.name)
    args = get_flavor(spec, config.model.flavor)
    if hf_config is not None:
        args = spec.args_from_hf_fn(hf_config, args, source)
    overrides = {name: value for name in MODEL_SIZE_FIELDS if (value := getattr(config.model, name)) is not None}
    if overrides.keys() & {"ffn_dim_multiplier", "multiple_of"} and "ffn_dim" not in overrides:
        overrides["ffn_dim"] = None  # derive the width from what was asked
    args = dataclasses.replace(args, max_seq_len=config.training.seq_len, **overrides)
    if args.max_position_embeddings is not None and args.max_seq_len > args.max_position_embeddings:
        # RoPE runs at any length, but the weights never saw positions past their context.
        positions = (
            f"the {args.max_position_embeddings} positions of {source or config.model.name + ' ' + config.model.flavor}"
        )
        logger.warning(f"training.seq_len {args.max_seq_len} is longer than {positions} (max_position_embeddings)")
    if vocab_size is None or vocab_size == args.vocab_size:
        return args
    if "vocab_size" in overrides or hf_config is not None:
        if vocab_size > args.vocab_size:
            given = "model.vocab_size" if "vocab_size" in overrides else f"vocab_size of {source}"
            raise ConfigError(
                f"model.tokenizer_path: the tokenizer has {vocab_size} tokens but {given} is {args.vocab_size}"
            )
        return args
    # As in torchtitan, the embedding and output follow the tokenizer, whatever the flavor says.
    flavor = f"{config.model.name} {config.model.flavor}"
    logger.warning("model vocabulary: %d tokens from the tokenizer (%s has %d)", vocab_size, flavor, args.vocab_size)
    return dataclasses.replace(args, vocab_size=vocab_size)


CONFIG_NAME = "config.json"


def is_hf_folder(path: str) -> bool:
    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, CONFIG_NAME)):
        return False
    return any(name.endswith(".safetensors") for name in os.listdir(path))


def missing(path: str) -> ValueError:
    return ValueError(f"HF checkpoint: {path} does not exist")


def read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise missing(path) from None
    except (OSError, ValueError) as exc:  # not JSON or not UTF-8
        raise ValueError(f"HF checkpoint: cannot read {path}: {exc}") from None


def read_hf_config(folder: str) -> dict:
    if not os.path.isdir(folder):
        raise ValueError(f"HF checkpoint: {folder} does not exist or is not a folder")
    return read_json(os.path.join(folder, CONFIG_NAME))


def architecture_folder(config: JobConfig) -> tuple[str, str] | None:
    """(option, folder) of the HF folder giving the model's sizes, or None for the flavor's."""
    architecture = config.model.architecture
    if architecture == "flavor":
        return None
    if architecture == "auto":
        path = config.checkpoint.initial_load_path
        return ("checkpoint.initial_load_path", path) if path and is_hf_folder(path) else None
    folder = os.path.dirname(architecture) if os.path.basename(architecture) == CONFIG_NAME else architecture
    return "model.architecture", folder


def job_model_args(config: JobConfig, vocab_size: int | None = None) -> Any:
    """``model_args`` of the job; ConfigError naming the option when its HF folder cannot give them."""
    found = architecture_folder(config)
    if found is None:
        return model_args(config, vocab_size)
    option, folder = found
    with user_input(option):
        return model_args(config, vocab_size, read_hf_config(folder), os.path.join(folder, CONFIG_NAME))
