"""torchrun worker: SimpleFSDP under torch.compile, checked from the compiled graphs themselves.

Usage: torchrun --nproc-per-node 2 tests/distributed/compile_checks.py BACKEND
Prints one line "CHECK <name> ok" per passed check; any failure raises.
"""

from __future__ import annotations

import dataclasses
import re
import sys

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code
from torch.distributed.device_mesh import init_device_mesh

from models.llama3 import Transformer, llama3_flavors
from models.llama3.model import TransformerBlock
from models.llama3.parallelize import BLOCK_BUCKETS, REGIONS, plan_units
from parallelisms.bucket_plan import CommModel, ComputeModel, default_manual_patterns, plan_auto, plan_manual
from parallelisms.bucketing import WAIT, BucketingPass, GraphReport, collective_kind, data_parallel_groups, is_view_op
from parallelisms.compile import apply_compile_per_block, apply_compile_regions, apply_compile_whole_model
from parallelisms.simple_fsdp import apply_simple_fsdp
from train import exit_without_teardown

ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=64, n_heads=4, n_layers=3, vocab_size=256, max_seq_len=32)
BATCH, SEQ, STEPS = 2, 32, 4


def build(mesh, reshard: bool) -> Transformer:
    with torch.device("meta"):
        model = Transformer(ARGS)
    apply_simple_fsdp(
        model,
        mesh,
        mode="fully_shard",
        reshard_after_forward=reshard,
        blocks=list(model.layers.values()),
        compiled=True,
    )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    return model


def train(model: torch.nn.Module) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    generator = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(0, ARGS.vocab_size, (BATCH, SEQ + 1), generator=generator)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        (loss / (BATCH * SEQ * dist.get_world_size())).backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


class RecordingPass(BucketingPass):
    """Keeps each graph after the pass, to read collectives and their order from it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.graphs: list[fx.Graph] = []

    def __call__(self, graph: fx.Graph) -> None:
        reported = len(self.reports)
        super().__call__(graph)
        if len(self.reports) > reported:
            self.graphs.append(graph)


def compiled_run(mesh, backend: str, buckets, reshard: bool = True) -> tuple[list[float], RecordingPass, list[str]]:
    """Losses, the pass with its graphs, and the code Inductor generated (none for aot_eager)."""
    model = build(mesh, reshard)
    graph_pass = RecordingPass(buckets, data_parallel_groups(mesh))
    with torch.device("meta"):
        template = TransformerBlock(ARGS)
    for name in REGIONS:  # as parallelize_llama does
        apply_compile_regions([getattr(block, name) for block in model.layers.values()], getattr(template, name))
    apply_compile_whole_model(model, backend, graph_pass)
    losses, code = run_and_get_code(train, model)
    return losses, graph_pass, code


def block_compiled_run(mesh, backend: str) -> tuple[list[float], RecordingPass, list[str]]:
    """Block bucketing: each block compiled on its own, the rest of the model eager."""
    model = build(mesh, reshard=True)
    graph_pass = RecordingPass(BLOCK_BUCKETS, data_parallel_groups(mesh))
    apply_compile_per_block(model.layers, backend, graph_pass)
    losses, code = run_and_get_code(train, model)
    return losses, graph_pass, code


def check(name: str, condition: bool, detail: object = "") -> None:
    if not condition:
        raise AssertionError(f"{name} failed: {detail}")
    if dist.get_rank() == 0:
        print(f"CHECK {name} ok", flush=True)


def gathered_buffer(broadcast: fx.Node) -> fx.Node:
    """The bucket a broadcast (of the gloo all-gather: one per rank) writes one slot of."""
    return broadcast.args[0].args[0]


def prefetch_order_holds(graph: fx.Graph) -> bool:
    """In forward, bucket i+1's all-gather (on gloo its first broadcast) is issued before bucket
    i's first compute node: the first reader of the gathered bucket after the gather's issue,
    other than the collectives and views (before it, the shards are copied in)."""
    nodes = list(graph.nodes)
    index = {n: i for i, n in enumerate(nodes)}
    gathers = [n for n in nodes if collective_kind(n) == "broadcast" and n.args[1] == 0]

    def first_compute(gather: fx.Node) -> int:
        frontier, seen = list(gathered_buffer(gather).users), []
        while frontier:
            user = frontier.pop()
            if is_view_op(user) or collective_kind(user) or user.target is WAIT:
                frontier.extend(user.users)
            elif index[user] > index[gather]:
                seen.append(index[user])
        return min(seen)

    return bool(gathers) and all(index[nxt] < first_compute(cur) for cur, nxt in zip(gathers, gathers[1:]))


def gathers(report: GraphReport) -> int:
    """The parameter gathers in a graph; on gloo (these checks) the pass makes each one broadcast
    per rank, so the graph must hold no all-gather."""
    return -1 if report.collectives["all_gather"] else report.collectives["broadcast"] // dist.get_world_size()


def reductions_in_flight_at_issue(graph: fx.Graph) -> list[int]:
    """For each gradient reduction (reduce-scatter, or all-to-all on gloo) in graph order, how
    many earlier ones were issued and not yet waited for."""
    in_flight: set[fx.Node] = set()
    counts = []
    for node in graph.nodes:
        if collective_kind(node) in ("reduce_scatter", "all_to_all"):
            counts.append(len(in_flight))
            in_flight.add(node)
        elif node.target is WAIT:
            in_flight.discard(node.args[0])
    return counts


COLLECTIVE_LINE = re.compile(
    r"_c10d_functional\.(all_gather_into_tensor(?:_out)?|reduce_scatter_tensor|all_to_all_single|broadcast_|wait_tensor)"
    r"\.default\("
)
KERNEL_LINE = re.compile(r"^\s*(extern_kernels\.\w+|cpp_fused\w*)\(")


def _first_buffer(arguments: str) -> str:
    """The buffer a collective's arguments name first (``buf33`` in ``reinterpret_tensor(buf33, ...)``)."""
    return re.search(r"\bbuf\d+", arguments).group(0)


