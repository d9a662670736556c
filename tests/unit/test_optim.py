"""Tests for trainer.optim: optimizer builder, LR schedule and gradient clipping."""

from __future__ import annotations

import io
import logging
import math

import pytest
import torch
import torch.distributed as dist
from torch import nn

from config.manager import load_config
from tests.spawn import check_on_gloo_ranks
from trainer.optim import build_lr_scheduler, build_optimizer, build_optimizer_and_schedule, clip_grad_norm_

# ---------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------


def _tiny_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _step_once(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.ones(2, 4)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()


@pytest.mark.parametrize("implementation", ["foreach", "fused", "for-loop"])
def test_build_optimizer_matches_torch_adamw(implementation: str) -> None:
    model, reference = _tiny_model(), _tiny_model()
    optimizer = build_optimizer([model], lr=0.01, weight_decay=0.1, implementation=implementation)
    expected_optimizer = torch.optim.AdamW(
        reference.parameters(), lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1
    )
    assert optimizer.defaults["fused"] == (implementation == "fused")
    assert optimizer.defaults["foreach"] == (implementation == "foreach")
    for _ in range(3):
        _step_once(model, optimizer)
        _step_once(reference, expected_optimizer)
    for param, expected in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param, expected)


@pytest.mark.parametrize(
    "shape, cuts",
    [((64, 256), (21, 43)), ((2004, 256), (1002,)), ((256,), (128,)), ((256,), (64, 128, 192))],
)
def test_fused_adamw_on_row_shards_equals_the_whole_bitwise(shape: tuple[int, ...], cuts: tuple[int, ...]) -> None:
    """What lets a data-parallel layout match one process bitwise with the default (fused) kernel:
    stepping dim-0 shards gives the whole tensor's bits when each shard holds a multiple of the
    CPU's vector width (8 floats with AVX2, 16 with AVX-512), as whole rows of 256 do. The kernel
    computes a tensor's last elements past such a multiple on a scalar path, which may round
    differently, so shards of other sizes can differ in the last bit."""
    _assert_shards_step_like_the_whole(shape, cuts, "fused")


def test_foreach_adamw_on_any_shards_equals_the_whole_bitwise() -> None:
    """foreach rounds every element alike: the cut that the fused kernel steps differently (a
    305-element tensor at 101, found by search) gives the whole tensor's bits."""
    _assert_shards_step_like_the_whole((305,), (101,), "foreach")


def _assert_shards_step_like_the_whole(shape: tuple[int, ...], cuts: tuple[int, ...], implementation: str) -> None:
    torch.manual_seed(0)
    values, grads = torch.randn(shape), [torch.randn(shape) for _ in range(3)]
    bounds = [0, *cuts, shape[0]]
    whole = nn.Parameter(values.clone())
    shards = [nn.Parameter(values[a:b].clone()) for a, b in zip(bounds, bounds[1:])]
    whole_optimizer = build_optimizer([nn.ParameterList([whole])], lr=0.01, implementation=implementation)
    shard_optimizer = build_optimizer([nn.ParameterList(shards)], lr=0.01, implementation=implementation)
    for grad in grads:
        whole.grad = grad.clone()
        for shard, a, b in zip(shards, bounds, bounds[1:]):
            shard.grad = grad[a:b].clone()
        whole_optimizer.step()
        shard_optimizer.step()
    assert torch.equal(torch.cat([s.detach() for s in shards]), whole.detach())


def test_build_optimizer_collects_trainable_params_of_all_parts_once() -> None:
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight  # tied across parts
    second.bias.requires_grad_(False)
    optimizer = build_optimizer([first, second], name="Adam", lr=1e-3)
    assert isinstance(optimizer, torch.optim.Adam)
    params = optimizer.param_groups[0]["params"]
    assert [id(p) for p in params] == [id(first.weight), id(first.bias)]


