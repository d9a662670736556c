"""Dry run at any world size: one process plays one rank on torch's fake process group, with fake
weights, and prints its peak memory over two training steps (docs/dry-run-and-planner.md)."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle
import signal
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType, _UpdateType
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining.schedules import PipelineScheduleSingle, Schedule1F1B
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from config.errors import ConfigError, print_error
from config.job_config import JobConfig
from config.manager import load_config, named_as_given, typed_options
from config.rules import batch_layout
from models.builder import BuiltModel, build_model
from models.registry import get_model_spec
from models.sizes import job_model_args
from parallelisms.parallel_dims import ParallelDims
from programs.preflight import check, launch_sizes, log_warnings_once, split_launch_options
from trainer.checkpoint.manager import ModelState, OptimizerState, whole_model
from trainer.data.tokenizer import build_tokenizer
from trainer.distributed import parallel_dims_from_config
from trainer.loss import Loss
from trainer.optim import build_optimizer_and_schedule, clip_grad_norm_, optimizers_holding_state

logger = logging.getLogger(__name__)

STEPS = 2  # the last is measured, with the optimizer state and wrappers' buffers the first allocates
CATEGORIES = ("Parameter", "Buffer", "Gradient", "Optstate", "Activation", "Temp", "Other")  # MemTracker's
# The tracker's key for offloaded storage (host memory); the dry run's own tensors are all on "cpu".
HOST = torch.device("meta")


class _PeakTracker(MemTracker):
    """MemTracker keeping only the rank's peak: per-module peaks made 8B's two steps 500 s, not 30 s.
    With ``offloaded`` parameters (CPU offload) their shards, gradients and the optimizer's state and
    step count in host memory, under the key ``HOST``: the device's peak and the host's apart."""

    def __init__(self, offloaded: list[torch.Tensor] | None = None):
        super().__init__()
        self.offloaded = offloaded or []
        self._on_host: list[torch.Tensor | None] = [None] * len(self.offloaded)  # each one's gradient moved
        self._hook = None

    def __enter__(self) -> _PeakTracker:
        if self.offloaded:  # before MemTracker takes the current memory as the first peak
            for param in self.offloaded:
                self._to_host(param, _MemRefType.PARAM)
            self._gradients_to_host()
            # Gradients come back to the host as each module's backward ends; the root's at the end.
            self._hook = register_optimizer_step_pre_hook(lambda *args: self._gradients_to_host())
        return super().__enter__()

    def __exit__(self, *args) -> None:
        if self._hook is not None:
            self._hook.remove()
        super().__exit__(*args)

    def _post_bw_hook(self, module: torch.nn.Module, args) -> None:
        super()._post_bw_hook(module, args)
        self._gradients_to_host()

    def _gradients_to_host(self) -> None:
        for i, param in enumerate(self.offloaded):
            if param.grad is not None and param.grad is not self._on_host[i]:
                self._to_host(param.grad, _MemRefType.GRAD)
                self._on_host[i] = param.grad

    def _to_host(self, tensor: torch.Tensor, reftype) -> None:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        for winfo in self._update_and_maybe_create_winfos(local, reftype):
            if winfo.device == HOST:
                continue
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.DEL, winfo)
            winfo.device = HOST
            if winfo.mem_consumed > 0:
                self._update_snap(_UpdateType.ADD, winfo)

    def _update_snap(self, u_type, winfo, old_mem_consumed=None, old_reftype=None) -> None:
        # The optimizer steps on the host: its state and temporaries are there.
        if self.offloaded and winfo.reftype == _MemRefType.OPT and winfo.device != HOST and u_type == _UpdateType.ADD:
            winfo.device = HOST
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)

    def _update_peak_stats(self, peak_state) -> None:
        for dev, dev_snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < dev_snap[_TOTAL_KEY]:
                self._peak_mem[dev] = dev_snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(dev_snap)

    def _update_and_maybe_create_winfos(self, t, reftype, update_existing: bool = False):
        # A parameter stepped in backward has freed its gradient before MemTracker's hook counts it.
        return set() if t is None else super()._update_and_maybe_create_winfos(t, reftype, update_existing)

    def _pre_fw_hook(self, module: torch.nn.Module, inputs) -> None:
        # MemTracker refuses a root module's second forward: each microbatch starts its stats afresh.
        parents = set(self._mod_tracker.parents) - {self._mod_tracker.get_known_fqn(module)}
        if module in self.memory_tracking and not self._mod_tracker.is_bw and parents == {"Global"}:
            del self.memory_tracking[module]
        super()._pre_fw_hook(module, inputs)


@dataclass
class DryRunReport:
    rank: int
    world_size: int
    mesh: dict[str, int]
    parameters: int  # of the rank's model parts, before sharding
    vocab_size: int  # model.tokenizer_path's, else the flavor's or HF folder's (not the default tokenizer's)
    peak_bytes: int  # live tensor storage in the last step (the first is a warm-up)
    peak: dict[str, int]  # the peak's bytes by MemTracker category
    after_forward: dict[str, int]  # by category at the end of the last forward: the saved activations
    state_dict_bytes: int  # this rank's checkpoint state dicts (model and optimizer)
    buckets: int | None  # compiled SimpleFSDP's buckets on this rank (None: no bucketing)
    bucket_pair_bytes: int  # analytical: the most neighbouring buckets gathered at once (prefetch + 1)
    seconds: float
    host_peak: dict[str, int] = dataclasses.field(default_factory=dict)  # CPU offload: host memory, with "Total"
    device_memory_bytes: int = 0  # plan.device_memory_gib: what "fits" means

    def summary(self) -> str:
        mesh = " x ".join(f"{name} {size}" for name, size in self.mesh.items())
        lines = [
            f"dry run: rank {self.rank} of {self.world_size} ({mesh}), {self.parameters / 1e9:.2f}B parameters in its stages "
            f"(vocabulary {self.vocab_size:,}), {STEPS} steps in {self.seconds:.0f}s",
            f"  peak memory per rank {_size(self.peak_bytes)} in step {STEPS} (live tensors as MemTracker "
            "counts them; per-tensor optimizer step)",
        ]
        for name in CATEGORIES:
            lines.append(
                f"    {name.lower():<11} {_size(self.peak.get(name, 0)):>11} at the peak, "
                f"{_size(self.after_forward.get(name, 0)):>11} at the end of forward"
            )
        if self.buckets is not None:
            lines.append(
                f"  compiled SimpleFSDP: {self.buckets} buckets; the neighbouring ones gathered at once hold up to "
                f"{_size(self.bucket_pair_bytes)} (analytical), a peak of up to "
                f"{_size(self.peak_bytes + self.bucket_pair_bytes)} with them"
            )
        if self.host_peak:
            parts = ", ".join(
                f"{n.lower()} {_size(self.host_peak.get(n, 0))}" for n in ("Parameter", "Gradient", "Optstate")
            )
            lines.append(f"  host memory (training.enable_cpu_offload) {_size(self.host_peak[_TOTAL_KEY])}: {parts}")
        device = self.peak_bytes + self.bucket_pair_bytes
        verdict = "fits" if device <= self.device_memory_bytes else "does NOT fit"
        lines.append(
            f"  {verdict} a device of {_size(self.device_memory_bytes)} (plan.device_memory_gib): "
            f"{_size(device)} at the peak"
        )
        lines.append(f"  checkpoint state dict {_size(self.state_dict_bytes)} on this rank")
        return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _rank_actions(schedule, pp_rank: int) -> list[tuple[int, str, int]]:
    """(stage, computation, microbatch) of the rank's actions in order; GPipe's and 1F1B's loop spelt out
    (torch 2.13's ``pipeline_order`` numbers the last rank's 1F1B forwards from 1)."""
    if not isinstance(schedule, PipelineScheduleSingle):
        actions = (a for a in schedule.pipeline_order[pp_rank] if a is not None)
        return [(a.stage_index, a.computation_type.value, a.microbatch_index) for a in actions]
    stage, n = schedule._stage.stage_index, schedule._n_microbatches
    warmup = min(n, schedule._num_stages - stage) if isinstance(schedule, Schedule1F1B) else n
    order = [(stage, "F", mb) for mb in range(warmup)]
    for mb in range(n):
        order.append((stage, "B", mb))
        if warmup + mb < n:
            order.append((stage, "F", warmup + mb))
    return order


class _Boundaries:
    """The stage boundaries' transfers: over the fake group to another rank, in memory to a stage of
    this one (V schedules put neighbours on one rank). ``key``: (what, stage, microbatch)."""

    def __init__(self, stage_ranks: dict[int, int], group: dist.ProcessGroup):
        self.stage_ranks, self.group = stage_ranks, group
        self.own: dict[tuple[str, int, int], torch.Tensor] = {}

    def send(self, tensor: torch.Tensor, stage: int, key: tuple[str, int, int]) -> None:
        if self.stage_ranks[stage] == dist.get_rank():
            self.own[key] = tensor
        else:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            dist.send(local.contiguous(), dst=self.stage_ranks[stage], group=self.group)

    def receive(self, template: torch.Tensor, stage: int, key: tuple[str, int, int]) -> torch.Tensor:
        if self.stage_ranks[stage] == dist.get_rank():
            return self.own.pop(key)
        buffer = torch.empty_like(template)
        dist.recv(
            buffer.to_local() if isinstance(buffer, DTensor) else buffer, src=self.stage_ranks[stage], group=self.group
        )
        return buffer


def _pipeline_step(
    built: BuiltModel, loss: Loss, inputs: torch.Tensor, labels: torch.Tensor, mark, dims: ParallelDims
) -> None:
    """This rank's actions of one schedule step, sends and receives on the fake group (torch's warm-up needs
    values it cannot deliver). ``mark()`` comes before the first backward: the most in flight."""
    schedule = built.schedule
    pipeline_stages = getattr(schedule, "_stages", None) or [schedule._stage]
    stages = {stage.stage_index: stage for stage in pipeline_stages}
    n_stages, group = schedule._num_stages, pipeline_stages[0].group
    ranks = dist.get_process_group_ranks(group)
    stage_ranks = getattr(schedule, "stage_index_to_group_rank", None) or {s: s for s in range(n_stages)}
    boundaries = _Boundaries({s: ranks[r] for s, r in stage_ranks.items()}, group)
    micro_inputs = inputs.tensor_split(schedule._n_microbatches)
    micro_labels = labels.tensor_split(schedule._n_microbatches)
    # A stage receives the hidden state (split on the sequence under TP); autocast keeps it in float32.
    microbatch, seq_len = micro_inputs[0].shape
    dtype = torch.float32 if built.autocast else built.compute_dtype
    template = torch.empty(microbatch, seq_len // dims.tp, built.args.dim, dtype=dtype)
    saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
    for s, kind, mb in _rank_actions(schedule, dims.pp_mesh.get_local_rank()):
        stage = stages.get(s)
        if stage is None:
            continue
        if kind == "F":
            if s == 0:
                x, out = None, stage.submod(micro_inputs[mb])
            else:
                x = boundaries.receive(template, s - 1, ("input", s, mb)).detach().requires_grad_()
                out = stage.submod(x)
            if s < n_stages - 1:
                boundaries.send(out, s + 1, ("input", s + 1, mb))
            saved[(s, mb)] = (x, out)
        elif kind in ("B", "I"):
            if mark is not None:
                mark()
                mark = None
            x, out = saved.pop((s, mb))
            if isinstance(stage.submod, FSDPModule):
                # As torch's stages do: gradients accumulate unsharded until the step's last backward.
                stage.submod.set_is_last_backward(False)
                stage.submod.set_reshard_after_backward(False)
                stage.submod.set_requires_gradient_sync(False)
            with loss.context():
                if s == n_stages - 1:
                    loss(out, micro_labels[mb]).backward()
                else:
                    out.backward(boundaries.receive(out, s + 1, ("grad", s, mb)))
            if x is not None:
                boundaries.send(x.grad, s - 1, ("grad", s - 1, mb))
    for stage in pipeline_stages:
        stage.perform_reduce_grad(1)  # the schedule's closing action: FSDP's reduce-scatters (scale_grads off)


def _train_step(built: BuiltModel, loss: Loss, optimizer, lr_scheduler, batches, dims: ParallelDims, mark) -> None:
    optimizer.zero_grad()
    for inputs, labels in batches:
        if built.schedule is None:
            logits = built.parts[0](inputs)
            with loss.context():
                value = loss(logits, labels)
                mark()
                value.backward()
        elif dist.get_backend() == "fake":
            _pipeline_step(built, loss, inputs, labels, mark, dims)
        else:  # real ranks (measuring a real run's peak) run torch's schedule itself
            with loss.context():
                built.run_pipeline(inputs, labels, train=True)
    params = [p for part in built.parts for p in part.parameters() if p.grad is not None]
    clip_grad_norm_(params, float("inf"), pp_mesh=dims.pp_mesh)
    optimizer.step()
    lr_scheduler.step()


def measure_steps(
    built: BuiltModel,
    loss: Loss,
    optimizer,
    lr_scheduler,
    make_batch,
    accumulation: int,
    dims: ParallelDims,
    offload: bool = False,
) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """The last of ``STEPS`` steps' device peak, end of forward and (``offload``: CPU offload) host
    peak, bytes by MemTracker category (and "Total")."""
    device = next(built.parts[0].parameters()).device
    after_forward: dict[str, int] = {}
    # The sharded parameters, as they are between steps (FSDP2 registers gathered ones in forward).
    tracker = _PeakTracker([p for part in built.parts for p in part.parameters()] if offload else None)

    def mark() -> None:
        after_forward.update(tracker.get_tracker_snapshot("current").get(device, {}))

    for group in optimizer.param_groups:
        # Per tensor: fused reads a scalar fake tensors lack; MemTracker counts foreach's as new state.
        group.update(foreach=False, fused=False)
    for step in range(STEPS):
        batches = [make_batch() for _ in range(accumulation)]
        if step < STEPS - 1:
            # Warm-up: the optimizer state and the wrappers' lazily built buffers come to be.
            _train_step(built, loss, optimizer, lr_scheduler, batches, dims, lambda: None)
            continue
        tracker.track_external(*built.parts, *optimizers_holding_state(optimizer))
        with tracker:
            _train_step(built, loss, optimizer, lr_scheduler, batches, dims, mark)
    peak = tracker.get_tracker_snapshot("peak")
    return peak.get(device, {}), after_forward, peak.get(HOST, {})


def _bytes_of(value) -> int:
    if isinstance(value, dict):
        return sum(_bytes_of(item) for item in value.values())
    if not isinstance(value, torch.Tensor):
        return 0
    local = value.to_local() if isinstance(value, DTensor) else value
    return local.numel() * local.element_size()


def _buckets_planned(config: JobConfig) -> bool:
    """Whether the real run compiles SimpleFSDP with bucketing (auto needs given figures: no GPUs here)."""
    c = config.compile
    if not (c.compiles_model and config.parallelism.data_parallel_impl == "simple_fsdp" and c.bucketing != "none"):
        return False
    if c.bucketing == "auto" and None in (config.comm.alpha_us, config.comm.bandwidth_gbps, c.compute_flops):
        raise ConfigError(
            "compile.bucketing auto in a dry run: set comm.alpha_us, comm.bandwidth_gbps and compile.compute_flops "
            "for the devices it stands for (it cannot time them)"
        )
    return True


def _eager(config: JobConfig, bucketed: bool) -> JobConfig:
    if not config.compile.enable:
        return config
    logger.warning(
        "compile.enable: the dry run runs the model eagerly (torch.compile does not trace under the fake "
        "tensors' dispatch mode); the estimate is eager's%s",
        " plus SimpleFSDP's gathered buckets, analytically" if bucketed else "",
    )
    return dataclasses.replace(config, compile=dataclasses.replace(config.compile, enable=False))


def dry_run(config: JobConfig, world_size: int, rank: int = 0) -> DryRunReport:
    """``rank``'s build, two steps and checkpoint state dicts of ``config`` on ``world_size`` fake ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    start = time.perf_counter()
    config = _as_on_gpus(config)
    compiled = config  # what the real run compiles: SimpleFSDP's buckets are planned from it
    bucketed = _buckets_planned(config)
    config = _eager(config, bucketed)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    dims = parallel_dims_from_config(config.parallelism, world_size)
    dims.build_mesh("cpu")  # outside fake mode: the mesh's own bookkeeping needs real tensors
    global_batch, accumulation = batch_layout(config.training, dims.dp_degree)
    loss = Loss(global_batch * config.training.seq_len, dims, config.compile, config.parallelism.enable_loss_parallel)
    vocab_size = None
    if config.model.tokenizer_path:
        vocab_size = build_tokenizer(config.model.tokenizer_path, config.job.cache_dir).vocab_size
    args = job_model_args(config, vocab_size)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    device = torch.device("cpu")
    built = build_model(config, dims, device, args, loss, fake_mode=fake_mode)
    with fake_mode:
        optimizer, lr_scheduler = build_optimizer_and_schedule(
            config.optimizer, config.lr_scheduler, config.training, built.parts
        )
        # A context-parallel rank's chunks of each sequence.
        shape = (config.training.local_batch_size, config.training.seq_len // dims.cp)

        def batch() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.randint(args.vocab_size, shape), torch.randint(args.vocab_size, shape)

        peak, after_forward, host = measure_steps(
            built, loss, optimizer, lr_scheduler, batch, accumulation, dims, config.training.enable_cpu_offload
        )
        model = whole_model(built.parts)
        state_bytes = _bytes_of(ModelState(model).state_dict()) + _bytes_of(
            OptimizerState(model, optimizer).state_dict()
        )
    plans = [get_model_spec(config.model.name).bucket_plan_fn(part, dims, compiled) for part in built.parts]
    # Only compiled SimpleFSDP gathers by buckets (bucket_plan plans for any data parallelism).
    buckets = [b.param_bytes // dims.tp for plan in plans if plan is not None and bucketed for b in plan.buckets]
    return DryRunReport(
        rank=rank,
        world_size=world_size,
        mesh=dict(zip(dims.mesh.mesh_dim_names, dims.mesh.shape, strict=True)),
        parameters=sum(p.numel() for part in built.parts for p in part.parameters()),
        vocab_size=args.vocab_size,
        peak_bytes=peak.get(_TOTAL_KEY, 0),
        peak={k: v for k, v in peak.items() if k != _TOTAL_KEY},
        after_forward=after_forward,
        state_dict_bytes=state_bytes,
        buckets=len(buckets) if bucketed else None,
        bucket_pair_bytes=max(_windows(buckets, _gathered_at_once(config)), default=0),
        seconds=time.perf_counter() - start,
        host_peak=host,
        device_memory_bytes=int(config.plan.device_memory_gib * 2**30),
    )


def _as_on_gpus(config: JobConfig) -> JobConfig:
    """``config`` with mixed precision auto as bfloat16, as on the GPUs the dry run stands for."""
    if config.training.mixed_precision_param != "auto":
        return config
    logger.info("training.mixed_precision_param auto -> bfloat16, as on the GPUs the dry run stands for")
    return dataclasses.replace(config, training=dataclasses.replace(config.training, mixed_precision_param="bfloat16"))


def _gathered_at_once(config: JobConfig) -> int:
    """Buckets compiled SimpleFSDP holds gathered at once: the one in use and those prefetched (forward's
    or backward's limit, the larger; -1: all)."""
    limits = [config.parallelism.fsdp_forward_prefetch or 1, config.parallelism.fsdp_backward_prefetch or 1]
    return -1 if -1 in limits else 1 + max(limits)


def _windows(sizes: list[int], width: int) -> list[int]:
    """The sums of ``width`` neighbouring ``sizes`` (-1: all), shorter at the end."""
    width = len(sizes) if width == -1 else width
    return [sum(sizes[i : i + width]) for i in range(len(sizes))]


def in_child(fn, *args):
    """``fn(*args)`` in a forked child: a second fake world in this process would find torch's state stale."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read)
        try:
            result = ("ok", fn(*args))
        except ConfigError as e:
            result = ("error", str(e))
        except BaseException as e:  # noqa: BLE001 - reported by the parent
            result = ("crash", f"{type(e).__name__}: {e}")
        with os.fdopen(write, "wb") as f:
            pickle.dump(result, f)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    status, value = pickle.loads(data) if data else ("crash", "the dry run's process died")
    if status == "ok":
        return value
    raise ConfigError(value) if status == "error" else RuntimeError(value)


USAGE = "usage: python -m programs.dry_run (--world-size N | --nnodes N --nproc-per-node K|auto) [config options]"


def measured_ranks(config: JobConfig, world_size: int) -> list[int]:
    """Rank 0 and, under pipelining, the last stage's first rank (the output layer, logits and loss)."""
    pp = config.parallelism.pipeline_parallel_degree
    return [0] if pp == 1 else [0, (pp - 1) * (world_size // pp)]


def main(argv: list[str]) -> int:
    launch, argv = split_launch_options(argv)
    log_warnings_once()
    try:
        config = load_config(argv)
        if (sizes := launch_sizes(launch)) is None:
            print(USAGE, file=sys.stderr)
            return 2
        world_size = sizes[0]
        # The pre-launch check of the real run, at the simulated world size.
        # plan.device_memory_gib says what fits (a planner option otherwise, warned of as without effect).
        check(config, world_size, typed=frozenset(typed_options(argv)) - {"plan.device_memory_gib"})
        ranks = measured_ranks(config, world_size)
        if len(ranks) == 1:
            reports = [dry_run(config, world_size)]
        else:
            reports = [in_child(dry_run, config, world_size, rank) for rank in ranks]
    except ConfigError as e:
        print_error(named_as_given(e, argv))
        return 2
    print("\n".join(report.summary() for report in reports))
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C: the dry run ends, without a traceback
    sys.exit(main(sys.argv[1:]))
