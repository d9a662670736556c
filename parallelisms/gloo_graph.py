"""Data-parallel collectives rewritten for gloo in SimpleFSDP's compiled graphs (see
``parallelisms.bucketing``): gloo's reduce-scatter is an all-reduce of a copy of its input, and its
all-gather of a large bucket takes twice as long as a broadcast per rank."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.distributed.distributed_c10d import _resolve_process_group

from parallelisms.device import all_gather_as_broadcasts, reduce_scatter_as_all_to_all

c10d = torch.ops._c10d_functional
aten = torch.ops.aten
WAIT = c10d.wait_tensor.default


def reduce_scatters_as_all_to_all(graph: fx.Graph, reduce_scatters: list[fx.Node]) -> None:
    """Where ``reduce_scatter_as_all_to_all`` says so, each sum reduce-scatter becomes an all-to-all
    of the bucket's chunks and, after the wait, a sum of the chunks received."""
    for node in reduce_scatters:
        gradients, reduce_op, group_size, group_name = node.args
        value = gradients.meta["val"]
        if reduce_op != "sum" or not reduce_scatter_as_all_to_all(_resolve_process_group(group_name), value.device):
            continue
        splits = [value.shape[0] // group_size] * group_size
        chunks_value = value.view(group_size, -1, *value.shape[1:])
        part_value = chunks_value.sum(0)
        with graph.inserting_before(node):
            exchanged = graph.call_function(c10d.all_to_all_single.default, (gradients, splits, splits, group_name))
        exchanged.meta = {**node.meta, "val": value.clone()}
        node.replace_all_uses_with(exchanged)
        graph.erase_node(node)
        for wait in list(exchanged.users):
            users = list(wait.users)
            wait.meta["val"] = exchanged.meta["val"]
            with graph.inserting_after(wait):
                chunks = graph.call_function(aten.view.default, (wait, list(chunks_value.shape)))
            with graph.inserting_after(chunks):
                summed = graph.call_function(aten.sum.dim_IntList, (chunks, [0]))
            with graph.inserting_after(summed):
                # Written into a buffer of its own: Inductor would compute a sum only the
                # graph's outputs use where they are returned, keeping every bucket's
                # full-size chunks alive to the end of backward.
                buffer = graph.call_function(
                    aten.empty.memory_format,
                    (list(part_value.shape),),
                    {"dtype": value.dtype, "device": value.device},
                )
            with graph.inserting_after(buffer):
                reduced = graph.call_function(aten.copy_.default, (buffer, summed))
            chunks.meta = {**wait.meta, "val": chunks_value}
            summed.meta = {**wait.meta, "val": part_value}
            buffer.meta = {**wait.meta, "val": part_value.clone()}
            reduced.meta = {**wait.meta, "val": buffer.meta["val"]}  # copy_ returns the buffer
            for user in users:
                user.replace_input_with(wait, reduced)


def all_gathers_as_broadcasts(graph: fx.Graph, all_gathers: list[fx.Node]) -> None:
    """Where ``all_gather_as_broadcasts`` says so, each all-gather becomes one broadcast per rank into
    its slot of the buffer, issued and waited for where the all-gather was; each broadcast mutates
    its slot, which orders it for Inductor against the buffer's readers."""
    for node in all_gathers:
        shard, group_size, group_name = node.args
        group = _resolve_process_group(group_name)
        if not all_gather_as_broadcasts(group, shard.meta["val"].device):
            continue
        rows = shard.meta["val"].shape[0]
        rank = group.rank()
        with graph.inserting_before(node):
            buffer = node.kwargs.get("out")
            if buffer is None:
                buffer = graph.call_function(
                    aten.empty.memory_format,
                    (list(node.meta["val"].shape),),
                    {"dtype": node.meta["val"].dtype, "device": node.meta["val"].device},
                )
                buffer.meta = {**node.meta, "val": node.meta["val"].clone()}
            slots = []
            for src in range(group_size):
                slot = graph.call_function(aten.slice.Tensor, (buffer, 0, src * rows, (src + 1) * rows))
                slot.meta = {**node.meta, "val": buffer.meta["val"][src * rows : (src + 1) * rows]}
                slots.append(slot)
            if not _is_slot_of(shard, buffer, rank * rows):
                own = graph.call_function(aten.copy_.default, (slots[rank], shard))
                own.meta = {**node.meta, "val": slots[rank].meta["val"]}
            sends = []
            for src, slot in enumerate(slots):
                send = graph.call_function(c10d.broadcast_.default, (slot, src, group_name))
                send.meta = {**node.meta, "val": slot.meta["val"]}
                sends.append(send)
        for wait in list(node.users):
            with graph.inserting_before(wait):
                for send in sends:
                    done = graph.call_function(WAIT, (send,))
                    done.meta = {**wait.meta, "val": send.meta["val"]}
            wait.replace_all_uses_with(buffer)
            graph.erase_node(wait)
        graph.erase_node(node)


def _is_slot_of(node: fx.Node, buffer: fx.Node, start: int) -> bool:
    """Whether ``node`` is the rows of ``buffer`` from ``start`` on (torch's bucket merge gathers
    from the rank's own slot of the output), seen through an in-place copy into it."""
    if node.op == "call_function" and node.target is aten.copy_.default:
        node = node.args[0]
    return (
        node.op == "call_function"
        and node.target in (aten.narrow.default, aten.slice.Tensor)
        and node.args[0] is buffer
        and node.args[1] == 0
        and node.args[2] == start
    )