def test_fused_falls_back_to_foreach_with_warning(caplog: pytest.LogCaptureFixture) -> None:
    model = nn.Linear(4, 4, device="meta")  # no fused kernel for the meta device
    with caplog.at_level(logging.WARNING, logger="trainer.optim"):
        optimizer = build_optimizer([model], lr=1e-3, implementation="fused")
    assert not optimizer.defaults["fused"]
    assert optimizer.defaults["foreach"]
    assert "using 'foreach' instead" in caplog.text


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        ({"lr": 0.0}, "optimizer.lr"),
        ({"betas": (0.9, 1.0)}, "optimizer.betas"),
        ({"eps": -1.0}, "optimizer.eps"),
        ({"weight_decay": -0.1}, "optimizer.weight_decay"),
    ],
)
def test_build_optimizer_rejects_bad_options(kwargs: dict, option: str) -> None:
    options = {"lr": 1e-3} | kwargs
    with pytest.raises(ValueError, match=option):
        build_optimizer([nn.Linear(2, 2)], **options)


def _updates_in_backward(microbatches: int) -> tuple[nn.Module, nn.Module, torch.Tensor, torch.Tensor]:
    """A model stepped in backward (early_step_in_backward) and one stepped after it, over two
    steps of ``microbatches`` each under a warmup schedule; and the last step's gradient norm as
    measured in backward and as clipping measures it."""
    model, reference = _tiny_model(), _tiny_model()
    early = build_optimizer([model], lr=0.01, weight_decay=0.1, early_step_in_backward=True)
    after = build_optimizer([reference], lr=0.01, weight_decay=0.1)
    schedules = [build_lr_scheduler(o, warmup_steps=2, total_steps=4) for o in (early, after)]
    for step in range(2):
        batches = [torch.full((2, 4), float(step + i + 1)) for i in range(microbatches)]
        for i, batch in enumerate(batches):
            early.stepping = i == microbatches - 1
            model(batch).square().sum().backward()
            reference(batch).square().sum().backward()
        assert all(p.grad is None for p in model.parameters())  # stepped and freed in backward
        norm = early.grad_norm()
        expected_norm = clip_grad_norm_(list(reference.parameters()), float("inf"))
        after.step()
        after.zero_grad()
        early.step()
        for schedule in schedules:
            schedule.step()
    return model, reference, norm, expected_norm


@pytest.mark.parametrize("microbatches", [1, 3])
def test_stepping_in_backward_equals_stepping_after_it_bitwise(microbatches: int) -> None:
    model, reference, norm, expected_norm = _updates_in_backward(microbatches)
    for got, expected in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(got, expected)
    assert norm.item() == pytest.approx(expected_norm.item(), rel=1e-6)


def test_stepping_in_backward_keeps_the_gradients_of_microbatches_before_the_last() -> None:
    model = _tiny_model()
    optimizer = build_optimizer([model], lr=0.01, early_step_in_backward=True)
    optimizer.stepping = False
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.ones(2, 4)).square().sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


# ---------------------------------------------------------------------------
# LR schedule
# ---------------------------------------------------------------------------


