"""``training.mixed_precision_param`` on one process: data parallelism over its one rank casts the
parameters to bfloat16 for forward and backward and reduces gradients in float32, as it does on
many ranks; float32 leaves the model untouched. Layouts without data parallelism (tensor or
pipeline parallel alone) say so and train in float32.
tests/distributed/test_mixed_precision.py compares the losses of the layouts in bfloat16."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from config.manager import load_config
from models.builder import build_model, compute_dtype
from models.llama3 import llama3_flavors
from parallelisms.parallel_dims import ParallelDims

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256, max_seq_len=32, n_layers=2)
BF16 = ["--training.mixed_precision_param", "bfloat16"]


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def one_process(*overrides: str) -> tuple[torch.nn.Module, ParallelDims]:
    config = load_config(list(overrides))
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    dims.build_mesh("cpu")
    return build_model(config, dims, torch.device("cpu"), ARGS).parts[0], dims


def forward_backward(model: torch.nn.Module) -> tuple[torch.Tensor, torch.dtype]:
    """(logits, the dtype of the first projection's weight as forward used it)."""
    seen = {}

    def record(module: torch.nn.Module, args: tuple) -> None:
        seen.setdefault("dtype", module.weight.dtype)

    hook = model.layers["0"].attention.wq.register_forward_pre_hook(record)
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    logits.float().sum().backward()
    hook.remove()
    return logits, seen["dtype"]


@pytest.mark.parametrize("impl", ["fsdp2", "simple_fsdp"])
def test_one_process_computes_in_bfloat16_and_keeps_float32_gradients(impl):
    model, dims = one_process(*BF16, "--parallelism.data_parallel_impl", impl)
    logits, weight_dtype = forward_backward(model)
    assert weight_dtype == torch.bfloat16
    assert logits.dtype == torch.bfloat16
    for name, param in model.named_parameters():
        assert param.dtype == torch.float32, name  # the optimizer's copy stays float32
        assert param.grad is not None and param.grad.dtype == torch.float32, name
    assert compute_dtype(load_config(BF16), dims) == torch.bfloat16


def test_one_process_float32_is_left_alone():
    model, dims = one_process()
    logits, weight_dtype = forward_backward(model)
    assert weight_dtype == logits.dtype == torch.float32
    assert not any(isinstance(p, DTensor) for p in model.parameters())  # no data-parallel wrapper
    assert compute_dtype(load_config([]), dims) == torch.float32


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2), (2, 2)])
def test_layouts_without_data_parallelism_train_in_float32(tp, pp):
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=tp, pp=pp, world_size=tp * pp)
    assert not dims.mixed_precision_enabled
    assert compute_dtype(load_config(BF16), dims) == torch.float32
    with_dp = ParallelDims(dp_replicate=1, dp_shard=2, tp=tp, pp=pp, world_size=2 * tp * pp)
    assert with_dp.mixed_precision_enabled


def test_precision_is_one_line(caplog):
    from models.builder import _log_precision

    without_dp = ParallelDims(dp_replicate=1, dp_shard=1, tp=2, pp=1, world_size=2)
    with_dp = ParallelDims(dp_replicate=1, dp_shard=2, tp=2, pp=1, world_size=4)
    with caplog.at_level(logging.INFO, logger="models.builder"):
        _log_precision(load_config(BF16), without_dp)
        _log_precision(load_config(BF16), with_dp)
        _log_precision(load_config([]), with_dp)  # float32: nothing to say
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (
            "WARNING",
            "training.mixed_precision_param bfloat16 / mixed_precision_reduce float32: only data parallelism "
            "(or one process) applies them; this layout (tp 2, pp 1, no data parallelism) trains in float32",
        ),
        ("INFO", "mixed precision: bfloat16 parameters in forward and backward, gradients reduced in float32"),
    ]
