"""Optimizer, learning-rate schedule and gradient clipping, for plain tensors and DTensors alike."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from config.errors import user_input
from config.job_config import LRScheduler, Optimizer, Training

logger = logging.getLogger(__name__)

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps and frees each parameter's gradient as soon as backward completes it; nothing is clipped (the
    norm is known only once all have stepped). ``stepping`` False lets gradients accumulate."""

    def __init__(self, params: list[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], **settings):
        super().__init__(params, settings)
        self.per_parameter = {p: optimizer_class([p], **settings) for p in params}
        self.stepping = True
        # This rank's part of the squared norm, by the (mesh, placements) reducing it; None: plain tensors.
        self._squares: dict[tuple | None, torch.Tensor] = {}
        for param in params:
            param.register_post_accumulate_grad_hook(self._step_parameter)
        for optimizer in self.per_parameter.values():
            # Each saved one carries the schedule's settings: a checkpoint holds what one optimizer's would.
            optimizer.register_state_dict_pre_hook(self._lend_settings)
            optimizer.register_load_state_dict_post_hook(self._take_settings)

    def _lend_settings(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.param_groups[0].update(_settings(self.param_groups[0]))

    def _take_settings(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups[0].update(_settings(optimizer.param_groups[0]))

    def _step_parameter(self, param: nn.Parameter) -> None:
        if not self.stepping:
            return
        # A DTensor's norm stays partial here: get_total_norm would all-reduce for every parameter.
        norm = torch.linalg.vector_norm(param.grad)
        key = (norm.device_mesh, norm.placements) if isinstance(norm, DTensor) else None
        local = norm.to_local() if isinstance(norm, DTensor) else norm
        self._squares[key] = self._squares.get(key, 0.0) + local.float() ** 2
        optimizer = self.per_parameter[param]
        self._lend_settings(optimizer)
        optimizer.step()
        param.grad = None

    def step(self, closure=None) -> None:
        """Nothing left: every parameter stepped in backward."""

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients stepped since the last call (every rank calls it)."""
        norms = []
        for key, squares in self._squares.items():
            norm = squares.sqrt()
            if key is not None:  # reduced over the mesh as torch's norm of a DTensor would be
                # Offloaded gradients' norms are in host memory: reduced on the mesh's device.
                norm = DTensor.from_local(norm.to(key[0].device_type), key[0], key[1], run_check=False).full_tensor()
            norms.append(norm)
        self._squares.clear()
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _settings(param_group: dict) -> dict:
    return {key: value for key, value in param_group.items() if key != "params"}


def optimizers_holding_state(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers a checkpoint saves: each parameter's when they step in backward."""
    if isinstance(optimizer, OptimizerInBackward):
        return list(optimizer.per_parameter.values())
    return [optimizer]


def build_optimizer(
    model_parts: list[nn.Module],
    *,
    name: str = "AdamW",
    lr: float,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
    weight_decay: float = 0.1,
    implementation: str = "fused",
    early_step_in_backward: bool = False,
) -> torch.optim.Optimizer:
    """One optimizer over the parts' parameters; ``fused`` falls back to ``foreach`` where torch has no kernel."""
    if not lr > 0:
        raise ValueError(f"optimizer.lr must be > 0, got {lr}")
    if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
        raise ValueError(f"optimizer.betas must be two values in [0, 1), got {betas}")
    if not eps > 0:
        raise ValueError(f"optimizer.eps must be > 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"optimizer.weight_decay must be >= 0, got {weight_decay}")

    # Each once: parts may share tied weights.
    params = list({id(p): p for part in model_parts for p in part.parameters() if p.requires_grad}.values())
    # torch's rule at the first step(), checked before training (a DTensor's device is its shard's).
    fused_devices = _get_fused_kernels_supported_devices()
    use_fused = implementation == "fused"
    if use_fused and not all(p.device.type in fused_devices and torch.is_floating_point(p) for p in params):
        logger.warning(
            "optimizer.implementation='fused' is not supported for these parameters "
            "(devices %s, dtypes %s); using 'foreach' instead",
            sorted({p.device.type for p in params}),
            sorted({str(p.dtype) for p in params}),
        )
        use_fused = False
    use_foreach = implementation != "for-loop" and not use_fused

    settings = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=use_foreach, fused=use_fused)
    if early_step_in_backward:
        optimizer = OptimizerInBackward(params, _OPTIMIZERS[name], **settings)
    else:
        optimizer = _OPTIMIZERS[name](params, **settings)
    kernel = "fused" if use_fused else "foreach" if use_foreach else "for-loop"
    when = ", each parameter stepped in backward" if early_step_in_backward else ""
    described = f"lr={lr:g}, betas={betas}, eps={eps:g}, weight_decay={weight_decay:g}{when}"
    logger.info("Built %s (%s) over %d parameter tensors, %s", name, kernel, len(params), described)
    return optimizer


class WarmupStableDecay:
    """torchtitan's LR multiplier after ``step`` optimizer steps; the decay ends one step past the run
    (its last step still learns). An object, not a closure: ``LambdaLR.state_dict`` saves its ``__dict__``."""

    def __init__(self, warmup_steps: int, decay_start: int, decay_steps: int, decay_type: str, min_lr_factor: float):
        self.warmup_steps = warmup_steps
        self.decay_start = decay_start
        self.decay_steps = decay_steps
        self.decay_type = decay_type
        self.min_lr_factor = min_lr_factor

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if step <= self.decay_start or self.decay_steps == 0:
            return 1.0
        # Past the schedule's end torchtitan's linear shape would turn the rate negative: hold it.
        progress = min((step - self.decay_start) / self.decay_steps, 1.0)
        if self.decay_type == "linear":
            remaining = 1.0 - progress
        elif self.decay_type == "cosine":
            remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:  # "sqrt"
            remaining = 1.0 - math.sqrt(progress)
        return self.min_lr_factor + (1.0 - self.min_lr_factor) * remaining


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    *,
    warmup_steps: int,
    total_steps: int,
    total_steps_option: str = "training.steps",
    decay_type: str = "linear",
    decay_ratio: float | None = None,
    min_lr_factor: float = 0.0,
) -> LambdaLR:
    """torchtitan's warmup, stable and decay phases towards ``min_lr_factor`` x ``lr``; cut to fit a short run."""
    if total_steps < 1:
        raise ValueError(f"{total_steps_option} must be >= 1, got {total_steps}")
    if warmup_steps > total_steps:
        logger.warning(
            f"lr_scheduler.warmup_steps {warmup_steps} exceeds {total_steps_option} {total_steps}: warming up over "
            f"all {total_steps} steps"
        )
        warmup_steps = total_steps
    if not 0.0 <= min_lr_factor <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_factor must be in [0, 1], got {min_lr_factor}")

    decay_steps = _decay_steps(decay_ratio, warmup_steps, total_steps, total_steps_option)
    stable_steps = total_steps - warmup_steps - decay_steps
    phases = f"{warmup_steps} warmup, {stable_steps} stable, {decay_steps} {decay_type} decay steps"
    logger.info("LR schedule: %s to %g x peak", phases, min_lr_factor)
    schedule = WarmupStableDecay(warmup_steps, total_steps - decay_steps, decay_steps, decay_type, min_lr_factor)
    return LambdaLR(optimizer, lr_lambda=schedule)


def _decay_steps(decay_ratio: float | None, warmup_steps: int, total_steps: int, total_steps_option: str) -> int:
    """``decay_ratio`` of ``total_steps``; at most (and for None) those after warmup."""
    if decay_ratio is None:
        return total_steps - warmup_steps
    decay_steps = round(decay_ratio * total_steps)
    if decay_ratio > 0 and decay_steps == 0:
        logger.warning(
            f"lr_scheduler.decay_ratio {decay_ratio:g} of {total_steps_option} {total_steps} rounds to 0 decay steps: "
            "the learning rate stays at its peak to the end"
        )
    if warmup_steps + decay_steps > total_steps:
        logger.warning(
            f"lr_scheduler.decay_ratio {decay_ratio:g} gives {decay_steps} decay steps, more than the "
            f"{total_steps - warmup_steps} after {warmup_steps} of warmup: decaying over those"
        )
        decay_steps = total_steps - warmup_steps
    return decay_steps


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, *, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    """Clips the gradients by their global 2-norm, returned (not raised when not finite: that would sync).
    Each mesh's gradients get their own norm, then combined, over ``pp_mesh``'s stages too."""
    params = [p for p in parameters if p.grad is not None]
    params_by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for p in params:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        params_by_mesh.setdefault(mesh, []).append(p)

    group_norms = []
    for group in params_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group])
        # full_tensor() performs the reduction over this mesh for sharded grads.
        if isinstance(norm, DTensor):
            mesh = norm.device_mesh  # offloaded gradients' norms are in host memory: reduced on the mesh's device
            norm = DTensor.from_local(norm.to_local().to(mesh.device_type), mesh, norm.placements).full_tensor()
        group_norms.append(norm.float())

    if group_norms:
        device = group_norms[0].device
        total_norm = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in group_norms]))
    else:
        # A stage without gradients still has to join the pp all-reduce below.
        device = torch.device(pp_mesh.device_type) if pp_mesh is not None else torch.device("cpu")
        total_norm = torch.zeros((), dtype=torch.float32, device=device)

    if pp_mesh is not None:
        total_norm = total_norm**2.0
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
        total_norm = total_norm**0.5

    # Scaling is pointwise, but DTensor still rejects one op spanning two meshes.
    for group in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def build_optimizer_and_schedule(
    optim: Optimizer, schedule: LRScheduler, training: Training, model_parts: list[nn.Module]
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The configured optimizer and LR schedule; a one-line ConfigError naming a bad option."""
    if optim.early_step_in_backward and training.max_norm > 0:
        logger.warning(
            "optimizer.early_step_in_backward: gradients are not clipped (training.max_norm %g does not apply); "
            "their norm is logged",
            training.max_norm,
        )
    with user_input():
        optimizer = build_optimizer(
            model_parts,
            name=optim.name,
            lr=optim.lr,
            betas=(optim.beta1, optim.beta2),
            eps=optim.eps,
            weight_decay=optim.weight_decay,
            implementation=optim.implementation,
            early_step_in_backward=optim.early_step_in_backward,
        )
        lr_scheduler = build_lr_scheduler(
            optimizer,
            warmup_steps=schedule.warmup_steps,
            total_steps=training.steps if schedule.total_steps is None else schedule.total_steps,
            total_steps_option="training.steps" if schedule.total_steps is None else "lr_scheduler.total_steps",
            decay_type=schedule.decay_type,
            decay_ratio=schedule.decay_ratio,
            min_lr_factor=schedule.min_lr_factor,
        )
    return optimizer, lr_scheduler
