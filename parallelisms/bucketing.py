"""Graph pass for SimpleFSDP: bucket the data-parallel collectives and order them for overlap.

Works on torch.compile's forward and backward graphs (AOT autograd's, or Inductor's post-grad).
Each collective is attributed to a unit (``layers.3`` ...) by the module stack in its node's
metadata; the plan maps units to buckets, and torch's ``merge_*_bucket`` functions merge them.
Waits move to right before their first use. With ``reorder``, each bucket's all-gather runs during
the previous bucket's compute, and in backward one transfer at a time runs beside a bucket's
compute: at most one bucket's full-size gradients are in flight, as in FSDP2. On gloo the
collectives are then rewritten (``gloo_graph``).

Only collectives on the data-parallel groups are bucketed: tensor parallel's act on activations,
each depending on the compute before it, and stay where they are. Shapes cannot tell them apart
(TP all-gathers saved activations, graph inputs as the shards are), so the pass is told the groups.
"""

from __future__ import annotations

import collections
import operator
import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch._inductor.fx_passes.bucketing import (
    merge_all_gather_bucket,
    merge_all_reduce_bucket,
    merge_reduce_scatter_bucket,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.flop_counter import flop_registry

from parallelisms import gloo_graph
from parallelisms.fsdp2 import check_prefetch
from parallelisms.names import clean_name

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
_KINDS = {
    c10d.all_gather_into_tensor.default: "all_gather",
    c10d.all_gather_into_tensor_out.default: "all_gather",
    c10d.reduce_scatter_tensor.default: "reduce_scatter",
    c10d.all_reduce.default: "all_reduce",
    c10d.all_to_all_single.default: "all_to_all",
    c10d.broadcast_.default: "broadcast",
}
WAIT = c10d.wait_tensor.default

# Ops that only re-describe a tensor: moving them together with the wait they follow is free.
VIEW_OPS = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten._unsafe_view.default,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.narrow.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.t.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.clone.default,
    torch.ops.aten.contiguous.default,
}


def is_view_op(node: fx.Node) -> bool:
    return node.op == "call_function" and (node.target in VIEW_OPS or node.target is operator.getitem)


def group_of(collective: fx.Node) -> str:
    """The process group name a functional collective runs on (its last argument)."""
    return str(collective.args[-1])


def data_parallel_groups(mesh: DeviceMesh) -> list[str]:
    """The names of ``mesh``'s process groups, as the graphs' collectives name their group."""
    return [mesh.get_group(dim).group_name for dim in range(mesh.ndim)]


def collective_kind(node: fx.Node) -> str | None:
    """'all_gather', 'reduce_scatter', 'all_reduce', 'all_to_all', 'broadcast' or None."""
    return _KINDS.get(node.target) if node.op == "call_function" else None


def _module_stack(node: fx.Node) -> dict | None:
    return node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")


def module_path(node: fx.Node) -> str | None:
    """The FQN of the innermost module that issued ``node`` (backward nodes carry the forward's);
    without a module stack (a DTensor redistribute's backward), that of its nearest producer's."""
    stack = _module_stack(node)
    frontier, seen = list(node.all_input_nodes), set()
    while not stack and frontier:
        producer = frontier.pop(0)
        if producer not in seen:
            seen.add(producer)
            stack = _module_stack(producer)
            frontier.extend(producer.all_input_nodes)
    if not stack:
        return None
    path = list(stack.values())[-1][0]
    path = re.sub(r"\[['\"]?([^\]'\"]+)['\"]?\]", r".\1", path)  # layers['0'] -> layers.0
    # A submodule dynamo reached through its parent's dict (a checkpoint wrapper's, compiled alone).
    path = path.replace("__dict__._modules.", "")
    path = re.sub(r"^L\.self\.?|^L\['self'\]\.?|^self\.?", "", path)
    return clean_name(path)


def unit_of(path: str | None, units: list[str]) -> str | None:
    """The longest unit name that is ``path`` or one of its ancestors."""
    if path is None:
        return None
    matches = [u for u in units if path == u or path.startswith(u + ".")]
    return max(matches, key=len) if matches else None


@dataclass
class GraphReport:
    """What the pass left in one graph: collective counts and each all-gather's bucket, in order."""

    collectives: collections.Counter = field(default_factory=collections.Counter)
    all_gather_buckets: list[int] = field(default_factory=list)
    # The data-parallel ones among ``collectives`` (all of them without tensor parallelism).
    data_parallel: collections.Counter = field(default_factory=collections.Counter)
    # The most data-parallel all-gathers issued while one is waited for, besides it: the prefetch.
    gathers_ahead: int = 0