def _lr_trace(num_steps: int, **scheduler_kwargs) -> list[float]:
    """The lr each of the first ``num_steps`` optimizer steps uses, with peak lr 1."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_lr_scheduler(optimizer, **scheduler_kwargs)
    lrs = []
    for _ in range(num_steps):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return lrs


def test_linear_warmup_then_linear_decay() -> None:
    # warmup 4 -> 1/4, 2/4, 3/4, 1; the peak once more, then decay over 8 steps ending one step
    # past the run: 1 - k/8, the last step at 1/8 (it still learns with min_lr_factor 0).
    lrs = _lr_trace(12, warmup_steps=4, total_steps=12, decay_type="linear")
    expected = [0.25, 0.5, 0.75, 1.0, 1.0] + [1 - k / 8 for k in range(1, 8)]
    assert lrs == pytest.approx(expected, abs=1e-12)
    assert lrs[0] > 0
    assert lrs[-1] == pytest.approx(1 / 8)


# torchtitan v0.2.2's learning rates (build_lr_schedulers, peak 1), step by step, for
# (training.steps, warmup_steps, decay_ratio, decay_type, min_lr_factor, total_steps); the first
# is its debug_model.toml. Computed with torchtitan 0.2.2 installed.
TORCHTITAN_RATES = [
    ((10, 2, 0.8, "linear", 0.0, None), [0.5, 1.0, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125]),
    (
        (8, 2, None, "cosine", 0.1, None),
        [0.5, 1.0, 1.0, 0.9397114317029974, 0.775, 0.55, 0.3250000000000001, 0.16028856829700258],
    ),
    (
        (8, 0, None, "sqrt", 0.0, None),
        [1.0, 0.6464466094067263, 0.5, 0.38762756430420553, 0.2928932188134524, 0.20943058495790512]
        + [0.1339745962155614, 0.06458565330651467],
    ),
    ((8, 2, 0.5, "linear", 0.2, None), [0.5, 1.0, 1.0, 1.0, 1.0, 0.8, 0.6000000000000001, 0.4]),
    ((3, 3, None, "linear", 0.0, None), [1 / 3, 2 / 3, 1.0]),
    ((4, 1, 0.5, "linear", 0.0, 6), [1.0, 1.0, 1.0, 1.0]),
]


@pytest.mark.parametrize(("options", "expected"), TORCHTITAN_RATES)
def test_the_schedule_gives_torchtitans_rates_at_every_step(options, expected) -> None:
    """torchtitan's options mean torchtitan's rates: its decay ends one step past the run, so the
    decay starts a step later than it would to reach min_lr_factor at the last step. Equal to
    1e-15 (the same operations, which round alike)."""
    steps, warmup, ratio, shape, minimum, total = options
    lrs = _lr_trace(
        steps,
        warmup_steps=warmup,
        total_steps=steps if total is None else total,
        decay_ratio=ratio,
        decay_type=shape,
        min_lr_factor=minimum,
    )
    assert lrs == pytest.approx(expected, abs=1e-15, rel=0)


def test_warmup_starts_small_but_not_zero() -> None:
    lrs = _lr_trace(2, warmup_steps=1000, total_steps=2000)
    assert lrs == pytest.approx([1e-3, 2e-3])


def test_cosine_decay_reaches_min_lr_one_step_past_the_run() -> None:
    lrs = _lr_trace(11, warmup_steps=2, total_steps=10, decay_type="cosine", min_lr_factor=0.1)
    # decay over 8 steps from step 2 (0-based); step 4 is at progress 2/8, step 6 half way, step 9
    # (the last) at 7/8, and step 10, past the run, at the end.
    assert lrs[:3] == pytest.approx([0.5, 1.0, 1.0])
    assert lrs[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[6] == pytest.approx(0.1 + 0.9 * 0.5)
    assert lrs[9] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 7 / 8)))
    assert lrs[10] == pytest.approx(0.1)


def test_sqrt_decay() -> None:
    lrs = _lr_trace(10, warmup_steps=2, total_steps=10, decay_type="sqrt")
    assert lrs[3] == pytest.approx(1 - math.sqrt(1 / 8))
    assert lrs[4] == pytest.approx(1 - math.sqrt(2 / 8))
    assert lrs[9] == pytest.approx(1 - math.sqrt(7 / 8))


def test_wsd_warmup_stable_decay_with_decay_ratio() -> None:
    # 10 steps, decay_ratio 0.4 -> 4 decay steps after step 6 (0-based), the 4th one step past the
    # schedule; there torchtitan's linear shape would go on below the minimum, this one stays.
    lrs = _lr_trace(12, warmup_steps=2, total_steps=10, decay_type="linear", decay_ratio=0.4, min_lr_factor=0.2)
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    expected += [0.2 + 0.8 * (1 - k / 4) for k in range(1, 4)]
    expected += [0.2, 0.2]  # past total_steps the lr stays at the minimum
    assert lrs == pytest.approx(expected)


def test_no_warmup_and_no_decay() -> None:
    lrs = _lr_trace(3, warmup_steps=0, total_steps=3, decay_ratio=0.0)
    assert lrs == [1.0, 1.0, 1.0]


def test_a_run_shorter_than_its_schedule_cuts_warmup_and_decay_with_a_warning(caplog) -> None:
    """As torchtitan: a 4-step trial of a config with 10 warmup steps warms up over all 4 (the peak
    at the last step), and decay_ratio 0.8 with 2 of warmup in 5 steps decays over the last 3."""
    with caplog.at_level(logging.WARNING, logger="trainer.optim"):
        assert _lr_trace(4, warmup_steps=10, total_steps=4) == pytest.approx([0.25, 0.5, 0.75, 1.0])
        lrs = _lr_trace(5, warmup_steps=2, total_steps=5, decay_ratio=0.8, min_lr_factor=0.1)
    assert lrs == pytest.approx([0.5, 1.0, 1.0, 0.7, 0.4])
    assert "lr_scheduler.warmup_steps 10 exceeds training.steps 4: warming up over all 4 steps" in caplog.text
    assert "lr_scheduler.decay_ratio 0.8 gives 4 decay steps, more than the 3 after 2 of warmup" in caplog.text


def test_a_decay_ratio_that_rounds_to_no_decay_is_a_warning(caplog) -> None:
    """decay_ratio 0.1 of 4 steps is 0.4 of a step: no decay at all, which it left unsaid."""
    with caplog.at_level(logging.WARNING, logger="trainer.optim"):
        assert _lr_trace(4, warmup_steps=1, total_steps=4, decay_ratio=0.1, min_lr_factor=0.1) == [1.0] * 4
    assert caplog.messages == [
        "lr_scheduler.decay_ratio 0.1 of training.steps 4 rounds to 0 decay steps: the learning rate stays at its "
        "peak to the end"
    ]


def test_total_steps_lets_a_short_run_follow_a_long_runs_schedule(caplog) -> None:
    """torchtitan's lr_scheduler.total_steps: 4 steps of a 10-step schedule take its first 4 rates;
    unset, the schedule spans training.steps."""
    model = nn.Linear(2, 2)

    def rates(*overrides: str) -> list[float]:
        config = load_config(["--training.steps", "4", "--lr_scheduler.warmup_steps", "2", *overrides])
        optimizer, scheduler = build_optimizer_and_schedule(
            config.optimizer, config.lr_scheduler, config.training, [model]
        )
        trace = []
        for _ in range(4):
            trace.append(scheduler.get_last_lr()[0] / config.optimizer.lr)
            optimizer.step()
            scheduler.step()
        return trace

    assert rates("--lr_scheduler.total_steps", "10") == pytest.approx(
        _lr_trace(10, warmup_steps=2, total_steps=10, min_lr_factor=0.1)[:4]
    )
    assert rates() == pytest.approx(_lr_trace(4, warmup_steps=2, total_steps=4, min_lr_factor=0.1))
    with caplog.at_level(logging.WARNING, logger="trainer.optim"):
        rates("--lr_scheduler.total_steps", "1")
    assert "lr_scheduler.warmup_steps 2 exceeds lr_scheduler.total_steps 1" in caplog.text


def test_scheduler_state_dict_round_trip() -> None:
    def make(warmup_steps: int, total_steps: int, decay_type: str):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
        scheduler = build_lr_scheduler(
            optimizer, warmup_steps=warmup_steps, total_steps=total_steps, decay_type=decay_type
        )
        return optimizer, scheduler

    optimizer, scheduler = make(3, 20, "cosine")
    for _ in range(5):
        optimizer.step()
        scheduler.step()
    buffer = io.BytesIO()
    torch.save(scheduler.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)  # only plain Python values inside

    # A scheduler built with a different config must resume the saved schedule.
    resumed_optimizer, resumed = make(1, 7, "linear")
    resumed.load_state_dict(state)
    for _ in range(10):
        optimizer.step()
        scheduler.step()
        resumed_optimizer.step()
        resumed.step()
        assert resumed_optimizer.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert resumed.state_dict() == scheduler.state_dict()


@pytest.mark.parametrize(
    ("kwargs", "option"),
    [
        (
            {"total_steps": 0, "warmup_steps": 0, "total_steps_option": "lr_scheduler.total_steps"},
            "lr_scheduler.total_steps",
        ),
        ({"total_steps": 0, "warmup_steps": 0}, "training.steps"),
        ({"min_lr_factor": 1.5}, "lr_scheduler.min_lr_factor"),
    ],
)
def test_lr_scheduler_rejects_bad_options(kwargs: dict, option: str) -> None:
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    options = {"warmup_steps": 2, "total_steps": 10} | kwargs
    with pytest.raises(ValueError, match=option):
        build_lr_scheduler(optimizer, **options)


# ---------------------------------------------------------------------------
# Gradient clipping, single process
# ---------------------------------------------------------------------------


def _params_with_grads(shapes: list[tuple[int, ...]], seed: int = 0) -> list[nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        param = nn.Parameter(torch.zeros(shape))
        param.grad = torch.randn(shape, generator=generator) * 3
        params.append(param)
    return params


@pytest.mark.parametrize("max_norm", [1.0, 1e6])
def test_clip_plain_tensors_matches_torch(max_norm: float) -> None:
    shapes = [(5, 3), (7,), (2, 2, 2)]
    params, expected_params = _params_with_grads(shapes), _params_with_grads(shapes)
    norm = clip_grad_norm_(params, max_norm)
    expected_norm = torch.nn.utils.clip_grad_norm_(expected_params, max_norm)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    for param, expected in zip(params, expected_params):
        torch.testing.assert_close(param.grad, expected.grad, rtol=1e-6, atol=0)
    assert norm.shape == () and norm.dtype == torch.float32


def test_clip_ignores_params_without_grad() -> None:
    (param,) = _params_with_grads([(4,)])
    expected = torch.linalg.vector_norm(param.grad)
    assert clip_grad_norm_([param, nn.Parameter(torch.ones(3))], 1e6) == pytest.approx(expected.item())
    assert clip_grad_norm_([], 1.0) == 0.0


@pytest.mark.parametrize("bad_value", [math.inf, math.nan])
def test_clip_non_finite_norm_is_returned(bad_value: float) -> None:
    params = _params_with_grads([(3,), (2,)])
    params[1].grad[0] = bad_value
    norm = clip_grad_norm_(params, 1.0)
    assert not torch.isfinite(norm)
    assert math.isnan(norm.item()) == math.isnan(bad_value)


# ---------------------------------------------------------------------------
# Gradient clipping and optimizer with DTensors, 2 gloo processes
# ---------------------------------------------------------------------------

_WORLD_SIZE = 2
_TIMEOUT_S = 120.0


def _full_grads(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    # Same seed on every rank: each rank knows the full tensors to compare with.
    generator = torch.Generator().manual_seed(1234)
    return [torch.randn(shape, generator=generator) for shape in shapes]


def _check_mixed_mesh_clipping() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh_1d = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    mesh_1x2 = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    mesh_2x1 = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
    layouts = [
        ((5, 3), mesh_1d, [Shard(0)]),  # uneven: 3 + 2 rows
        ((4, 6), mesh_1x2, [Replicate(), Shard(1)]),
        ((6, 2), mesh_2x1, [Shard(0), Shard(1)]),
        ((3,), mesh_1d, [Replicate()]),
        ((2, 2), mesh_1x2, [Replicate(), Replicate()]),
        ((4,), None, None),  # plain tensor, identical on both ranks
    ]
    for max_norm in (0.5, 1e6):
        full_grads = _full_grads([shape for shape, _, _ in layouts])
        params, reference_params = [], []
        for grad, (_, mesh, placements) in zip(full_grads, layouts):
            param = nn.Parameter(torch.zeros_like(grad))
            if mesh is None:
                param.grad = grad.clone()
            else:
                param = nn.Parameter(distribute_tensor(param.detach(), mesh, placements))
                param.grad = distribute_tensor(grad.clone(), mesh, placements)
            params.append(param)
            reference = nn.Parameter(torch.zeros_like(grad))
            reference.grad = grad.clone()
            reference_params.append(reference)

        norm = clip_grad_norm_(params, max_norm)
        expected_norm = torch.nn.utils.clip_grad_norm_(reference_params, max_norm)
        assert type(norm) is torch.Tensor, type(norm)
        torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
        for param, reference in zip(params, reference_params):
            grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
            torch.testing.assert_close(grad, reference.grad, rtol=1e-6, atol=1e-7)


def _check_pipeline_clipping(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    world_mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    pp_mesh, dp_mesh = world_mesh["pp"], world_mesh["dp"]
    # Stage 0 owns grads 0-1, stage 1 grads 2-4; one grad per stage is a DTensor.
    shapes = [(3, 4), (5,), (2, 2), (6, 1), (7,)]
    owner = [0, 0, 1, 1, 1]
    full_grads = _full_grads(shapes)
    reference_params = []
    for grad in full_grads:
        reference = nn.Parameter(torch.zeros_like(grad))
        reference.grad = grad.clone()
        reference_params.append(reference)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference_params, 1.0)

    own = [i for i in range(len(shapes)) if owner[i] == rank]
    params = []
    for position, index in enumerate(own):
        grad = full_grads[index].clone()
        param = nn.Parameter(torch.zeros_like(grad))
        if position == 0:
            param = nn.Parameter(distribute_tensor(param.detach(), dp_mesh, [Shard(0)]))
            grad = distribute_tensor(grad, dp_mesh, [Shard(0)])
        param.grad = grad
        params.append(param)

    norm = clip_grad_norm_(params, 1.0, pp_mesh=pp_mesh)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=0)
    stage_norm = torch.linalg.vector_norm(torch.cat([full_grads[i].flatten() for i in own]))
    assert norm > stage_norm * (1 + 1e-3)  # the other stage really counted
    for param, index in zip(params, own):
        grad = param.grad.full_tensor() if hasattr(param.grad, "full_tensor") else param.grad
        torch.testing.assert_close(grad, reference_params[index].grad, rtol=1e-6, atol=1e-7)


def _check_optimizer_on_dtensors() -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    for implementation in ("foreach", "fused", "for-loop"):
        torch.manual_seed(0)
        reference = nn.Linear(5, 3)
        model = nn.Linear(5, 3)
        model.load_state_dict(reference.state_dict())

        def shard_params(name, module, device_mesh):
            for param_name, param in list(module.named_parameters(recurse=False)):
                sharded = nn.Parameter(distribute_tensor(param.detach(), device_mesh, [Shard(0)]))
                module.register_parameter(param_name, sharded)

        distribute_module(model, mesh, shard_params)
        optimizer = build_optimizer([model], lr=0.1, implementation=implementation)
        reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.1, betas=(0.9, 0.95), weight_decay=0.1)
        for _ in range(2):
            for module, opt in ((model, optimizer), (reference, reference_optimizer)):
                for param in module.parameters():
                    full_grad = torch.ones(param.shape) * 0.5
                    if hasattr(param, "device_mesh"):
                        full_grad = distribute_tensor(full_grad, mesh, [Shard(0)])
                    param.grad = full_grad
                opt.step()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.full_tensor(), expected.detach())


def _check_gradient_norm_in_backward() -> None:
    """FSDP2's sharded gradients stepped in backward: the norm logged is clipping's, and it costs
    one all-reduce a step, not one a parameter."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    models = []
    for _ in range(2):
        model = _tiny_model()
        for layer in model:
            fully_shard(layer, mesh=mesh)
        models.append(fully_shard(model, mesh=mesh))
    early = build_optimizer([models[0]], lr=0.01, early_step_in_backward=True)
    batch = torch.full((2, 4), 1.0 + dist.get_rank())
    with CommDebugMode() as backward_comms:
        models[0](batch).square().sum().backward()
    with CommDebugMode() as norm_comms:
        norm = early.grad_norm()
    models[1](batch).square().sum().backward()
    expected = clip_grad_norm_(list(models[1].parameters()), float("inf"))
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    all_reduce = torch.ops.c10d_functional.all_reduce
    assert backward_comms.get_comm_counts()[all_reduce] == 0, backward_comms.get_comm_counts()
    assert norm_comms.get_comm_counts()[all_reduce] == 1, norm_comms.get_comm_counts()


def _distributed_checks(rank: int) -> None:
    _check_mixed_mesh_clipping()
    _check_pipeline_clipping(rank)
    _check_optimizer_on_dtensors()
    _check_gradient_norm_in_backward()


@pytest.mark.slow  # spawns gloo ranks
def test_distributed_clipping_and_optimizers_on_dtensors() -> None:
    check_on_gloo_ranks(_distributed_checks, _WORLD_SIZE, timeout_s=_TIMEOUT_S)
