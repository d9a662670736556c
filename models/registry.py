"""Model families: one entry each, so the trainer needs no family-specific code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.nn as nn

from config.errors import ConfigError


@dataclass(frozen=True)
class ModelSpec:
    name: str
    model_cls: type[nn.Module]
    flavors: dict[str, Any]
    # (meta model, parallel dims, config) -> the compile graph pass it built, or None.
    parallelize_fn: Callable[..., Any]
    # (model, parallel dims, config, device, materialize, loss fn) -> (schedule, stages, has first
    # stage, has last stage).
    pipelining_fn: Callable[..., Any]
    # (model args, parallel dims, config): the ConfigError parallelizing would raise, without weights.
    check_layout_fn: Callable[..., None]
    # (model args, model, seq_len) -> training FLOPs per token, for MFU.
    flops_per_token_fn: Callable[[Any, nn.Module, int], float]
    # (HF config.json, args giving what it lacks, its path) -> model args; ValueError naming the path.
    args_from_hf_fn: Callable[[dict, Any, str], Any]
    # (model part, parallel dims, config) -> compiled SimpleFSDP's BucketPlan, or None.
    bucket_plan_fn: Callable[..., Any]


def _llama3_spec() -> ModelSpec:
    from models.llama3 import Transformer, flops_per_token, llama3_flavors, num_params
    from models.llama3.hf_adapter import args_from_hf_config
    from models.llama3.parallelize import bucket_plan, check_llama_layout, parallelize_llama
    from models.llama3.pipeline import pipeline_llama

    def llama_flops(args: Any, model: nn.Module, seq_len: int) -> float:
        return flops_per_token(args, num_params(model, exclude_embedding=True), seq_len)

    return ModelSpec(
        "llama3",
        Transformer,
        llama3_flavors,
        parallelize_llama,
        pipeline_llama,
        check_llama_layout,
        llama_flops,
        args_from_hf_config,
        bucket_plan,
    )


_REGISTRY: dict[str, Callable[[], ModelSpec]] = {"llama3": _llama3_spec}


def get_model_spec(name: str) -> ModelSpec:
    if name not in _REGISTRY:
        raise ConfigError(f"model.name: unknown model '{name}'; known: {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


def get_flavor(spec: ModelSpec, flavor: str) -> Any:
    if flavor not in spec.flavors:
        raise ConfigError(f"model.flavor: '{flavor}' is not a {spec.name} flavor; known: {', '.join(spec.flavors)}")
    return spec.flavors[flavor]