def _copy_in_before_gathering(graph: fx.Graph, new_nodes: list[fx.Node]) -> list[fx.Node]:
    """Makes a merged all-gather read its shards' copy. torch before 2.13 copies them into the rank's
    slot of the bucket with a ``_foreach_copy_`` into views of it, which no edge orders before the
    gather (a sort or a reorder may move the gather first, which then sends garbage); one ``copy_``
    of their concatenation, whose result the gather takes, is ordered. Returns the bucket's nodes."""
    for node in [n for n in new_nodes if n.target is aten._foreach_copy_.default]:
        views, shards = node.args
        split = views[0].args[0]  # getitem(split_with_sizes(slot, sizes), i)
        slot = split.args[0]
        gather = next(user for user in slot.users if collective_kind(user) == "all_gather")
        with graph.inserting_before(node):
            flat = graph.call_function(aten.cat.default, (list(shards),))
            copied = graph.call_function(aten.copy_.default, (slot, flat))
        flat.meta = {**node.meta, "val": torch.cat([shard.meta["val"] for shard in shards])}
        copied.meta = {**node.meta, "val": slot.meta["val"]}
        gather.replace_input_with(slot, copied)
        for dead in (node, *views, split):
            graph.erase_node(dead)
        new_nodes = [n for n in new_nodes if n not in (node, *views, split)] + [flat, copied]
    return new_nodes


