"""Optimizer, learning-rate schedule and gradient clipping.

Everything here works with plain tensors and with DTensor parameters/gradients
(FSDP2, SimpleFSDP and tensor parallelism all produce DTensors), so the trainer
does not need to know how a model was parallelized.
"""

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

from config.job_config import LRScheduler, Optimizer, Training, user_input

logger = logging.getLogger(__name__)

_OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "Adam": torch.optim.Adam,
    "AdamW": torch.optim.AdamW,
}


def _trainable_parameters(model_parts: list[nn.Module]) -> list[nn.Parameter]:
    """Parameters requiring grad over all parts, each once (parts may share tied weights)."""
    seen: set[int] = set()
    params = []
    for part in model_parts:
        for param in part.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
    return params


def _supports_fused(params: list[nn.Parameter]) -> bool:
    # Same rule torch applies at the first step(); checking up front lets us fall
    # back before training starts instead of failing mid-run. For DTensors,
    # `.device` is the device of the local shard, which is what the kernel sees.
    supported_devices = _get_fused_kernels_supported_devices()
    return all(p.device.type in supported_devices and torch.is_floating_point(p) for p in params)


class OptimizerInBackward(torch.optim.Optimizer):
    """Steps each parameter as soon as backward has finished its gradient, and frees that gradient:
    the whole model's gradients are never held at once. One optimizer per parameter updates it;
    this one holds the shared settings (the LR schedule sets its ``lr``), and its ``step()`` does
    nothing. Nothing is clipped (the gradient norm is known only after every parameter has
    stepped), but the norm is measured on the way, for the log. ``stepping`` False lets gradients
    accumulate (microbatches before a step's last)."""

    def __init__(self, params: list[nn.Parameter], optimizer_class: type[torch.optim.Optimizer], **settings):
        super().__init__(params, settings)
        self.per_parameter = {p: optimizer_class([p], **settings) for p in params}
        self.stepping = True
        # This rank's part of the squared gradient norm, by the mesh and placements its reduction
        # takes (DTensor gradients) or None (plain ones).
        self._squares: dict[tuple | None, torch.Tensor] = {}
        for param in params:
            param.register_post_accumulate_grad_hook(self._step_parameter)
        for optimizer in self.per_parameter.values():
            # The LR schedule sets this optimizer's settings (lr, initial_lr): each per-parameter
            # one saved carries them, and a loaded one brings them back, so that a checkpoint holds
            # what one optimizer's would.
            optimizer.register_state_dict_pre_hook(self._lend_settings)
            optimizer.register_load_state_dict_post_hook(self._take_settings)

    def _lend_settings(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.param_groups[0].update(_settings(self.param_groups[0]))

    def _take_settings(self, optimizer: torch.optim.Optimizer) -> None:
        self.param_groups[0].update(_settings(optimizer.param_groups[0]))

    def _step_parameter(self, param: nn.Parameter) -> None:
        if not self.stepping:
            return
        # One tensor's norm: a DTensor's stays partial here (get_total_norm's stack of norms would
        # all-reduce for every parameter).
        norm = torch.linalg.vector_norm(param.grad)
        key = (norm.device_mesh, norm.placements) if isinstance(norm, DTensor) else None
        local = norm.to_local() if isinstance(norm, DTensor) else norm
        self._squares[key] = self._squares.get(key, 0.0) + local.float() ** 2
        optimizer = self.per_parameter[param]
        self._lend_settings(optimizer)
        optimizer.step()
        param.grad = None

    def step(self, closure=None) -> None:
        """Nothing left to do: every parameter stepped in backward."""

    def grad_norm(self) -> torch.Tensor:
        """The global 2-norm of the gradients stepped since the last call (every rank calls it)."""
        norms = []
        for key, squares in self._squares.items():
            norm = squares.sqrt()
            if key is not None:  # reduced over the mesh as torch's norm of a DTensor would be
                norm = DTensor.from_local(norm, key[0], key[1], run_check=False).full_tensor()
            norms.append(norm)
        self._squares.clear()
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _settings(param_group: dict) -> dict:
    return {key: value for key, value in param_group.items() if key != "params"}


def optimizers_holding_state(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """The optimizers whose state a checkpoint saves: those of each parameter when they step in
    backward (their state under the parameters' names is the same as one optimizer's)."""
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
    """One optimizer over the trainable parameters of all model parts (e.g. this rank's pipeline
    stages; DTensors welcome), or with ``early_step_in_backward`` an ``OptimizerInBackward``.
    ``fused`` falls back to ``foreach`` with a warning where the parameters' device or dtype has no
    fused kernel. ValueError names a bad ``optimizer.*`` value."""
    if not lr > 0:
        raise ValueError(f"optimizer.lr must be > 0, got {lr}")
    if not all(0.0 <= beta < 1.0 for beta in betas) or len(betas) != 2:
        raise ValueError(f"optimizer.betas must be two values in [0, 1), got {betas}")
    if not eps > 0:
        raise ValueError(f"optimizer.eps must be > 0, got {eps}")
    if not weight_decay >= 0:
        raise ValueError(f"optimizer.weight_decay must be >= 0, got {weight_decay}")

    params = _trainable_parameters(model_parts)
    if not params:
        raise ValueError("build_optimizer: the model parts have no parameters that require grad")

    use_fused = implementation == "fused"
    if use_fused and not _supports_fused(params):
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
    """LR multiplier for step ``s`` (0-based count of optimizer steps already taken), as
    torchtitan's schedule gives it.

    * warmup, ``s < warmup_steps``: ``(s + 1) / warmup_steps``, so the first step
      uses ``peak / warmup_steps`` (never 0) and step ``warmup_steps - 1`` the peak;
    * stable: 1 up to and including ``decay_start = total_steps - decay_steps``;
    * decay, ``decay_start < s``: ``min + (1 - min) * shape(p)`` with progress
      ``p = (s - decay_start) / decay_steps``. The decay ends one step past the run:
      the last step (``s = total_steps - 1``) is at ``p = (decay_steps - 1) / decay_steps``,
      so it still learns with ``min_lr_factor`` 0; later steps (a schedule shorter than
      the run) stay at ``min_lr_factor * peak``.

    A callable object rather than a closure because ``LambdaLR.state_dict`` saves
    the ``__dict__`` of callable objects, so the schedule round-trips through a
    checkpoint.
    """

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
    """Linear warmup from ``peak / warmup_steps``, an optional stable phase, then a linear, cosine
    or sqrt (``1 - sqrt(progress)``) decay towards ``min_lr_factor * peak``, which the step after
    the last would reach (torchtitan's schedule, step for step); the optimizer's ``lr`` is the
    peak. ``decay_ratio``: the fraction of ``total_steps`` spent decaying (WSD); None decays over
    all steps after warmup. Step it once after each ``optimizer.step()``.
    ``total_steps_option`` is the option that gave ``total_steps``, for messages.
    A run shorter than its warmup and decay (a short trial of a long job's config) gets them cut to
    fit, with a warning, as torchtitan does. ValueError names a bad ``lr_scheduler.*`` value."""
    if total_steps < 1:
        raise ValueError(f"{total_steps_option} must be >= 1, got {total_steps}")
    if warmup_steps < 0:
        raise ValueError(f"lr_scheduler.warmup_steps must be >= 0, got {warmup_steps}")
    if warmup_steps > total_steps:
        logger.warning(
            "lr_scheduler.warmup_steps %d exceeds %s %d: warming up over all %d steps",
            warmup_steps,
            total_steps_option,
            total_steps,
            total_steps,
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
    """build_lr_scheduler's decay steps: ``decay_ratio`` of ``total_steps``, those after warmup when
    it is None, and at most those."""
    if decay_ratio is None:
        return total_steps - warmup_steps
    if not 0.0 <= decay_ratio <= 1.0:
        raise ValueError(f"lr_scheduler.decay_ratio must be in [0, 1] or None, got {decay_ratio}")
    decay_steps = round(decay_ratio * total_steps)
    if decay_ratio > 0 and decay_steps == 0:
        logger.warning(
            "lr_scheduler.decay_ratio %g of %s %d rounds to 0 decay steps: the learning rate stays at "
            "its peak to the end",
            decay_ratio,
            total_steps_option,
            total_steps,
        )
    if warmup_steps + decay_steps > total_steps:
        logger.warning(
            "lr_scheduler.decay_ratio %g gives %d decay steps, more than the %d after %d of warmup: "
            "decaying over those",
            decay_ratio,
            decay_steps,
            total_steps - warmup_steps,
            warmup_steps,
        )
        decay_steps = total_steps - warmup_steps
    return decay_steps


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clips the gradients in place by their global ``norm_type``-norm and returns that norm as a
    float32 scalar (a non-finite norm is returned, not raised: checking would sync every step).

    Gradients may be plain tensors or DTensors on any mix of meshes: torch's helpers stack all
    gradients in one DTensor op, which fails across meshes, so each mesh's gradients get their own
    norm, reduced over that mesh, and the norms are combined. With ``pp_mesh`` (this rank holds
    only some pipeline stages) the stages' norms are combined too; every rank of it must call."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm_type = float(norm_type)

    params_by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for p in params:
        mesh = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
        params_by_mesh.setdefault(mesh, []).append(p)

    group_norms = []
    for group in params_by_mesh.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type)
        # full_tensor() performs the reduction over this mesh for sharded grads.
        if isinstance(norm, DTensor):
            norm = norm.full_tensor()
        group_norms.append(norm.float())

    if group_norms:
        device = group_norms[0].device
        total_norm = torch.linalg.vector_norm(torch.stack([norm.to(device) for norm in group_norms]), norm_type)
    else:
        # A stage without gradients still has to join the pp all-reduce below.
        device = torch.device(pp_mesh.device_type) if pp_mesh is not None else torch.device("cpu")
        total_norm = torch.zeros((), dtype=torch.float32, device=device)

    if pp_mesh is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        else:
            total_norm = total_norm**norm_type
            dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=pp_mesh.get_group())
            total_norm = total_norm ** (1.0 / norm_type)

    # Scaling is pointwise, but DTensor still rejects one op spanning two meshes.
    for group in params_by_mesh.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm)
    return total_norm


def build_optimizer_and_schedule(
    optim: Optimizer, schedule: LRScheduler, training: Training, model_parts: list[nn.Module]
) -> tuple[torch.optim.Optimizer, LambdaLR]:
    """The configured optimizer over the parts' parameters and its LR schedule (``training`` gives
    max_norm and steps); a one-line ConfigError naming the option for a bad value."""
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
