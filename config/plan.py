"""The layout planner's section of the job config (``python -m programs.plan``)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Plan:
    devices: int = 8
    """Devices (GPUs) the layout planner (python -m programs.plan) lays the run out on."""
    device_memory_gib: float = 80.0
    """Memory per device, GiB: a layout fits when its estimated per-rank peak is at most this."""
    host_memory_gib: float = 2048.0
    """Host memory per node, GiB: a layout with CPU offload (tried when nothing fits without) fits when its
    devices' weights, gradients and Adam moments together are at most this."""
    host_link_gbps: float = 25.0
    """Host-device bandwidth of one device, GB/s (PCIe): CPU offload's copies in the planner's time model."""
    peak_tflops: float = 989.0
    """Dense bf16 peak of one device, TFLOP/s (989 for an H100 SXM)."""
    mfu: float = 0.4
    """Fraction of the peak the matmuls reach (model FLOPs utilization) in the planner's time model."""
    intra_node_gbps: float = 450.0
    """Bandwidth of one device's links inside a node, GB/s (NVLink)."""
    inter_node_gbps: float = 50.0
    """Bandwidth of one device's links between nodes, GB/s (e.g. one 400 Gb/s NIC per device)."""
    link_latency_us: float = 10.0
    """Latency of one hop of a ring collective or one send, microseconds (the alpha of alpha-beta)."""
    calibration_file: str = ""
    """A calibration file written by python -m programs.calibrate on the machine the plan is for: the time model
    takes its compute and link rates from it instead of peak_tflops, mfu, the *_gbps and link_latency_us."""
    devices_per_node: int = 8
    """Devices in a node: mesh dimensions within a node use intra_node_gbps, the others inter_node_gbps."""
    activation_checkpoint_modes: list[str] = field(default_factory=lambda: ["none", "selective", "full"])
    """Activation checkpointing modes the planner tries (none, selective, full)."""
    max_measured: int = 8
    """Layouts the planner estimates the memory of at most (two dry runs each), the fastest first."""
    top: int = 5
    """Layouts the planner prints, the fastest first."""
    output: str = "plan.toml"
    """Where the planner writes the best layout as a config file for run_train.sh."""