class BucketingPass(CustomGraphPass):
    """Buckets and reorders SimpleFSDP's collectives: Inductor's ``post_grad_custom_post_pass``, or
    called on AOT autograd graphs. ``buckets``: unit names per bucket in execution order, or None
    (one collective per parameter). ``forward_prefetch``/``backward_prefetch``: all-gathers issued
    ahead of the one in use (-1: all at the graph's start); in backward (the graph with reductions)
    one ahead runs one transfer at a time beside compute, more ahead leave the gathers that early."""

    def __init__(
        self,
        buckets: list[list[str]] | None,
        dp_groups: list[str],
        reorder: bool = True,
        forward_prefetch: int = 1,
        backward_prefetch: int = 1,
    ):
        check_prefetch(forward_prefetch, "forward_prefetch")
        check_prefetch(backward_prefetch, "backward_prefetch")
        self.buckets = buckets
        self.dp_groups = dp_groups
        self.reorder = reorder
        self.prefetch = (forward_prefetch, backward_prefetch)
        self.unit_to_bucket = {u: i for i, units in enumerate(buckets or []) for u in units}
        self.reports: list[GraphReport] = []

    def uuid(self) -> str:
        # The graphs it writes differ by rank (each copies its shard into its own slot): ranks
        # sharing a compile cache must not share them.
        return get_hash_for_files((__file__, gloo_graph.__file__)).hex() + repr(
            (self.buckets, self.dp_groups, self.reorder, self.prefetch, dist.get_rank() if dist.is_initialized() else 0)
        )

    def __call__(self, graph: fx.Graph) -> None:
        if not any(collective_kind(node) for node in graph.nodes):
            return  # nothing to bucket or order (a nested compile region's subgraph, or no data parallelism)
        report = GraphReport()
        if self.buckets is not None:
            self._merge(graph)
        stable_topological_sort(graph)
        if self.reorder:
            for node in list(graph.nodes):
                if node.op == "call_function" and node.target is WAIT:
                    sink_wait(node)
            backward = bool(self._data_parallel(graph, "reduce_scatter") or self._data_parallel(graph, "all_reduce"))
            ahead = self.prefetch[backward]
            self._prefetch_all_gathers(graph, ahead)
            self._one_transfer_at_a_time(graph, place_gathers=ahead == 1)
        report.gathers_ahead = self._gathers_ahead(graph)
        gloo_graph.reduce_scatters_as_all_to_all(graph, self._data_parallel(graph, "reduce_scatter"))
        stable_topological_sort(graph)
        # On a sorted graph: the broadcasts' order against the shard's copy and the bucket's readers
        # is a mutation's, which the sort cannot see.
        gloo_graph.all_gathers_as_broadcasts(graph, self._data_parallel(graph, "all_gather"))
        graph.lint()
        for node in graph.nodes:
            kind = collective_kind(node)
            if kind:
                report.collectives[kind] += 1
                if self._is_data_parallel(node):
                    report.data_parallel[kind] += 1
                    gather = kind == "all_gather" or (kind == "broadcast" and node.args[1] == 0)
                    if gather and self.buckets is not None:
                        report.all_gather_buckets.append(self._bucket_of(node))
        self.reports.append(report)

    def _is_data_parallel(self, node: fx.Node) -> bool:
        return collective_kind(node) is not None and group_of(node) in self.dp_groups

    def _data_parallel(self, graph: fx.Graph, kind: str) -> list[fx.Node]:
        return [node for node in graph.nodes if collective_kind(node) == kind and self._is_data_parallel(node)]

    def _gathers_ahead(self, graph: fx.Graph) -> int:
        issued: set[fx.Node] = set()
        most = 0
        for node in graph.nodes:
            if collective_kind(node) == "all_gather" and self._is_data_parallel(node):
                issued.add(node)
            elif node.target is WAIT and node.args[0] in issued:
                most = max(most, len(issued) - 1)
                issued.discard(node.args[0])
        return most

    def _bucket_of(self, node: fx.Node) -> int:
        if "tessera_bucket" in node.meta:
            return node.meta["tessera_bucket"]
        unit = unit_of(module_path(node), list(self.unit_to_bucket))
        if unit is None:
            raise RuntimeError(f"cannot attribute collective {node.name} to a bucket unit")
        return self.unit_to_bucket[unit]

    def _merge(self, graph: fx.Graph) -> None:
        groups: dict[tuple, list[fx.Node]] = collections.defaultdict(list)
        for node in graph.nodes:
            kind = collective_kind(node)
            if kind and self._is_data_parallel(node):
                # Only collectives over the same group and dtype can share a buffer.
                key = (kind, self._bucket_of(node), group_of(node), node.meta["val"].dtype)
                groups[key].append(node)
        for (kind, bucket, _, _), nodes in groups.items():
            if kind == "all_gather":
                # Shards are graph inputs (or casts of them): gather them all up front.
                new_nodes, _ = merge_all_gather_bucket(graph, nodes, insert_before=nodes[0])
                new_nodes = _copy_in_before_gathering(graph, new_nodes)
            elif kind == "reduce_scatter":
                new_nodes, _ = merge_reduce_scatter_bucket(graph, nodes)
            else:
                new_nodes, _ = merge_all_reduce_bucket(graph, nodes)
            for node in new_nodes:
                node.meta["tessera_bucket"] = bucket

    def _prefetch_all_gathers(self, graph: fx.Graph, ahead: int) -> None:
        """Issues the first ``ahead`` all-gathers (-1: all) at the start of the graph and each next one
        right before the wait of the one ``ahead`` before it (in backward the first run beside the
        output's and the loss's)."""
        gathers = [n for n in graph.nodes if collective_kind(n) == "all_gather" and self._is_data_parallel(n)]
        ahead = len(gathers) if ahead == -1 else ahead
        last_input = [n for n in graph.nodes if _is_input(n)][-1] if gathers else None
        for gather in reversed(gathers[:ahead]):
            for node in reversed(issue_chain(gather)):
                last_input.append(node)
        for previous, gather in zip(gathers, gathers[ahead:]):
            previous_wait = next(iter(previous.users))
            for node in issue_chain(gather):
                previous_wait.prepend(node)

    def _one_transfer_at_a_time(self, graph: fx.Graph, place_gathers: bool = True) -> None:
        """In backward, runs one transfer at a time beside a bucket's compute: the previous bucket's
        gradient reduction, then, from where the compute (in matmul FLOPs) is as far along as the
        reduction's share of the two transfers' bytes, the next bucket's gather. The reduction is
        waited for before the gather, or without one before the next bucket's gradients are
        assembled. A sunk wait would keep every bucket's gradients alive to the end of backward;
        overlapping both transfers would hold both their buffers beside the computing bucket. Without
        ``place_gathers`` only the reductions' waits are placed; the gathers stay where they are."""
        order = {n: i for i, n in enumerate(graph.nodes)}
        first_issue: dict[int | fx.Node, fx.Node] = {}
        waits: dict[int | fx.Node, list[fx.Node]] = collections.defaultdict(list)
        gathers: list[fx.Node] = []
        for node in graph.nodes:
            if collective_kind(node) in ("reduce_scatter", "all_reduce") and self._is_data_parallel(node):
                bucket = self._bucket_of(node) if self.buckets is not None else node
                first_issue.setdefault(bucket, node)
                waits[bucket].extend(user for user in node.users if user.target is WAIT)
            elif collective_kind(node) == "all_gather" and self._is_data_parallel(node):
                gathers.append(node)
        issues = sorted(first_issue.items(), key=lambda item: order[item[1]])
        for (bucket, issue), (_, next_issue) in zip(issues, issues[1:]):
            point = barrier = end = _assembly_start(next_issue)
            gather = next((g for g in gathers if order[issue] < order[g] < order[end]), None) if place_gathers else None
            if gather is not None:
                share = _bytes(issue.args[0]) / (_bytes(issue.args[0]) + _bytes(gather))
                point = _compute_point(gather.next, end, share)
                setup = [n for n in issue_chain(gather) if order[n] > order[issue]]
                for node in setup:
                    point.prepend(node)
                barrier = setup[0]
            for wait in waits[bucket]:
                if order[wait] > order[point]:
                    barrier.prepend(wait)  # the topological sort pulls up what the wait needs