def code_events(code: str) -> list[tuple[str, str]]:
    """The order of Inductor's generated wrapper code: ("all_gather" | "reduction" | "wait", buffer)
    for each collective issued or waited for (a reduction: a reduce-scatter, or on gloo an
    all-to-all; a gather: on gloo the first of its broadcasts, the bucket's last wait),
    ("kernel", "") for each compute kernel called."""
    events, broadcast_buffers = [], set()
    for line in code.splitlines():
        match = COLLECTIVE_LINE.search(line)
        if match and match.group(1) == "wait_tensor":
            buf = _first_buffer(line[match.end() :])
            if ("wait", buf) in events and buf in broadcast_buffers:  # the bucket's last wait counts
                events.remove(("wait", buf))
            events.append(("wait", buf))
        elif match and match.group(1) == "broadcast_":
            buf = _first_buffer(line[match.end() :])
            if buf not in broadcast_buffers:
                broadcast_buffers.add(buf)
                events.append(("all_gather", buf))
        elif match and match.group(1) == "all_gather_into_tensor_out":
            events.append(("all_gather", re.search(r"out=(\w+)", line).group(1)))
        elif match:
            kind = "all_gather" if match.group(1) == "all_gather_into_tensor" else "reduction"
            events.append((kind, line.split("=")[0].strip()))
        elif KERNEL_LINE.match(line):
            events.append(("kernel", ""))
        elif re.search(r"\bdel buf\d+", line):  # also "bufB = bufA; del bufA  # reuse"
            events.append(("free", re.search(r"\bdel (buf\d+)", line).group(1)))
    return events


def _kernel_while_in_flight(events: list[tuple[str, str]], kind: str, buf: str) -> bool:
    """Whether a compute kernel runs between the collective's issue and its wait."""
    issue, wait = events.index((kind, buf)), events.index(("wait", buf))
    return any(event == "kernel" for event, _ in events[issue:wait])


def code_reductions_beside_gathers(codes: list[str]) -> list[int]:
    """For each all-gather in the generated code, how many reductions were issued and not yet
    waited for when it was issued."""
    counts = []
    for code in codes:
        in_flight: set[str] = set()
        for kind, buf in code_events(code):
            if kind == "reduction":
                in_flight.add(buf)
            elif kind == "wait":
                in_flight.discard(buf)
            elif kind == "all_gather":
                counts.append(len(in_flight))
    return counts


def code_reductions_freed_at_wait(codes: list[str]) -> list[str]:
    """The reduction buffers in the generated code that are neither freed nor reused between their
    wait and the next reduction: each would hold a bucket's full-size gradients beside the next
    bucket's. (The last one goes when the graph returns.)"""
    kept = []
    for code in codes:
        events = code_events(code)
        for buf in (buf for kind, buf in events if kind == "reduction"):
            after_wait = events[events.index(("wait", buf)) + 1 :]
            next_issue = next((i for i, (kind, _) in enumerate(after_wait) if kind == "reduction"), None)
            if next_issue is not None and ("free", buf) not in after_wait[:next_issue]:
                kept.append(buf)
    return kept


