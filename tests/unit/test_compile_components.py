"""What compile.enable compiles and how it splits forward from backward, as torchtitan's options
ask: ``compile.components`` names the model, the loss or both (dynamo's own count of the graphs
it captured shows which was compiled); ``activation_checkpoint.mode memory_budget`` lets the
partitioner recompute forward matmuls in backward (counted as the compiled backward runs)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode

from config.manager import load_config
from models.builder import build_model
from models.llama3 import llama3_flavors
from parallelisms.parallel_dims import ParallelDims
from trainer.loss import Loss

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], vocab_size=256, max_seq_len=16, n_layers=2)


@pytest.fixture(scope="module", autouse=True)
def process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def graphs_captured(run) -> int:
    before = counters["stats"]["unique_graphs"]
    run()
    return counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("components", ["model,loss", "model", "loss"])
def test_components_name_what_is_compiled(components):
    torch._dynamo.reset()
    config = load_config(
        [
            *("--compile.enable", "--compile.backend", "aot_eager", "--compile.components", components),
            *("--training.mixed_precision_param", "float32", "--training.seq_len", str(ARGS.max_seq_len)),
        ]
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"), ARGS).parts[0]
    loss_fn = Loss(2 * ARGS.max_seq_len, dims, config.compile, config.parallelism.enable_loss_parallel)
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    outputs = {}
    model_graphs = graphs_captured(lambda: outputs.setdefault("logits", model(tokens)))
    loss_graphs = graphs_captured(lambda: loss_fn(outputs["logits"], tokens).backward())
    # Per-block compile: one graph for both blocks; the loss: one graph.
    assert (model_graphs, loss_graphs) == (int("model" in components), int("loss" in components))


class MatmulCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def backward_matmuls(*overrides: str) -> int:
    """Matmuls in one backward of the debug model cut to 2 blocks, per-block compiled."""
    torch._dynamo.reset()
    config = load_config(
        [
            *("--compile.enable", "--compile.backend", "aot_eager", *overrides),
            *("--training.mixed_precision_param", "float32", "--training.seq_len", str(ARGS.max_seq_len)),
        ]
    )
    dims = ParallelDims(dp_replicate=1, dp_shard=1, tp=1, pp=1, world_size=1)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"), ARGS).parts[0]
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    logits = model(tokens)
    with MatmulCounter() as counter:
        logits.sum().backward()
    return counter.count


def test_memory_budget_trades_recomputed_matmuls_for_memory():
    budget = ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget"]
    # Two per forward matmul (7 a block, and the eager output projection's), as without checkpointing...
    assert backward_matmuls(*budget, "1") == backward_matmuls() == 2 * (2 * 7 + 1)
    # ...and at budget 0 the forward's matmuls again, but for the last one of each block, whose
    # output backward does not need (full checkpointing recomputes the same 6).
    assert backward_matmuls(*budget, "0") == 2 * (2 * 7 + 1) + 2 * 6
