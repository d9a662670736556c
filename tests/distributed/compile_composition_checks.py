"""torchrun worker: torch.compile composed with activation checkpointing, on 2 ranks.

Usage: torchrun --nproc-per-node 2 tests/distributed/compile_composition_checks.py

Each case builds a small Llama 3 with ``build_model`` (the trainer's path) from config
overrides, trains a few steps on fixed random tokens and prints, on rank 0, one line
``RESULT {json}`` with the case name, its losses, the graph breaks dynamo hit while compiling and
running it, the number of graphs it compiled and, read from torch's own graph logs (the
``graph_code`` and ``aot_graphs`` artifacts): the checkpoint regions in the graphs dynamo captured
(``tag_activation_checkpoint`` calls), the forward and backward graphs AOT autograd compiled and
the matmuls in each (a backward graph holds more than the forward's two per matmul only when it
recomputes forward matmuls). Layouts: FSDP2 (per-block compile), SimpleFSDP
(whole-model compile, manual buckets), both on 2 data-parallel ranks, and tensor parallel on 2
ranks (per-block compile of DTensor parameters). Each layout also runs once eagerly as a reference.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time

import torch
import torch.distributed as dist

from config.manager import load_config
from models.builder import BuiltModel, build_model
from models.llama3 import llama3_flavors
from parallelisms.compile import graph_break_count
from parallelisms.parallel_dims import ParallelDims
from parallelisms.tensor_parallel import local_loss
from train import exit_without_teardown
from trainer.loss import Loss

# 2 blocks: every-2nd-block checkpointing wraps block 1 and leaves block 0 plain.
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_heads=4, n_layers=2, vocab_size=256, max_seq_len=32)
BATCH, SEQ, STEPS = 2, 32, 5
COMPILE = ["--compile.enable", "--compile.backend", "aot_eager"]

LAYOUTS = {
    # name: (tp degree, overrides)
    "fsdp2": (1, ["--parallelism.data_parallel_impl", "fsdp2"]),
    "simple_fsdp": (1, ["--parallelism.data_parallel_impl", "simple_fsdp", "--compile.bucketing", "manual"]),
    "tp2": (2, ["--parallelism.tensor_parallel_degree", "2"]),
}
AC = {
    "none": ["--activation_checkpoint.mode", "none"],
    "full": ["--activation_checkpoint.mode", "full"],
    "selective_op": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "op"],
    "selective_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    # No checkpoint regions: the partitioner recomputes as much as it can.
    "memory_budget_0": ["--activation_checkpoint.mode", "memory_budget", "--activation_checkpoint.memory_budget", "0"],
    # Between 0 and 1 the partitioner sizes every value it could save, SimpleFSDP's meshes included.
    "memory_budget_0.3": [
        "--activation_checkpoint.mode",
        "memory_budget",
        "--activation_checkpoint.memory_budget",
        "0.3",
    ],
}
# (layout, compiled, ac)
CASES = [
    *((layout, False, "none") for layout in LAYOUTS),
    *(("fsdp2", True, ac) for ac in AC),
    *(("simple_fsdp", True, ac) for ac in AC),
    ("tp2", True, "none"),
    ("tp2", True, "full"),
]


# torch's loggers of the graphs dynamo captures and of the graphs AOT autograd compiles.
GRAPH_LOGGERS = ("torch._dynamo.output_graph.__graph_code", "torch._functorch._aot_autograd.graph_compile.__aot_graphs")


class GraphLog(logging.Handler):
    """Keeps the text of every graph torch logs: dynamo's captured graphs, AOT's forward and
    backward graphs."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.captured: list[str] = []
        self.forward: list[str] = []
        self.backward: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.name == GRAPH_LOGGERS[0]:
            self.captured.append(text)
        elif re.match(r"\s*TRACED GRAPH\s+=+\s+Forward graph", text):
            self.forward.append(text)
        elif re.match(r"\s*TRACED GRAPH\s+=+\s+Backward graph", text):
            self.backward.append(text)

    def install(self) -> None:
        for name in GRAPH_LOGGERS:
            log = logging.getLogger(name)
            log.setLevel(logging.DEBUG)
            log.propagate = False  # kept here, not printed
            log.addHandler(self)

    def clear(self) -> None:
        self.captured, self.forward, self.backward = [], [], []

    def counts(self) -> dict:
        def matmuls(text: str) -> int:
            return text.count("torch.ops.aten.mm.default(")

        return {
            "checkpoint_regions": sum(
                t.count("torch.ops.higher_order.tag_activation_checkpoint(") for t in self.captured
            ),
            "forward_matmuls": [matmuls(t) for t in self.forward],
            "backward_matmuls": [matmuls(t) for t in self.backward],
        }


def case_name(layout: str, compiled: bool, ac: str) -> str:
    return f"{layout}-{'compiled' if compiled else 'eager'}-{ac}"


def build(layout: str, compiled: bool, ac: str) -> tuple[BuiltModel, ParallelDims, Loss]:
    tp, overrides = LAYOUTS[layout]
    precision = ["--training.mixed_precision_param", "float32"]  # compiled and eager compared closely
    config = load_config([*precision, *overrides, *AC[ac], *(COMPILE if compiled else [])])
    world = dist.get_world_size()
    dims = ParallelDims(dp_replicate=1, dp_shard=world // tp, tp=tp, pp=1, world_size=world)
    dims.build_mesh("cpu")
    model = build_model(config, dims, torch.device("cpu"), ARGS)
    return (
        model,
        dims,
        Loss(BATCH * SEQ * dims.dp_degree, dims, config.compile, config.parallelism.enable_loss_parallel),
    )


def train(model: BuiltModel, dims: ParallelDims, loss_fn: Loss) -> list[float]:
    """The trainer's loss and step: summed cross-entropy over the global token count, gradients summed."""
    optimizer = torch.optim.AdamW(model.parts[0].parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(dims.dp_rank)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=generator)
        logits = model.parts[0](tokens[:, :-1])
        with loss_fn.context():
            loss = loss_fn(logits, tokens[:, 1:])
            loss.backward()
        value = local_loss(loss.detach())
        if dims.dp_mesh is not None:
            dist.all_reduce(value, group=dims.dp_mesh.get_group())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(value.item())
    return losses


def main() -> None:
    dist.init_process_group("gloo")
    torch.use_deterministic_algorithms(True)
    stats = torch._dynamo.utils.counters["stats"]
    graph_log = GraphLog()
    graph_log.install()
    for layout, compiled, ac in CASES:
        torch._dynamo.reset()  # no graph reuse across cases: each compiles its own
        torch.manual_seed(0)
        graph_log.clear()
        breaks, graphs, start = graph_break_count(), stats["unique_graphs"], time.perf_counter()
        losses = train(*build(layout, compiled, ac))
        result = {
            "case": case_name(layout, compiled, ac),
            "losses": losses,
            "graph_breaks": graph_break_count() - breaks,
            "graphs": stats["unique_graphs"] - graphs,
            **graph_log.counts(),
            "seconds": round(time.perf_counter() - start, 1),
        }
        if dist.get_rank() == 0:
            print("RESULT " + json.dumps(result), flush=True)
    dist.barrier()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
