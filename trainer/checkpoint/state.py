"""The model, optimizer and train state as DCP's Stateful objects, under the full model's names (as
DTensors, so that DCP reshards them at another layout)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from models.sizes import is_hf_folder
from parallelisms.float8 import plain_tensor
from trainer.checkpoint import integrity
from trainer.checkpoint.hf import load_hf_weights
from trainer.optim import optimizers_holding_state


def whole_model(model_parts: list[nn.Module]) -> nn.Module:
    """One module over this rank's pipeline stages, under the full model's names, so that a
    checkpoint written at one pipeline layout loads at another."""
    if len(model_parts) == 1:
        return model_parts[0]
    root = nn.Module()
    for part in model_parts:
        if next(part.parameters(recurse=False), None) is not None:
            raise ValueError(f"{type(part).__name__} has parameters outside its sub-modules")
        for name, child in part.named_children():
            if isinstance(child, nn.ModuleDict):
                if name not in root._modules:
                    root.add_module(name, nn.ModuleDict())
                root._modules[name].update(child)
            else:
                root.add_module(name, child)
    return root


def _plain_tensors(state_dict: dict[str, Any]) -> dict[str, Any]:
    # Float8-gathered weights and their optimizer state are saved as the tensors they wrap (sharing
    # their storage, so loads land in them too): checkpoints of float8 runs load without float8.
    return {key: plain_tensor(value) if isinstance(value, torch.Tensor) else value for key, value in state_dict.items()}


class ModelState(Stateful):
    def __init__(self, model: nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return _plain_tensors(get_model_state_dict(self.model))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state_dict)


def load_model_weights(model: nn.Module, path: str) -> None:
    """The weights of a Hugging Face folder, or of a DCP checkpoint folder saved at any layout (DCP
    reshards), into ``model``; this rank's share of the DCP files is checked against the checkpoint's
    marker first (integrity.CheckpointError names a damaged one)."""
    if is_hf_folder(path):
        load_hf_weights([model], path)
        return
    rank, world_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    integrity.verify_files(path, require_marker=False, rank=rank, world_size=world_size)
    dcp.load({"model": ModelState(model)}, checkpoint_id=path)


class OptimizerState(Stateful):
    """Optimizer state keyed by parameter name (not by position), so it reshards with the model."""

    _OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.model = model
        self.optimizers = optimizers_holding_state(optimizer)

    def state_dict(self) -> dict[str, Any]:
        return _plain_tensors(get_optimizer_state_dict(self.model, self.optimizers, options=self._OPTIONS))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizers, state_dict, options=self._OPTIONS)


class TrainState(Stateful):
    """The step counter and the random-number generators' state."""

    def __init__(self, get_step: Callable[[], int], set_step: Callable[[int], None], device: torch.device):
        self.get_step = get_step
        self.set_step = set_step
        self.device = device

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.get_step(), "cpu_rng": torch.get_rng_state()}
        if self.device.type != "cpu":
            state["device_rng"] = torch.get_device_module(self.device).get_rng_state()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.set_step(int(state_dict["step"]))
        torch.set_rng_state(state_dict["cpu_rng"])
        if "device_rng" in state_dict:
            torch.get_device_module(self.device).set_rng_state(state_dict["device_rng"])