def code_reductions_made_beside_previous(codes: list[str]) -> list[str]:
    """The reductions in the generated code whose input buffer (the bucket's full-size gradients)
    is first assigned before the previous reduction's wait: the two buckets' gradients, and the
    previous one's received chunks, would be alive at once."""
    early = []
    for code in codes:
        lines = code.splitlines()
        first_assigned: dict[str, int] = {}
        previous_wait = None
        for i, line in enumerate(lines):
            assigned = re.match(r"\s*(buf\d+) = ", line)
            if assigned:
                first_assigned.setdefault(assigned.group(1), i)
            match = COLLECTIVE_LINE.search(line)
            if not match or match.group(1) not in ("reduce_scatter_tensor", "all_to_all_single"):
                continue
            source = _first_buffer(line[match.end() :])
            if previous_wait is not None and first_assigned.get(source, -1) < previous_wait:
                early.append(source)
            output = line.split("=")[0].strip()
            waited = re.compile(rf"wait_tensor\.default\({output}\b")
            previous_wait = next(j for j in range(i + 1, len(lines)) if waited.search(lines[j]))
    return early


def code_overlaps(codes: list[str]) -> tuple[bool, bool, list]:
    """In the generated code, whether (every all-gather but a graph's first, every reduction but
    a graph's last two) has a compute kernel between its issue and its wait: the overlap the
    pass ordered, unless Inductor's own scheduling undoes it. The first all-gather has nothing to
    hide behind; the last reduction neither, and the one before it only the embedding's
    gradient, which Inductor computes earlier."""
    prefetch, overlapped, detail = True, True, []
    for code in codes:
        events = code_events(code)
        gathers = [buf for kind, buf in events if kind == "all_gather"]
        reductions = [buf for kind, buf in events if kind == "reduction"]
        prefetch &= all(_kernel_while_in_flight(events, "all_gather", buf) for buf in gathers[1:])
        overlapped &= all(_kernel_while_in_flight(events, "reduction", buf) for buf in reductions[:-2])
        compact = [f"{kind}:{buf}" if kind != "kernel" else "k" for kind, buf in events]
        detail.append(re.sub(r"\bk( k)+\b", "k", " ".join(compact)))
    return prefetch and bool(codes), overlapped and bool(codes), detail


def saved_gathered_weights(forward: fx.Graph) -> int:
    """Forward-graph outputs (saved for backward) that are views of a gathered bucket."""
    output = next(n for n in forward.nodes if n.op == "output")
    buckets = {gathered_buffer(n) for n in forward.nodes if collective_kind(n) == "broadcast"}
    count = 0
    for node in output.args[0]:
        while isinstance(node, fx.Node) and is_view_op(node):
            node = node.args[0]
        if isinstance(node, fx.Node) and node in buckets:
            count += 1
    return count


def region_calls(graph: fx.Graph) -> list[str]:
    """The subgraph each call of a nested compile region in ``graph`` runs, in graph order."""
    calls = graph.find_nodes(op="call_function", target=torch.ops.higher_order.invoke_subgraph)
    return [call.args[0].target for call in calls]


def gradient_reductions(report: GraphReport) -> int:
    """The gradient reductions in a backward graph; on gloo (these checks) the pass makes them
    all-to-alls, so the graph must hold no reduce-scatter."""
    return -1 if report.collectives["reduce_scatter"] else report.collectives["all_to_all"]


