"""Benchmark: the cost of the checkpoints' CRC-32s, on saving and on verifying.

    python bench/checksum.py [--mib 512] [--repeats 3]

In one process (a gloo group of one, as a rank of a real run sees its own files), writes a DCP
checkpoint of ``--mib`` MiB of random fp32 tensors twice, with DCP's plain FileSystemWriter and with
the ChecksummedWriter (the CRC computed while writing), then times on that checkpoint: reading
every file without checking (``read``), verifying sizes only (a marker without CRCs) and verifying
sizes and CRC-32s (``verify_files``, what every load does with its share). The files are in the page
cache (dropping it would slow the other users of this shared machine), so ``read`` is memory
bandwidth and ``verify`` is the CRC's own speed: on cold storage a rank verifies at the lesser of
that and its read bandwidth. Also the CRC-32 alone over a buffer in memory. Throughputs: best of
``--repeats`` (the least disturbed by the machine's other load); the saves alternate, and their
cost is the median of the per-repetition ratios (without fsync, whose time on this shared disk
varies far more than the CRC's cost). Writes ``bench/results/checksum.json`` with an
extrapolation to an 8B model's training checkpoint (fp32 weights + AdamW's two moments: 96 GB).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from trainer.checkpoint.integrity import COMPLETE_MARKER, ChecksummedWriter, verify_files, write_marker

MIB = 2**20
GB = 1e9
CHECKPOINT_8B_GB = 96.0  # 8e9 parameters x 4 bytes x 3 (weights, exp_avg, exp_avg_sq)
TENSOR_MIB = 16


def best_of(repeats: int, action: Callable[[], Any]) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        action()
        times.append(time.perf_counter() - start)
    return min(times)


def read_all(folder: str) -> None:
    buffer = bytearray(8 * MIB)
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def crc_in_memory(size: int) -> float:
    """Seconds for zlib.crc32 over ``size`` bytes already in memory, in 8 MiB chunks."""
    data = memoryview(os.urandom(64 * MIB))
    start = time.perf_counter()
    crc, done = 0, 0
    while done < size:
        for offset in range(0, len(data), 8 * MIB):
            crc = zlib.crc32(data[offset : offset + 8 * MIB], crc)
        done += len(data)
    return (time.perf_counter() - start) * size / done


def measure(root: str, mib: int, repeats: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    count = max(1, mib // TENSOR_MIB)
    state = {f"t{i}": torch.randn(TENSOR_MIB * MIB // 4, generator=generator) for i in range(count)}
    plain, checked = os.path.join(root, "plain"), os.path.join(root, "checked")
    saves: dict[str, list[float]] = {"save_plain": [], "save_checksummed": []}
    # Alternated, so that both see the same load of the machine; without fsync, whose time on this
    # shared disk varies far more than the CRC's cost.
    writers = {"save_plain": lambda: FileSystemWriter(plain, sync_files=False)}
    writers["save_checksummed"] = lambda: ChecksummedWriter(checked, sync_files=False)
    for _ in range(repeats):
        for name, make in writers.items():
            start = time.perf_counter()
            dcp.save(state, storage_writer=make())
            saves[name].append(time.perf_counter() - start)
    save_s = {name: min(times) for name, times in saves.items()}
    writer = ChecksummedWriter(checked)
    dcp.save(state, storage_writer=writer)
    write_marker(checked, 1, writer.checksums)
    size = sum(os.path.getsize(os.path.join(checked, name)) for name in os.listdir(checked))
    sizes_only = os.path.join(root, "sizes_only")
    os.makedirs(sizes_only)
    for name in os.listdir(checked):  # the same files (hard links), with a marker without CRCs
        if name != COMPLETE_MARKER:
            os.link(os.path.join(checked, name), os.path.join(sizes_only, name))
    with open(os.path.join(checked, COMPLETE_MARKER)) as f:
        marker = json.load(f)
    with open(os.path.join(sizes_only, COMPLETE_MARKER), "w") as f:
        json.dump({"step": marker["step"], "files": marker["files"]}, f)
    read_all(checked)  # into the page cache
    seconds = {
        **save_s,
        "read": best_of(repeats, lambda: read_all(checked)),
        "verify_sizes_only": best_of(repeats, lambda: verify_files(sizes_only)),
        "verify": best_of(repeats, lambda: verify_files(checked)),
        "crc32_in_memory": min(crc_in_memory(size) for _ in range(repeats)),
    }
    ratios = [b / a for a, b in zip(saves["save_plain"], saves["save_checksummed"])]
    return {
        "checkpoint_bytes": size,
        "files": len(os.listdir(checked)) - 1,
        "seconds": seconds,
        "save_times_s": saves,
        "save_overhead_median": statistics.median(ratios) - 1,
    }


def summarize(result: dict[str, Any]) -> dict[str, Any]:
    size, s = result["checkpoint_bytes"], result["seconds"]
    mb_s = {name: size / seconds / 1e6 for name, seconds in s.items()}
    verify_gb_s = mb_s["verify"] / 1e3
    one_rank = CHECKPOINT_8B_GB / verify_gb_s
    return {
        "throughput_mb_s": mb_s,
        "extrapolation_8b": {
            "checkpoint_gb": CHECKPOINT_8B_GB,
            "verify_on_one_rank_s": one_rank,
            "verify_per_rank_s": {str(n): one_rank / n for n in (8, 64, 256)},
            "crc_while_saving_per_rank_s": {
                str(n): CHECKPOINT_8B_GB / n / (mb_s["crc32_in_memory"] / 1e3) for n in (8, 64, 256)
            },
            "note": "every rank verifies 1/N of the files; on cold storage each rank reads its share at the "
            "lesser of this CRC speed and its read bandwidth, and the N ranks together need N times that "
            "from the file system",
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size in MiB (default 512)")
    parser.add_argument("--repeats", type=int, default=3, help="repetitions of every measure (default 3)")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "checksum.json"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "zlib": zlib.ZLIB_RUNTIME_VERSION,
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
    }
    with tempfile.TemporaryDirectory(prefix="bench_checksum_", dir=os.environ.get("TMPDIR")) as root:
        result = measure(root, args.mib, args.repeats)
    info["loadavg_end"] = os.getloadavg()
    result.update(summarize(result))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": info, "settings": {"mib": args.mib, "repeats": args.repeats}, **result}, f, indent=1)
    mb_s, x = result["throughput_mb_s"], result["extrapolation_8b"]
    print(
        f"checkpoint {result['checkpoint_bytes'] / MIB:.0f} MiB in {result['files']} files; MB/s (best of {args.repeats}):"
    )
    for name, value in mb_s.items():
        print(f"  {name:20s} {value:8.0f}")
    print(f"CRC while saving: {result['save_overhead_median']:+.1%} on a synchronous save (median of the ratios)")
    print(f"8B checkpoint ({CHECKPOINT_8B_GB:.0f} GB): verify {x['verify_on_one_rank_s']:.0f} s on one rank,", end=" ")
    print(", ".join(f"{s:.1f} s on each of {n}" for n, s in x["verify_per_rank_s"].items()))
    print(f"written to {args.out}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
