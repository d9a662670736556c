"""torch.compile per transformer block, or of the whole model (SimpleFSDP, each block's computation
a nested compile region compiled once for all), with our partitioner and SimpleFSDP's passes; and
the graph breaks compilation ran into.

The partitioner is torch's min-cut one plus a fix-up: when a graph saves a non-tensor object for
backward (a DTensor parameter's ``DeviceMesh``) and also recomputes a random op (attention under
activation checkpointing), torch 2.13 saves the RNG state after the mesh while its runtime expects
all tensors first ("expected all tensors_saved_with_vc_check to be Tensors"). The fix-up moves
such objects behind the tensors, in the forward outputs and the backward inputs alike.
"""

from __future__ import annotations

import functools
import logging
import operator
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.utils import counters
from torch._functorch import config as functorch_config
from torch._functorch.partitioners import is_sym_node
from torch._inductor.custom_graph_pass import CustomPartitionerFn, get_hash_for_files
from torch._library.fake_class_registry import FakeScriptObject
from torch._library.opaque_object import is_opaque_value
from torch.func import functional_call

from parallelisms.bucketing import BucketingPass, is_view_op
from parallelisms.simple_fsdp import mark_gathers_for_partitioner
from parallelisms.torch_release import partitioner_options

logger = logging.getLogger(__name__)


def _is_opaque_node(node: Any) -> bool:
    """Whether a graph node holds an object that is not a tensor or a number (a ``DeviceMesh``, a
    process group), as torch's partitioner tells them apart."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return is_opaque_value(val) or isinstance(val, (torch.ScriptObject, FakeScriptObject))


def _order_saved_values(fw_module: fx.GraphModule, bw_module: fx.GraphModule, num_fwd_outputs: int) -> bool:
    """Moves the non-tensor objects saved for backward behind the saved tensors (module docstring);
    returns whether it changed anything."""
    fw_output = fw_module.graph.find_nodes(op="output")[0]
    outputs = list(fw_output.args[0])
    saved = outputs[num_fwd_outputs:]
    if not all(isinstance(node, fx.Node) for node in saved):
        return False  # not the layout this fix-up knows: leave it to torch
    n_sym = 0
    while n_sym < len(saved) and is_sym_node(saved[len(saved) - 1 - n_sym]):
        n_sym += 1
    values = saved[: len(saved) - n_sym]
    if any(is_sym_node(node) for node in values):
        return False
    opaque = [_is_opaque_node(node) for node in values]
    order = [i for i, o in enumerate(opaque) if not o] + [i for i, o in enumerate(opaque) if o]
    if order == list(range(len(values))):
        return False

    # Backward inputs: saved symints, then the saved values in forward-output order, then tangents.
    placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
    bw_values = placeholders[n_sym : n_sym + len(values)]
    if len(bw_values) != len(values) or any(_is_opaque_node(b) != o for b, o in zip(bw_values, opaque)):
        logger.warning("compile: unexpected backward inputs, saved values left in torch's order")
        return False

    fw_output.args = (tuple(outputs[:num_fwd_outputs] + [values[i] for i in order] + saved[len(values) :]),)
    rest = placeholders[n_sym + len(values) :]
    anchor = rest[0] if rest else next(n for n in bw_module.graph.nodes if n.op != "placeholder")
    for i in order:
        anchor.prepend(bw_values[i])
    for module in (fw_module, bw_module):
        module.graph.lint()
        module.recompile()
    return True


def _read_region_inputs_outside(joint: fx.GraphModule) -> None:
    """Takes what a nested compile region returns of its own inputs (views of SimpleFSDP's gathered
    weights, handed to its backward) from the inputs instead: from the region's outputs they would
    be saved whatever their gathers' recompute tags say."""
    graph = joint.graph
    for call in graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph):
        subgraph = getattr(joint, call.args[0].target)
        outputs = subgraph.graph.find_nodes(op="output")[0].args[0]
        placeholders = list(subgraph.graph.find_nodes(op="placeholder"))
        for user in list(call.users):
            if user.target is not operator.getitem:
                continue
            views, source = [], outputs[user.args[1]]
            while isinstance(source, fx.Node) and is_view_op(source):
                views.append(source)
                source = source.args[0]
            if not (isinstance(source, fx.Node) and source.op == "placeholder"):
                continue
            value = call.args[2 + placeholders.index(source)]  # invoke_subgraph(subgraph, name, *operands)
            with graph.inserting_before(user):
                for view in reversed(views):
                    value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                    value.meta = dict(view.meta)
            user.replace_all_uses_with(value)
            graph.erase_node(user)
    joint.recompile()


class MinCutPartitioner(CustomPartitionerFn):
    """torch's min-cut partitioner with the fix-ups above, as AOT autograd's ``partition_fn`` and
    Inductor's ``custom_partitioner_fn``. ``memory_budget`` is torch's activation memory budget: 1
    keeps what runs fastest, 0 the least, between, the least recomputation that fits."""

    def __init__(self, memory_budget: float = 1.0):
        self.memory_budget = memory_budget

    def __call__(
        self, gm: fx.GraphModule, joint_inputs: Sequence[object], **kwargs: Any
    ) -> tuple[fx.GraphModule, fx.GraphModule]:
        mark_gathers_for_partitioner(gm)
        _read_region_inputs_outside(gm)
        with functorch_config.patch(partitioner_options(self.memory_budget)):
            fw_module, bw_module = min_cut_rematerialization_partition(gm, joint_inputs, **kwargs)
        _order_saved_values(fw_module, bw_module, kwargs["num_fwd_outputs"])
        return fw_module, bw_module

    def uuid(self) -> Any:
        return get_hash_for_files((__file__,), repr(self.memory_budget))


