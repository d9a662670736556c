"""Benchmark: causal attention on a CPU, all queries at once against queries in chunks.

    python bench/cpu_attention.py [--shapes 256x16,512x16,1024x16,512x64,512x128] [--chunks 64,128,256]
                                  [--dtypes float32] [--rounds 6]

Times the forward and backward of the model's ``causal_attention`` (models/llama3/model.py) on one
thread, batch 4 and 16 heads, for each ``SEQxHEAD_DIM`` shape and dtype: without chunks (torch's
flash attention with ``is_causal``) and with each chunk size (``parallelisms.device.causal_query_chunk``
picks one). The variants run in turn within each round, so the machine's drift hits them alike.
Prints the median milliseconds and the ratio to no chunks (median of the per-round ratios, with
their range) and writes ``bench/results/cpu_attention.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402

from bench.dp_compare import machine_info  # noqa: E402
from models.llama3.model import causal_attention  # noqa: E402

BATCH, HEADS = 4, 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256x16,512x16,1024x16,2048x16,512x64,512x128")
    parser.add_argument("--chunks", default="64,128,256")
    parser.add_argument("--dtypes", default="float32")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "cpu_attention.json"))
    return parser.parse_args(argv)


def forward_backward_seconds(q, k, v, grad, chunk: int | None) -> float:
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    causal_attention(q, k, v, chunk).backward(grad)
    return time.perf_counter() - start


def measure(seq: int, head_dim: int, dtype: torch.dtype, chunks: list[int], rounds: int) -> dict[str, list[float]]:
    """Seconds per round of each variant ("none", or the chunk size) at one shape."""
    q, k, v, grad = (torch.randn(BATCH, seq, HEADS, head_dim, dtype=dtype).transpose(1, 2) for _ in range(4))
    variants: list[int | None] = [None, *[c for c in chunks if c < seq]]
    times: dict[str, list[float]] = {str(c) if c else "none": [] for c in variants}
    forward_backward_seconds(q, k, v, grad, None)  # first call: the kernel's one-time set-up
    for _ in range(rounds):
        for chunk in variants:
            times[str(chunk) if chunk else "none"].append(forward_backward_seconds(q, k, v, grad, chunk))
    return times


def format_table(results: list[dict]) -> str:
    header = f"{'dtype':<9} {'seq':>5} {'head_dim':>8} {'chunk':>6} {'ms':>8} {'x none [min-max]':>18}"
    lines = [header, "-" * len(header)]
    for r in results:
        base = r["seconds"]["none"]
        for chunk, seconds in r["seconds"].items():
            ratios = [a / b for a, b in zip(seconds, base)]
            lines.append(
                f"{r['dtype']:<9} {r['seq']:>5} {r['head_dim']:>8} {chunk:>6} {statistics.median(seconds) * 1e3:>8.1f} "
                f"{statistics.median(ratios):>6.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    chunks = [int(c) for c in args.chunks.split(",")]
    results = []
    for dtype_name in args.dtypes.split(","):
        for shape in args.shapes.split(","):
            seq, head_dim = (int(n) for n in shape.split("x"))
            seconds = measure(seq, head_dim, getattr(torch, dtype_name), chunks, args.rounds)
            results.append({"dtype": dtype_name, "seq": seq, "head_dim": head_dim, "seconds": seconds})
            print(f"{dtype_name} seq {seq} head_dim {head_dim}: measured", flush=True)
    table = format_table(results)
    print(table)
    machine = {**machine_info(), "omp_num_threads_per_rank": None, "torch_threads": 1}
    with open(args.out, "w") as f:
        json.dump({"machine": machine, "settings": vars(args), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
