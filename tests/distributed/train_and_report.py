"""torchrun worker: train.py's run (the same Trainer, config and output files), then one line
``REPORT {json}`` per rank on rank 0's stdout telling what the run compiled:

- ``graphs``: graphs dynamo compiled (``torch._dynamo`` counters), ``aot_graphs``: those that went
  through AOT autograd (a compiled backward; the ``eager`` backend has none), ``aot_cache_hits``:
  those of them taken from torch's AOT autograd cache (Inductor only), ``graph_breaks``;
- ``compiled_blocks`` / ``blocks``: transformer blocks of this rank compiled with ``nn.Module.compile``
  (per-block compile), out of all of this rank's blocks;
- ``compiled_parts``: model parts (whole model or pipeline stages) compiled whole;
- ``parameters``: parameter tensors of this rank's parts; ``offloaded``: those kept in host memory;
- ``graph_passes``: per SimpleFSDP compile pass (``BuiltModel.graph_passes``), the report of each
  graph it rewrote, in compile order (forward, then backward): all collectives, and the
  data-parallel ones among them, and the most all-gathers issued ahead of the one waited for.

Usage: torchrun --nproc-per-node N tests/distributed/train_and_report.py <train.py arguments>
[--- <train.py arguments> ...]: several runs, one after the other in the same processes and process
group (each a new Trainer, seeded as train.py seeds it), their reports tagged ``run`` 0, 1, ...
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.utils import counters
from torch.distributed.fsdp import FSDPModule

from config.manager import load_config
from parallelisms.compile import graph_break_count
from train import exit_without_teardown
from trainer.trainer import Trainer


def _compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None


def _offloaded(parts: list[nn.Module]) -> int:
    """Parameters their wrapper keeps in host memory: FSDP2's CPU offload policy, SimpleFSDP's own."""
    count = 0
    for part in parts:
        for module in part.modules():
            group = module._get_fsdp_state()._fsdp_param_group if isinstance(module, FSDPModule) else None
            count += sum(param.offload_to_cpu for param in group.fsdp_params) if group else 0
            config = getattr(module, "_simple_fsdp_config", None)
            if config is not None and config.offload is not None:
                count += sum(param is not None for param in module._parameters.values())
    return count


def report(trainer: Trainer, run: int) -> dict:
    parts = trainer.model.parts
    blocks = [block for part in parts for block in part.layers.values()]
    return {
        "run": run,
        "rank": dist.get_rank(),
        "graphs": counters["stats"]["unique_graphs"],
        "aot_graphs": counters["aot_autograd"]["ok"],
        "aot_cache_hits": counters["aot_autograd"]["autograd_cache_hit"],
        "graph_breaks": graph_break_count(),
        "blocks": len(blocks),
        "compiled_blocks": sum(_compiled(block) for block in blocks),
        "compiled_parts": sum(_compiled(part) for part in parts),
        "parameters": sum(1 for part in parts for _ in part.parameters()),
        "offloaded": _offloaded(parts),
        "graph_passes": [
            [
                {"collectives": dict(r.collectives), "data_parallel": dict(r.data_parallel), "ahead": r.gathers_ahead}
                for r in graph_pass.reports
            ]
            for graph_pass in trainer.model.graph_passes
        ],
    }


def main(argv: list[str]) -> None:
    rank = int(os.environ.get("RANK", 0))
    logging.basicConfig(
        level=logging.INFO if rank == 0 else logging.WARNING,
        format="%(asctime)s %(levelname)s %(message)s",
        datefmt="%H:%M:%S",
    )
    runs = [[]]
    for arg in argv:
        runs.append([]) if arg == "---" else runs[-1].append(arg)
    for run, args in enumerate(runs):
        # Counters and compiled code of the previous run must not count for this one.
        torch._dynamo.reset()
        counters.clear()
        logging.info("batch run %d of %d", run, len(runs))
        trainer = Trainer(load_config(args))
        trainer.train()
        # Rank 0 prints every rank's report: lines from several processes on one pipe can interleave.
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report(trainer, run))
        if dist.get_rank() == 0:
            print("\n".join("REPORT " + json.dumps(r) for r in reports), flush=True)
        trainer.close()
        del trainer
        gc.collect()
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1:])
