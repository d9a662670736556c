"""Float8 training with torchao: nn.Linear layers become ``Float8Linear``, whose matmuls cast their
inputs, weights and output gradients to float8 with dynamic scales and accumulate in high
precision. With FSDP2, tensorwise scaling can also gather the weights in float8; such weights, and
the optimizer state made from them, are torchao's subclass around the weight (``plain_tensor``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import sys
from collections.abc import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from parallelisms.device import float8_matmuls

# Float8 matmuls need every dim of the weight divisible by this (torch._scaled_mm's constraint).
_DIM_MULTIPLE = 16

# In filter_fqns (torchtitan's spelling): also leave the layers too small to gain from float8.
AUTO_FILTER = "auto_filter_small_kn"


@contextlib.contextmanager
def _quiet_import() -> Iterator[None]:
    # torchao warns on import about its CUDA kernels (not loadable without CUDA) and registers an
    # enum with torch's pytree in a way torch 2.13 deprecates; neither concerns float8 training.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def torchao_float8():
    """torchao's float8 module; ValueError when torchao is not installed."""
    try:
        with _quiet_import():
            import torchao.float8
    except ImportError:
        raise ValueError(
            "float8 training needs the torchao package, not installed here (pip install torchao)"
        ) from None
    return torchao.float8


def check_float8(device_type: str, emulate: bool) -> None:
    """ValueError without torchao, or on a device without float8 matmuls unless ``emulate``."""
    torchao_float8()
    if not emulate and not float8_matmuls(device_type):
        raise ValueError(
            f"this {device_type} device has no float8 matmuls (GPUs need compute capability 8.9 or more); "
            "emulate multiplies the float8-rounded values in high precision instead"
        )


def _converts(module: nn.Module, name: str, patterns: list[str]) -> bool:
    return (
        isinstance(module, nn.Linear)
        and all(size % _DIM_MULTIPLE == 0 for size in module.weight.shape)
        and not any(pattern in name for pattern in patterns)
    )


def check_filter_fqns(model: nn.Module, filter_fqns: list[str]) -> None:
    """ValueError naming each pattern of ``filter_fqns`` in no linear layer's name (a typo)."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if unmatched := [p for p in filter_fqns if p != AUTO_FILTER and not any(p in name for name in names)]:
        raise ValueError(
            f"{', '.join(repr(p) for p in unmatched)}: part of no linear layer's name "
            f"(they are {', '.join(_name_patterns(names))})"
        )


def _name_patterns(names: list[str]) -> list[str]:
    """The linear layers' names with block indices as N: layers.N.attention.wq, ..., output."""
    return list(dict.fromkeys(".".join("N" if part.isdecimal() else part for part in n.split(".")) for n in names))


def apply_float8(
    model: nn.Module, *, recipe_name: str, filter_fqns: list[str], emulate: bool, fsdp_float8_all_gather: bool
) -> list[str]:
    """Swaps ``model``'s nn.Linear layers for Float8Linear in place, except those named by
    ``filter_fqns``, with a dim not divisible by 16, or (``AUTO_FILTER``) too small for float8 by
    torchao's thresholds; returns the names swapped. Call it before tensor and data parallelism."""
    float8 = torchao_float8()
    config = dataclasses.replace(
        float8.Float8LinearConfig.from_recipe_name(recipe_name),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_float8_all_gather,
    )
    patterns = [pattern for pattern in filter_fqns if pattern != AUTO_FILTER]
    if AUTO_FILTER in filter_fqns:  # torchao's thresholds, with the same two checks as _converts
        converts = float8._auto_filter_for_recipe(recipe_name, filter_fqns=patterns)
    else:
        converts = functools.partial(_converts, patterns=patterns)
    swapped = []

    def wanted(module: nn.Module, name: str) -> bool:
        keep = converts(module, name)
        if keep:
            swapped.append(name)
        return keep

    float8.convert_to_float8_training(model, module_filter_fn=wanted, config=config)
    return swapped


def precompute_float8_scales(modules: Iterable[nn.Module]) -> None:
    """Computes all float8-gathered weights' scales in one all-reduce: call it after each step."""
    precompute = torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for module in modules:
        precompute(module)


def plain_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor inside torchao's float8-gathered weight subclass (in or out of a DTensor), sharing
    its storage; any other tensor as it is. A checkpoint would pickle the subclass."""
    fsdp_utils = sys.modules.get("torchao.float8.fsdp_utils")  # imported by float8 training only
    if fsdp_utils is None:
        return tensor
    local = tensor._local_tensor if isinstance(tensor, DTensor) else tensor
    if not isinstance(local, fsdp_utils.WeightWithDynamicFloat8CastTensor):
        return tensor
    if not isinstance(tensor, DTensor):
        return local._tensor
    with torch.no_grad():
        return DTensor.from_local(
            local._tensor,
            tensor.device_mesh,
            tensor.placements,
            run_check=False,
            shape=tensor.shape,
            stride=tensor.stride(),
        )
