"""``compile.components`` (torchtitan's option): ``compile.enable`` compiles the model, the loss or
both, as the list names. Dynamo's own count of the graphs it captured shows which was compiled."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

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
    loss_fn = Loss(config, dims, tokens_per_step=2 * ARGS.max_seq_len)
    tokens = torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len), generator=torch.Generator().manual_seed(0))
    outputs = {}
    model_graphs = graphs_captured(lambda: outputs.setdefault("logits", model(tokens)))
    loss_graphs = graphs_captured(lambda: loss_fn(outputs["logits"], tokens).backward())
    # Per-block compile: one graph for both blocks; the loss: one graph.
    assert (model_graphs, loss_graphs) == (int("model" in components), int("loss" in components))
