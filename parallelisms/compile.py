"""torch.compile: per transformer block (FSDP2) or the whole model with our collective passes
(SimpleFSDP)."""

from __future__ import annotations

import torch
import torch.nn as nn
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd

from parallelisms.bucketing import BucketingPass


def apply_compile_per_block(blocks: nn.ModuleDict, backend: str) -> None:
    """Compiles each block in place (parameter names unchanged)."""
    for block in blocks.values():
        block.compile(backend=backend, fullgraph=True)


def _aot_eager_with_pass(graph_pass: BucketingPass):
    """AOT autograd without code generation, running ``graph_pass`` on the forward and backward
    graphs. The min-cut partitioner honours the recompute tags SimpleFSDP puts on its gathers
    (the default partitioner would save the gathered weights)."""

    def compile_graph(gm: torch.fx.GraphModule, example_inputs):
        graph_pass(gm.graph)
        gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=compile_graph, bw_compiler=compile_graph, partition_fn=min_cut_rematerialization_partition
    )


def apply_compile_whole_model(model: nn.Module, backend: str, graph_pass: BucketingPass) -> None:
    """Compiles ``model`` as one graph (``fullgraph=True``) so compute and SimpleFSDP's collectives
    are traced together, and runs ``graph_pass`` on the forward and backward graphs."""
    if backend == "inductor":
        model.compile(backend="inductor", fullgraph=True, options={"post_grad_custom_post_pass": graph_pass})
    elif backend == "aot_eager":
        model.compile(backend=_aot_eager_with_pass(graph_pass), fullgraph=True)
    else:
        raise ValueError(f"compile.backend: unsupported backend '{backend}' (inductor or aot_eager)")