def main(backend: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("dp_shard",))
    with torch.device("meta"):
        units = plan_units(Transformer(ARGS), tokens=BATCH * SEQ, param_dtype=torch.float32)
    params_per_unit = {u.name: 0 for u in units}
    for name, _ in Transformer(ARGS).named_parameters():
        unit = next(u for u in sorted(params_per_unit, key=len, reverse=True) if name.startswith(u + "."))
        params_per_unit[unit] += 1
    n_params = sum(params_per_unit.values())

    torch.manual_seed(0)
    eager = train(build(mesh, reshard=True))

    tolerance = 0.0 if backend == "aot_eager" else 1e-4
    if backend == "aot_eager":
        # No bucketing: one all-gather per parameter forward, one reduction per parameter backward.
        losses, none_pass, _ = compiled_run(mesh, backend, None)
        forward, backward = none_pass.reports
        check(
            "none_counts",
            gathers(forward) == n_params and gradient_reductions(backward) == n_params,
            (forward, backward, n_params),
        )
        check("none_losses", losses == eager, (losses, eager))
        in_flight = reductions_in_flight_at_issue(none_pass.graphs[1])
        check("none_one_reduction_in_flight", in_flight == [0] * n_params, in_flight)

    # Manual: one collective per bucket, and the reordering prefetches.
    manual = plan_manual(units, default_manual_patterns([u.name for u in units]))
    losses, manual_pass, manual_code = compiled_run(mesh, backend, [b.units for b in manual.buckets])
    forward, backward = manual_pass.reports
    check(
        "manual_counts",
        gathers(forward) == len(manual.buckets) and gradient_reductions(backward) == len(manual.buckets),
        (forward, backward),
    )
    check("manual_losses", all(abs(a - b) <= tolerance * abs(b) for a, b in zip(losses, eager)), (losses, eager))
    check("manual_bucket_order", forward.all_gather_buckets == list(range(len(manual.buckets))), forward)
    # Each block's attention and feed-forward: two regions, each compiled once and called per block.
    regions = [region_calls(graph) for graph in manual_pass.graphs]
    check(
        "manual_blocks_share_two_regions",
        all(len(calls) == 2 * ARGS.n_layers and len(set(calls)) == 2 for calls in regions),
        regions,
    )
    if manual_pass.graphs:
        check("manual_prefetch_order", prefetch_order_holds(manual_pass.graphs[0]))
        in_flight = reductions_in_flight_at_issue(manual_pass.graphs[1])
        check("manual_one_reduction_in_flight", in_flight == [0] * len(manual.buckets), in_flight)
        # Resharded: backward re-gathers every block's bucket; not the embedding's, whose backward
        # needs no weight, nor the final norm and output's, kept gathered (its first need).
        block_buckets = sum(b.units[0].startswith("layers.") for b in manual.buckets)
        check("reshard_regathers", gathers(backward) == block_buckets, (backward, block_buckets))
        saved = saved_gathered_weights(manual_pass.graphs[0])
        check("reshard_frees_gathered", saved == params_per_unit["norm"] + params_per_unit["output"], saved)

    # Block: one forward and one backward graph for all the blocks (compiled once, reused), each
    # with the block's two buckets, prefetched and re-gathered.
    losses, block_pass, block_code = block_compiled_run(mesh, backend)
    check("block_graph_reused", len(block_pass.reports) == 2, block_pass.reports)
    forward, backward = block_pass.reports
    buckets = len(BLOCK_BUCKETS)
    check(
        "block_counts",
        forward.collectives == {"broadcast": 2 * buckets}
        and backward.collectives == {"broadcast": 2 * buckets, "all_to_all": buckets},
        (forward, backward),
    )
    check("block_losses", all(abs(a - b) <= tolerance * abs(b) for a, b in zip(losses, eager)), (losses, eager))
    if block_pass.graphs:
        check("block_prefetch_order", prefetch_order_holds(block_pass.graphs[0]))
        in_flight = reductions_in_flight_at_issue(block_pass.graphs[1])
        check("block_one_reduction_in_flight", in_flight == [0] * buckets, in_flight)
    if backend == "inductor":
        for name, code in (("manual", manual_code), ("block", block_code)):
            prefetch, overlapped, detail = code_overlaps(code)
            check(f"{name}_code_prefetch", prefetch, detail)
            check(f"{name}_code_reduction_overlap", overlapped, detail)
            beside = code_reductions_beside_gathers(code)
            check(f"{name}_code_one_transfer_at_a_time", not any(beside), (beside, detail))
            kept = code_reductions_freed_at_wait(code)
            check(f"{name}_code_reduction_freed_at_wait", not kept, (kept, detail))
            early = code_reductions_made_beside_previous(code)
            check(f"{name}_code_reduction_made_after_previous_wait", not early, (early, detail))

    if backend == "aot_eager":
        # Auto: exactly the plan's buckets (a 10 ms latency makes the blocks share a bucket).
        auto = plan_auto(
            units, CommModel(1e-2, 1e9), ComputeModel(1e9), world_size=dist.get_world_size(), memory_cap_bytes=2**20
        )
        losses, auto_pass, _ = compiled_run(mesh, backend, [b.units for b in auto.buckets])
        forward, backward = auto_pass.reports
        check("auto_plan_has_multi_unit_bucket", any(len(b.units) > 1 for b in auto.buckets), auto.describe())
        check(
            "auto_counts",
            gathers(forward) == len(auto.buckets) and gradient_reductions(backward) == len(auto.buckets),
            (forward, backward, auto.describe()),
        )
        check("auto_losses", losses == eager, (losses, eager))

        # Never reshard: the forward keeps the gathered weights for backward, which gathers nothing.
        losses, keep_pass, _ = compiled_run(mesh, backend, [b.units for b in manual.buckets], reshard=False)
        forward, backward = keep_pass.reports
        check("never_no_regather", gathers(backward) == 0, backward)
        check("never_keeps_gathered", saved_gathered_weights(keep_pass.graphs[0]) > 0)
        check("never_losses", losses == eager, (losses, eager))

    dist.barrier()
    exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1])