@functools.cache
def _partitioner(memory_budget: float) -> MinCutPartitioner:
    return MinCutPartitioner(memory_budget)


def _aot_eager(graph_pass: BucketingPass | None = None, memory_budget: float = 1.0):
    """torch's ``aot_eager`` with our partitioner, running ``graph_pass`` on both graphs when given."""

    def compile_graph(gm: fx.GraphModule, example_inputs):
        if graph_pass is not None:
            graph_pass(gm.graph)
            gm.recompile()
        return make_boxed_func(gm.forward)

    return aot_autograd(
        fw_compiler=compile_graph,
        bw_compiler=compile_graph,
        partition_fn=_partitioner(memory_budget),
        keep_inference_input_mutations=True,
    )


@functools.cache
def _shared_aot_eager(memory_budget: float):
    """One backend object for all blocks: dynamo reuses a block's graph for the others only when
    they were compiled with the same backend."""
    return _aot_eager(memory_budget=memory_budget)


def _inductor_options(graph_pass: BucketingPass | None, memory_budget: float) -> dict[str, Any]:
    """Our partitioner, and ``graph_pass`` when given; then Inductor's reordering for peak memory is
    off: it would issue each collective right before its wait, overlapping nothing."""
    options: dict[str, Any] = {"custom_partitioner_fn": _partitioner(memory_budget)}
    if graph_pass is not None:
        options.update(post_grad_custom_post_pass=graph_pass, reorder_for_peak_memory=False)
    return options


def apply_compile_per_block(
    blocks: nn.ModuleDict, backend: str, graph_pass: BucketingPass | None = None, memory_budget: float = 1.0
) -> None:
    """Compiles each block in place (names unchanged), one graph reused for blocks of the same shape;
    ``graph_pass`` is SimpleFSDP's when its gathers are traced with the block."""
    if backend == "inductor":
        options = _inductor_options(graph_pass, memory_budget)
        for block in blocks.values():
            block.compile(backend="inductor", fullgraph=True, options=options)
        return
    shared = _shared_aot_eager(memory_budget) if graph_pass is None else _aot_eager(graph_pass, memory_budget)
    for block in blocks.values():
        block.compile(backend=shared, fullgraph=True)


def apply_compile_loss(loss_fn: Callable[..., torch.Tensor], backend: str) -> Callable[..., torch.Tensor]:
    """``loss_fn`` compiled as one graph: the fp32 upcast of the logits fuses with the log-softmax
    (Inductor) instead of materializing a second copy of the logits."""
    return torch.compile(loss_fn, backend=backend, fullgraph=True)


def apply_compile_whole_model(
    model: nn.Module, backend: str, graph_pass: BucketingPass, memory_budget: float = 1.0
) -> None:
    """Compiles ``model`` as one graph so compute and SimpleFSDP's collectives are traced together,
    ``graph_pass`` ordering them."""
    if backend == "inductor":
        model.compile(backend="inductor", fullgraph=True, options=_inductor_options(graph_pass, memory_budget))
    else:
        model.compile(backend=_aot_eager(graph_pass, memory_budget), fullgraph=True)


def apply_compile_regions(modules: Iterable[nn.Module], template: nn.Module) -> None:
    """Runs each of ``modules`` (alike: the blocks) as one nested compile region, which a whole-model
    compile traces and lowers once for all. The region runs ``template`` (a meta copy of one, taken
    before any parallelism) on the module's parameters, read outside it: SimpleFSDP's gathers stay
    in the outer graph, where the bucketing pass orders them across blocks."""
    names = [name for name, _ in template.named_parameters()]

    @torch.compiler.nested_compile_region
    def computation(*tensors: torch.Tensor) -> Any:
        inputs, weights = tensors[: len(tensors) - len(names)], tensors[len(tensors) - len(names) :]
        return functional_call(template, dict(zip(names, weights)), inputs)

    for module in modules:
        module.forward = functools.partial(_forward_in_region, module, names, computation)


def _forward_in_region(module: nn.Module, names: list[str], region: Callable[..., Any], *inputs: Any) -> Any:
    weights = [operator.attrgetter(name)(module) for name in names]
    return region(*inputs, *weights)


def _summary(reason: str) -> str:
    """A graph-break reason's title and, when given, its explanation, on one line."""
    lines = [line.strip() for line in reason.strip().splitlines() if line.strip()]
    if not lines:
        return "(no reason given)"
    explanation = next((line for line in lines[1:] if line.startswith("Explanation:")), None)
    return f"{lines[0]}: {explanation.removeprefix('Explanation:').strip()}" if explanation else lines[0]


def graph_break_count() -> int:
    """Graph breaks dynamo has hit in this process so far (each break counted once per compile)."""
    return sum(counters["graph_break"].values())


def graph_break_reasons() -> dict[str, int]:
    """The distinct graph-break reasons so far, one line each, with their counts, most frequent first."""
    merged: Counter[str] = Counter()
    for reason, count in counters["graph_break"].items():
        merged[_summary(reason)] += count
    return dict(merged.most_common())


def log_graph_breaks(log: logging.Logger | None = None) -> int:
    """Logs ``compile: N graph breaks`` (info) and each distinct reason (warning); returns N."""
    log = log or logger
    count = graph_break_count()
    log.info("compile: %d graph breaks", count)
    for reason, times in graph_break_reasons().items():
        log.warning("compile: graph break (%d x): %s", times, reason)
    return count
