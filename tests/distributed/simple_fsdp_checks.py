"""torchrun worker running every SimpleFSDP check in one launch (start-up dominates on CPU).

    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc-per-node N \\
        tests/distributed/simple_fsdp_checks.py OUT_DIR

Rank 0 writes ``OUT_DIR/results.json``: ``{check: {"ok": bool, "error": str | None, **measurements}}``
and prints one line per check. Every rank runs every check; values compared are all-reduced
losses or full tensors, so all ranks reach the same verdict and keep issuing the same collectives.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import functools
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

from models.llama3 import Transformer, llama3_flavors
from parallelisms.activation_checkpoint import apply_ac
from parallelisms.fsdp2 import apply_ddp, apply_fsdp2
from parallelisms.simple_fsdp import apply_simple_fsdp
from train import exit_without_teardown
from trainer.optim import clip_grad_norm_

# Narrower than debugmodel to keep each launch short; vocab 255: the embedding and output rows
# split unevenly on 2 and 4 ranks.
ARGS = dataclasses.replace(llama3_flavors["debugmodel"], dim=128, n_heads=8, n_layers=2, vocab_size=255, max_seq_len=32)
GLOBAL_BATCH, SEQ_LEN, STEPS = 8, 32, 10
GLOBAL_TOKENS = GLOBAL_BATCH * SEQ_LEN
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# Megatron-style TP of the blocks' projections (no sequence parallel: the norms stay plain).
TP_PLAN = {
    **dict.fromkeys(["attention.wq", "attention.wk", "attention.wv"], ColwiseParallel()),
    **dict.fromkeys(["feed_forward.w1", "feed_forward.w3"], ColwiseParallel()),
    **dict.fromkeys(["attention.wo", "feed_forward.w2"], RowwiseParallel()),
}
STORAGE_PLACEMENTS = {"replicate": [Replicate()], "fully_shard": [Shard(0)], "hybrid_shard": [Replicate(), Shard(0)]}

RANK, WORLD = 0, 1  # set in main()


# ---------------------------------------------------------------------------
# Models, data, training
# ---------------------------------------------------------------------------


def dp_modes() -> list[str]:
    """The data-parallel modes this world size can run (HSDP as 2 replicas x WORLD/2 shards)."""
    return ["replicate", "fully_shard"] + (["hybrid_shard"] if WORLD >= 4 else [])


@functools.cache  # every mesh creates process groups: build each once
def mesh_for(mode: str) -> DeviceMesh:
    if mode == "hybrid_shard":
        return init_device_mesh("cpu", (2, WORLD // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))


def build(
    impl: str,
    mode: str = "fully_shard",
    *,
    param_dtype: torch.dtype = torch.float32,
    reshard: bool = True,
    reshard_last_block: bool = False,
    ac: str = "none",
    dp_mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
) -> nn.Module:
    """A tiny Llama built on meta, parallelized by ``impl`` (plain, fsdp2, simple), then initialized.
    ``dp_mesh`` defaults to all ranks; ``tp_mesh`` adds tensor parallelism to the blocks first."""
    with torch.device("meta"):
        model = Transformer(ARGS)
    if tp_mesh is not None:
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, TP_PLAN)
    apply_ac(model.layers, ac)
    blocks = list(model.layers.values())
    dp_mesh = dp_mesh or mesh_for(mode)
    if impl == "simple":
        apply_simple_fsdp(
            model,
            dp_mesh,
            mode=mode,
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=reshard,
            blocks=blocks,
        )
    elif impl == "fsdp2" and mode == "replicate":
        apply_ddp(model, dp_mesh, param_dtype=param_dtype, reduce_dtype=torch.float32)
    elif impl == "fsdp2":
        apply_fsdp2(
            model,
            dp_mesh,
            param_dtype=param_dtype,
            reduce_dtype=torch.float32,
            reshard_after_forward=reshard,
            blocks=blocks,
            reshard_last_block=reshard_last_block,
        )
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(seed=0)
    return model


@dataclasses.dataclass(frozen=True)
class DataShard:
    """The slice of the global batch a rank trains on and the group its losses are summed over."""

    rank: int
    size: int
    group: dist.ProcessGroup | None
    """``None``: one plain model trains on the whole global batch."""


PLAIN = DataShard(0, 1, None)


def all_ranks() -> DataShard:
    """Pure data parallelism: the data-parallel rank is the global rank."""
    return DataShard(RANK, WORLD, dist.group.WORLD)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Counting sequences (random start, stride 1 or 2): learnable within a few steps."""
    generator = torch.Generator().manual_seed(step)
    starts = torch.randint(0, ARGS.vocab_size, (GLOBAL_BATCH, 1), generator=generator)
    strides = torch.randint(1, 3, (GLOBAL_BATCH, 1), generator=generator)
    tokens = (starts + strides * torch.arange(SEQ_LEN + 1)) % ARGS.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def local_batch(step: int, shard: DataShard) -> tuple[torch.Tensor, torch.Tensor]:
    rows = slice(shard.rank * GLOBAL_BATCH // shard.size, (shard.rank + 1) * GLOBAL_BATCH // shard.size)
    inputs, labels = global_batch(step)
    return inputs[rows], labels[rows]


def loss_fn(model: nn.Module, inputs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the global token count: data parallel sums to the global mean."""
    logits = model(inputs)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / GLOBAL_TOKENS


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, foreach=True)


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, steps: range, shard: DataShard | None = None
) -> list[float]:
    """Trainer-like steps (clip to norm 1, AdamW) on ``shard`` (default: all ranks); returns the global losses."""
    shard = shard or all_ranks()
    losses = []
    for step in steps:
        optimizer.zero_grad()
        loss = loss_fn(model, *local_batch(step, shard))
        loss.backward()
        clip_grad_norm_(list(model.parameters()), 1.0)
        optimizer.step()
        loss = loss.detach()
        if shard.group is not None:
            dist.all_reduce(loss, group=shard.group)
        losses.append(loss.item())
    return losses


def max_abs_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------
# Checks (each returns its measurements or raises)
# ---------------------------------------------------------------------------

_REFERENCE: list[float] = []


def reference_losses() -> list[float]:
    """One plain model trained on the whole global batch, computed on every rank (no DP)."""
    if not _REFERENCE:
        model = build("plain")
        _REFERENCE.extend(train(model, make_optimizer(model), range(STEPS), PLAIN))
    return _REFERENCE


_PARITY: dict[tuple[str, str], list[float]] = {}


def check_parity(mode: str) -> dict[str, Any]:
    """SimpleFSDP eager vs FSDP2 over 10 AdamW steps, and both vs the plain reference.

    Bitwise, except on more than 2 ranks where the two sum an element's terms in different orders
    and may differ in the last bits. DDP: FSDP2 all-reduces one flat buffer of all gradients,
    SimpleFSDP one buffer per parameter, and gloo's ring all-reduce sums an element's 4 terms in an
    order set by its offset in the buffer (the same values at another offset come out different in
    the last bit). FSDP: on gloo FSDP2 reduce-scatters with an all-to-all and a sum in rank order,
    SimpleFSDP in eager with gloo's reduce-scatter (a ring all-reduce). With 2 terms the order does
    not matter; HSDP reduce-scatters within a replica of 2 ranks first, as FSDP2 does, then
    all-reduces over 2 replicas, so it is bitwise too.
    """
    for impl in ("fsdp2", "simple"):
        model = build(impl, mode)
        _PARITY[impl, mode] = train(model, make_optimizer(model), range(STEPS))
    fsdp2, simple = _PARITY["fsdp2", mode], _PARITY["simple", mode]
    reference = reference_losses()
    result = {
        "bitwise_equal_to_fsdp2": simple == fsdp2,
        "max_abs_diff_vs_fsdp2": max_abs_diff(simple, fsdp2),
        "max_rel_diff_vs_fsdp2": max_rel_diff(simple, fsdp2),
        "max_rel_diff_vs_reference": max_rel_diff(simple, reference),
        "fsdp2_max_rel_diff_vs_reference": max_rel_diff(fsdp2, reference),
        "losses": simple,
    }
    if mode in ("replicate", "fully_shard") and WORLD > 2:
        assert max_rel_diff(simple, fsdp2) <= 1e-6, f"SimpleFSDP {simple} vs FSDP2 {fsdp2}"
    else:
        assert simple == fsdp2, f"SimpleFSDP {simple} != FSDP2 {fsdp2}"
    assert result["max_rel_diff_vs_reference"] <= 1e-5, result
    assert simple[-1] < simple[0] - 0.1, "the model should learn"
    return result


def check_state_dict() -> dict[str, Any]:
    """Names equal the plain model's; values are DTensors with the mode's placements; gathering works."""
    plain = build("plain")
    plain_keys = list(plain.state_dict())
    for mode in dp_modes():
        model = build("simple", mode)
        state = model.state_dict()
        assert list(state) == plain_keys, (mode, list(state), plain_keys)
        assert [name for name, _ in model.named_parameters()] == [name for name, _ in plain.named_parameters()]
        for name, value in state.items():
            assert isinstance(value, DTensor), (mode, name, type(value))
            assert list(value.placements) == STORAGE_PLACEMENTS[mode], (mode, name, value.placements)
            assert torch.equal(value.full_tensor(), plain.state_dict()[name]), (mode, name)
        wq = model.layers["0"].attention.wq
        # Stored sharded under the original name; reading the attribute gathers.
        assert isinstance(wq._parameters["weight"], DTensor)
        assert type(wq.weight) is torch.Tensor and torch.equal(wq.weight, plain.layers["0"].attention.wq.weight)
    return {"modes": dp_modes(), "num_keys": len(plain_keys)}


def check_materialized() -> dict[str, Any]:
    """Sharding an initialized model keeps its values and its forward output; no_grad gathers too."""
    plain = build("plain")
    model = build("plain")
    apply_simple_fsdp(model, mesh_for("fully_shard"), mode="fully_shard", reshard_after_forward=True)
    for (name, param), (_, value) in zip(model.named_parameters(), plain.named_parameters(), strict=True):
        assert torch.equal(param.full_tensor(), value), name
    inputs, _ = global_batch(0)
    expected = plain(inputs)
    assert torch.equal(model(inputs), expected)
    with torch.no_grad():
        assert torch.equal(model(inputs), expected)

    # A layer with fewer rows than ranks: some shards are empty, gradients are still summed.
    linear = nn.Linear(4, 3)
    reference = nn.Linear(4, 3)
    reference.load_state_dict(linear.state_dict())
    apply_simple_fsdp(linear, mesh_for("fully_shard"), mode="fully_shard", reshard_after_forward=False)
    x = torch.arange(8.0).view(2, 4)
    linear(x).sum().backward()
    reference(x).sum().backward()
    # `linear.weight` is the gathered copy; the gradient sits on the stored parameter.
    for (name, param), (_, expected) in zip(linear.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(param.grad.full_tensor(), WORLD * expected.grad), name
    return {"small_layer_weight_rows_on_this_rank": linear._parameters["weight"].to_local().shape[0]}


class GatherTracker(TorchDispatchMode):
    """Counts all-gathers and keeps a weak reference to each one's output storage, labelled by the
    block (``layers.i``) that issued it, to tell which gathered weights are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.block: str | None = None
        self.gathered: list[tuple[str | None, StorageWeakRef]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is ALL_GATHER:
            self.gathered.append((self.block, StorageWeakRef(out.untyped_storage())))
        return out

    def label_blocks(self, model: nn.Module) -> None:
        for name, block in model.layers.items():
            block.register_forward_pre_hook(lambda *_, name=name: setattr(self, "block", f"layers.{name}"))
            block.register_forward_hook(lambda *_: setattr(self, "block", None))

    def alive_in_blocks(self) -> int:
        gc.collect()
        return sum(1 for block, ref in self.gathered if block is not None and not ref.expired())

    def in_blocks(self) -> int:
        return sum(1 for block, _ in self.gathered if block is not None)


class CollectiveRecorder(TorchDispatchMode):
    """Counts the functional collectives and records their input dtypes, by collective name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()
        self.dtypes: dict[str, set[torch.dtype]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "_c10d_functional" and isinstance(args[0], torch.Tensor):
            self.counts[func._opname] += 1
            self.dtypes.setdefault(func._opname, set()).add(args[0].dtype)
        return func(*args, **(kwargs or {}))


def check_fsdp2_reshard_policy() -> dict[str, Any]:
    """FSDP2 resharding after forward: the blocks but the last by default, every block when asked
    (torchtitan's "always"); a resharded block's weights are its shards (DTensors) after forward."""
    resharded = {}
    for reshard_last_block in (False, True):
        model = build("fsdp2", reshard_last_block=reshard_last_block)
        model(torch.randint(0, ARGS.vocab_size, (2, ARGS.max_seq_len)))
        blocks = model.layers.values()
        resharded[reshard_last_block] = [isinstance(block.attention.wq.weight, DTensor) for block in blocks]
    last = len(model.layers) - 1
    assert resharded == {False: [True] * last + [False], True: [True] * (last + 1)}, resharded
    return {"resharded_blocks": {str(k): v for k, v in resharded.items()}}


def measure_reshard(reshard: bool, ac: str = "none") -> tuple[dict[str, Any], list[torch.Tensor]]:
    """One forward/backward: gathered block weights alive after forward, all-gathers in backward;
    also returns the full gradients."""
    model = build("simple", "fully_shard", reshard=reshard, ac=ac)
    forward_tracker = GatherTracker()
    forward_tracker.label_blocks(model)
    inputs, labels = local_batch(0, all_ranks())
    with forward_tracker:
        loss = loss_fn(model, inputs, labels)
    alive = forward_tracker.alive_in_blocks()
    backward_tracker = GatherTracker()
    with backward_tracker:
        loss.backward()
    loss = loss.detach()
    dist.all_reduce(loss)
    measurements = {
        "block_gathers_in_forward": forward_tracker.in_blocks(),
        "block_gathers_alive_after_forward": alive,
        "gathers_in_backward": len(backward_tracker.gathered),
        "loss": loss.item(),
    }
    return measurements, [p.grad.full_tensor() for p in model.parameters()]


def check_reshard_memory() -> dict[str, Any]:
    """With resharding no gathered block weight survives forward and backward re-gathers; without,
    all survive and backward gathers nothing; AC-wrapped blocks reshard through their own checkpoint."""
    never, never_grads = measure_reshard(False)
    block_gathers = 9 * ARGS.n_layers  # 2 norms + 4 attention + 3 MLP weights per block
    assert never["block_gathers_in_forward"] == block_gathers, never
    assert never["block_gathers_alive_after_forward"] == block_gathers, never
    assert never["gathers_in_backward"] == 0, never
    result = {"never": never}
    for name, ac in (("reshard", "none"), ("reshard_full_ac", "full"), ("reshard_op_sac", "selective")):
        result[name], grads = measure_reshard(True, ac)
        assert result[name]["block_gathers_alive_after_forward"] == 0, (name, result[name])
        assert result[name]["gathers_in_backward"] == block_gathers, (name, result[name])
        assert result[name]["loss"] == never["loss"], (name, result[name], never)
        assert all(torch.equal(got, expected) for got, expected in zip(grads, never_grads, strict=True)), name
    return result


def save_after_two_steps(impl: str, path: str) -> None:
    model = build(impl)
    optimizer = make_optimizer(model)
    train(model, optimizer, range(2))
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)


def resume_for_two_steps(impl: str, path: str) -> list[float]:
    model = build(impl)
    optimizer = make_optimizer(model)
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return train(model, optimizer, range(2, 4))


def check_dcp(out_dir: str) -> dict[str, Any]:
    """FSDP2 -> SimpleFSDP and back through DCP: the next steps' losses equal the uninterrupted run's."""
    uninterrupted = {impl: _PARITY[impl, "fully_shard"][2:4] for impl in ("fsdp2", "simple")}
    result = {}
    for saver, loader in (("fsdp2", "simple"), ("simple", "fsdp2")):
        path = os.path.join(out_dir, f"ckpt_{saver}")
        save_after_two_steps(saver, path)
        resumed = resume_for_two_steps(loader, path)
        result[f"{saver}_to_{loader}"] = {"resumed": resumed, "uninterrupted": uninterrupted[saver]}
        assert resumed == uninterrupted[saver], result
    return result


def check_bf16() -> dict[str, Any]:
    """bf16 params / fp32 reduce: trains, keeps fp32 params and grads, stays close to fp32."""
    model = build("simple", param_dtype=torch.bfloat16)
    optimizer = make_optimizer(model)
    with CollectiveRecorder() as recorder:
        bf16 = train(model, optimizer, range(1))
    bf16 += train(model, optimizer, range(1, STEPS))
    # Cast before the all-gather (bf16 on the wire), reduce in fp32, keep fp32 params and grads.
    assert recorder.dtypes["all_gather_into_tensor"] == {torch.bfloat16}, recorder.dtypes
    assert recorder.dtypes["reduce_scatter_tensor"] == {torch.float32}, recorder.dtypes
    assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    fp32 = _PARITY["simple", "fully_shard"]
    assert bf16 != fp32, "bf16 should change the numerics"
    assert max_rel_diff(bf16, fp32) <= 1e-2, (bf16, fp32)
    return {"max_rel_diff_vs_fp32": max_rel_diff(bf16, fp32)}


def check_tensor_parallel() -> dict[str, Any]:
    """FSDP x TP on a (dp_shard, tp=2) mesh: storage on the 2-D mesh (strided where both split
    dim 0), losses bitwise equal to FSDP2 x TP, backward re-gathers the blocks' weights."""
    mesh = init_device_mesh("cpu", (WORLD // 2, 2), mesh_dim_names=("dp_shard", "tp"))
    dp_mesh, tp_mesh = mesh["dp_shard"], mesh["tp"]
    shard = DataShard(dp_mesh.get_local_rank(), dp_mesh.size(), dp_mesh.get_group())
    plain = build("plain").state_dict()
    model = build("simple", dp_mesh=dp_mesh, tp_mesh=tp_mesh)
    expected_placements = {
        "layers.0.attention.wq.weight": (_StridedShard(0, split_factor=2), Shard(0)),
        "layers.0.attention.wo.weight": (Shard(0), Shard(1)),
        "layers.0.attention_norm.weight": (Shard(0),),
    }
    state = model.state_dict()
    assert list(state) == list(plain)
    for name, placements in expected_placements.items():
        assert state[name].placements == placements, (name, state[name].placements)
    for name, value in state.items():
        assert torch.equal(value.full_tensor(), plain[name]), name

    steps = STEPS // 2  # the stretch goal's check, kept short
    losses, collectives = {}, {}
    for impl, trained in (("simple", model), ("fsdp2", build("fsdp2", dp_mesh=dp_mesh, tp_mesh=tp_mesh))):
        optimizer = make_optimizer(trained)
        with CollectiveRecorder() as collectives[impl]:
            losses[impl] = train(trained, optimizer, range(1), shard)
        losses[impl] += train(trained, optimizer, range(1, steps), shard)
    simple, fsdp2 = losses["simple"], losses["fsdp2"]
    first_step = collectives["simple"].counts
    result = {
        "bitwise_equal_to_fsdp2": simple == fsdp2,
        "max_rel_diff_vs_reference": max_rel_diff(simple, reference_losses()[:steps]),
        "collectives_in_first_step": dict(first_step),
    }
    # Forward gathers every weight, backward the blocks' weights again.
    assert first_step["all_gather_into_tensor"] == len(plain) + 9 * ARGS.n_layers, result
    # TP's own all-reduces (FSDP2 issues its dp collectives outside functional collectives) are
    # not issued again by the resharding replay.
    fsdp2_all_reduces = collectives["fsdp2"].counts["all_reduce"]
    assert first_step["all_reduce"] == fsdp2_all_reduces, (result, fsdp2_all_reduces)
    assert simple == fsdp2, (simple, fsdp2)
    assert result["max_rel_diff_vs_reference"] <= 1e-5, result
    return result


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def checks(out_dir: str) -> list[tuple[str, Callable[[], dict[str, Any]]]]:
    """The checks for this world size, in order (dcp and bf16 reuse the fully_shard parity run).
    Gather counts and bf16's rounding do not depend on the world size: 2 ranks check them."""
    return [
        *((f"parity_{mode}", lambda mode=mode: check_parity(mode)) for mode in dp_modes()),
        ("state_dict", check_state_dict),
        ("materialized", check_materialized),
        *([("reshard_memory", check_reshard_memory)] if WORLD == 2 else []),
        *([("fsdp2_reshard_policy", check_fsdp2_reshard_policy)] if WORLD == 2 else []),
        ("dcp", lambda: check_dcp(out_dir)),
        *([("bf16", check_bf16)] if WORLD == 2 else []),
        *([("tensor_parallel", check_tensor_parallel)] if WORLD >= 4 else []),
    ]


def main() -> None:
    global RANK, WORLD
    out_dir = sys.argv[1]
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    RANK, WORLD = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    results = {}
    for name, check in checks(out_dir):
        start = time.perf_counter()
        try:
            results[name] = {"ok": True, "error": None, **check()}
        except Exception:
            results[name] = {"ok": False, "error": traceback.format_exc()}
        results[name]["seconds"] = round(time.perf_counter() - start, 2)
        # Agree on the verdict: a check that failed on any rank failed.
        verdicts = [None] * WORLD
        dist.all_gather_object(verdicts, results[name]["ok"])
        results[name]["ok"] = all(verdicts)
        if RANK == 0:
            summary = {k: v for k, v in results[name].items() if k not in ("error", "losses")}
            print(f"CHECK {name}: {json.dumps(summary, default=str)}", flush=True)
            if results[name]["error"]:
                print(results[name]["error"], flush=True)
    if RANK == 0:
        with open(os.path.join(out_dir, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    dist.barrier()
    exit_without_teardown(0)


if __name__ == "__main__":
    main()