def _assembly_start(reduction: fx.Node) -> fx.Node:
    """The first node of the merge that builds a reduction's full-size gradient buffer (the
    reduction itself for one gradient)."""
    bucket = reduction.meta.get("tessera_bucket")
    if bucket is None:
        return reduction
    merged, stack = {reduction}, list(reduction.all_input_nodes)
    while stack:  # back through the merge's own nodes only: the gradients' compute is not tagged
        node = stack.pop()
        if node not in merged and node.meta.get("tessera_bucket") == bucket:
            merged.add(node)
            stack.extend(node.all_input_nodes)
    return next(n for n in reduction.graph.nodes if n in merged)


def _is_input(node: fx.Node) -> bool:
    """A graph input or constant; not a nested compile region's subgraph, fetched where it is called."""
    if node.op == "get_attr":
        return not isinstance(getattr(node.graph.owning_module, node.target, None), fx.GraphModule)
    return node.op == "placeholder"


def _bytes(node: fx.Node) -> int:
    value = node.meta["val"]
    return value.numel() * value.element_size()


def _flops(node: fx.Node) -> float:
    """FLOPs of a matmul or attention node (a nested compile region's for a call of it), else 0."""
    if _is_region_call(node):
        subgraph = getattr(node.graph.owning_module, node.args[0].target)
        return sum(_flops(inner) for inner in subgraph.graph.nodes)
    formula = flop_registry.get(getattr(node.target, "overloadpacket", None))
    if formula is None or node.meta.get("val") is None:
        return 0.0
    values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
    return float(formula(*values, out_val=node.meta.get("val"), **kwargs))


def _compute_point(start: fx.Node, end: fx.Node, share: float) -> fx.Node:
    """The first node from ``start`` by which ``share`` of the FLOPs up to ``end`` have run."""
    nodes = []
    node = start
    while node is not end and node.op != "output":
        nodes.append(node)
        node = node.next
    flops = [_flops(n) for n in nodes]
    total, done = sum(flops), 0.0
    for node, node_flops in zip(nodes, flops):
        if total and done >= share * total:
            return node
        if total and done and _is_region_call(node) and done + node_flops / 2 >= share * total:
            return node  # a region's compute cannot be split: its start, when nearer than its end
        done += node_flops
    return end


def _is_region_call(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is torch.ops.higher_order.invoke_subgraph


def issue_chain(collective: fx.Node) -> list[fx.Node]:
    """The collective and the non-input nodes it depends on (buffer set-up, casts), in graph order."""
    chain: set[fx.Node] = set()
    stack = [collective]
    while stack:
        node = stack.pop()
        if node in chain or node.op in ("placeholder", "get_attr"):
            continue
        chain.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in collective.graph.nodes if n in chain]


def sink_wait(wait: fx.Node) -> None:
    """Moves ``wait`` (and the views of its result) to right before the first real use."""
    movable = [wait]
    frontier = list(wait.users)
    first_use: fx.Node | None = None
    order = {n: i for i, n in enumerate(wait.graph.nodes)}
    while frontier:
        user = frontier.pop()
        is_view = is_view_op(user)
        if is_view and all(inp in movable or order[inp] < order[wait] for inp in user.all_input_nodes):
            if user not in movable:
                movable.append(user)
                frontier.extend(user.users)
        elif first_use is None or order[user] < order[first_use]:
            first_use = user
    if first_use is None:
        return
    for node in sorted(movable, key=order.__getitem__):
        first_use.prepend(node)


def stable_topological_sort(graph: fx.Graph) -> None:
    """Reorders nodes so every input comes before its users, keeping the given order otherwise."""
    placed: set[fx.Node] = set()
    order: list[fx.Node] = []

    def place(node: fx.Node) -> None:
        stack = [(node, False)]
        while stack:
            current, inputs_done = stack.pop()
            if current in placed:
                continue
            if inputs_done:
                placed.add(current)
                order.append(current)
                continue
            stack.append((current, True))
            stack.extend((inp, False) for inp in reversed(current.all_input_nodes) if inp not in placed)

    for node in list(graph.nodes):
        place(node)
    first = next(iter(graph.nodes))
    if order[0] is not first:
        first.prepend(order[0])
    for previous, node in zip(order, order[1:]):
        previous.append(node)
