"""Benchmark: token-shard preparation against the tokenizer library's own batch encoding, and training's
start against corpus size.

    python bench/data_scale.py [--prepare-mb 100] [--sizes-mb 20,200] [--rounds 3] [--workers 0]
                               [--tokenizer PATH] [--work /tmp/tessera-data-scale] [--out FILE]

The corpus is real text: JSON Lines of the Python installation's own .py, .txt and .rst files (the
standard library and the installed packages), repeated in another order each round until the size is
reached, written under ``--work`` (never in the repository) and reused while its size matches.

Preparation: ``prepare_tokens`` in a fresh process into an empty cache, ``--workers`` processes (0: one
per core), timed around the call (the pool's start included); its MB/s and tokens/s against the same
text encoded by the tokenizer library's own multi-threaded batch call in a fresh process, one thread
per core (sentencepiece's ``encode(list, num_threads=cores)`` for the default tokenizer, ``tokenizers``'
``encode_batch`` for a Hugging Face folder, tiktoken's ``encode_ordinary_batch``), only the encode
calls timed, in batches of 8 MB of text. The ratio of the two rates is the acceptance number (>= 0.8).
Peak RSS is the largest sum of the resident sets of the process and all its descendants, sampled
every 50 ms from /proc.

Training (``--sizes-mb``): for each size, the corpus is prepared with ``programs.prepare_data`` (kept from
the preparation measurement when it is the same corpus), then ``--rounds`` times, the sizes in turn, a
1-rank ``torchrun train.py`` of 2 steps on it (``configs/debug_model.toml``, the same cache) is timed
from launch to the log line of step 1, and its process tree's peak RSS sampled.

Prints the table and writes ``bench/results/data_scale.json``."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MB = 1e6
SUFFIXES = (".py", ".txt", ".rst")
STEP_ONE = re.compile(r"\bstep 1/")

PREPARE = """
import json, sys, time
from trainer.data.corpus import Corpus
from trainer.data.shards import encoder_for, prepare_tokens
from trainer.data.tokenizer import build_tokenizer
from config.job_config import Training
corpus, cache, tokenizer_path, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
tokenizer = build_tokenizer(tokenizer_path, cache)
encoder = encoder_for(Training(), Training(), tokenizer)
start = time.perf_counter()
tokens = prepare_tokens(Corpus(corpus), encoder, cache, workers=workers)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "bytes": tokens.num_bytes, "tokens": tokens.num_tokens,
                  "documents": tokens.num_documents, "shards": len(tokens._shards)}))
"""

TOKENIZER = """
import sys
from trainer.data.tokenizer import build_tokenizer
build_tokenizer(sys.argv[1], sys.argv[2])
"""

LIBRARY = """
import json, sys, time
from trainer.data.tokenizer import build_tokenizer, encode_threads
corpus, cache, tokenizer_path = sys.argv[1], sys.argv[2], sys.argv[3]
tokenizer = build_tokenizer(tokenizer_path, cache)
seconds = size = tokens = 0
def encode(texts):
    global seconds, tokens
    start = time.perf_counter()
    ids = tokenizer.encode_batch(texts)  # the library's batch call, one thread per core
    seconds += time.perf_counter() - start
    tokens += sum(map(len, ids))
texts, held = [], 0
with open(corpus, "rb") as f:
    for line in f:
        text = json.loads(line)["text"]
        texts.append(text)
        held += len(line)
        size += len(line)
        if held >= 8_000_000:
            encode(texts)
            texts, held = [], 0
if texts:
    encode(texts)
print(json.dumps({"seconds": seconds, "bytes": size, "tokens": tokens, "threads": encode_threads(),
                  "library": type(tokenizer).__name__}))
"""


def source_files() -> list[Path]:
    roots = sorted({sysconfig.get_path("stdlib"), sysconfig.get_path("purelib")})
    found = []
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            found += [Path(folder, name) for name in sorted(files) if name.endswith(SUFFIXES)]
    return found


def build_corpus(path: Path, size_mb: float) -> Path:
    """JSON Lines of real text of at least ``size_mb`` MB; reused when already there."""
    target = int(size_mb * MB)
    if path.exists() and target <= path.stat().st_size < target + 4 * MB:
        return path
    files = source_files()
    path.parent.mkdir(parents=True, exist_ok=True)
    written, rounds = 0, 0
    with open(path.with_suffix(".partial"), "w", encoding="utf-8") as out:
        while written < target:
            order = files[:]
            random.Random(rounds).shuffle(order)  # each round another order: documents in new neighbours
            for file in order:
                try:
                    text = file.read_text(encoding="utf-8")
                except (UnicodeDecodeError, OSError):
                    continue
                if not text.strip() or len(text) > 2 * MB:
                    continue
                line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
                out.write(line)
                written += len(line.encode())
                if written >= target:
                    break
            rounds += 1
    os.replace(path.with_suffix(".partial"), path)
    return path


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants."""
    total, stack = 0, [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/status") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:")), 0)
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    stack += [int(child) for child in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def run_measured(command: list[str], *, on_line: Any = None, timeout: float = 7200) -> tuple[str, int, float]:
    """Runs ``command`` (stdout and stderr together): its output, its tree's peak RSS and wall seconds."""
    start = time.perf_counter()
    process = subprocess.Popen(
        command,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONPATH": REPO},
    )
    peak = [0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], tree_rss(process.pid))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    lines = []
    for line in process.stdout:
        lines.append(line)
        if on_line is not None:
            on_line(line, time.perf_counter() - start)
    process.wait(timeout)
    done.set()
    sampler.join()
    output = "".join(lines)
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])} ... exited with {process.returncode}:\n{output[-3000:]}")
    return output, peak[0], time.perf_counter() - start


def last_json(output: str) -> dict[str, Any]:
    return json.loads(output.strip().splitlines()[-1])


def default_tokenizer_into(work: Path, cache: Path, tokenizer: str) -> None:
    """Trains the default tokenizer once (outside every timing) and links it into ``cache``."""
    trained = work / "tokenizer"
    subprocess.run([sys.executable, "-c", TOKENIZER, tokenizer, str(trained)], cwd=REPO, check=True)
    os.makedirs(cache, exist_ok=True)
    for name in os.listdir(trained):
        if name.endswith(".model") and not (cache / name).exists():
            os.link(trained / name, cache / name)


def corpus_cache(work: Path, corpus: Path) -> Path:
    """The cache folder of one corpus's shards: the training runs start from a prepared corpus."""
    return work / f"cache-{corpus.stem}"


def measure_preparation(corpus: Path, work: Path, tokenizer: str, workers: int) -> dict[str, Any]:
    cache = corpus_cache(work, corpus)
    subprocess.run(["rm", "-rf", str(cache)], check=True)
    tokenizer_cache = str(work / "tokenizer")
    library_output, library_rss, _ = run_measured(
        [sys.executable, "-c", LIBRARY, str(corpus), tokenizer_cache, tokenizer]
    )
    library = last_json(library_output)
    default_tokenizer_into(work, cache, tokenizer)
    ours_output, ours_rss, _ = run_measured(
        [sys.executable, "-c", PREPARE, str(corpus), str(cache), tokenizer, str(workers)]
    )
    ours = last_json(ours_output)
    # The same text at both rates: the file's size (the shards count a line's text without its newline).
    size = corpus.stat().st_size
    ours_rate, library_rate = size / ours["seconds"], size / library["seconds"]
    return {
        "corpus_mb": corpus.stat().st_size / MB,
        "shards": ours,
        "library": library,
        "shards_mb_s": ours_rate / MB,
        "shards_tokens_s": ours["tokens"] / ours["seconds"],
        "library_mb_s": library_rate / MB,
        "library_tokens_s": library["tokens"] / library["seconds"],
        "ratio": ours_rate / library_rate,
        # The shards hold the library's ids plus each document's BOS and EOS: the same encoding.
        "same_token_count": ours["tokens"] == library["tokens"] + 2 * ours["documents"],
        "shards_peak_rss_gib": ours_rss / 2**30,
        "library_peak_rss_gib": library_rss / 2**30,
    }


def training_options(corpus: Path, work: Path, tokenizer: str, workers: int) -> list[str]:
    cache = corpus_cache(work, corpus)  # the shards the preparation measurement made, else made here
    default_tokenizer_into(work, cache, tokenizer)
    return [
        *("--job.config_file", "configs/debug_model.toml", "--training.dataset", str(corpus)),
        *("--job.cache_dir", str(cache), "--model.tokenizer_path", tokenizer),
        *("--training.dataset_prepare_workers", str(workers)),
    ]


def prepare_for_training(corpus: Path, options: list[str]) -> dict[str, Any]:
    output, rss, seconds = run_measured([sys.executable, "-m", "programs.prepare_data", *options])
    return {
        "corpus_mb": corpus.stat().st_size / MB,
        "prepare_s": seconds,
        "prepare_peak_rss_gib": rss / 2**30,
        "prepare_output": output.strip().splitlines()[-1],
        "rounds": [],
    }


def time_training(corpus: Path, work: Path, options: list[str]) -> dict[str, float | None]:
    """One 1-rank run of 2 steps on a prepared corpus: launch to step 1, the whole run, peak RSS."""
    dump = work / f"run-{corpus.stem}"
    subprocess.run(["rm", "-rf", str(dump)], check=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "train.py", *options]
    command += ["--training.steps", "2", "--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false"]
    command += ["--job.dump_folder", str(dump)]
    step_one: list[float] = []

    def watch(line: str, seconds: float) -> None:
        if not step_one and STEP_ONE.search(line):
            step_one.append(seconds)

    _, rss, seconds = run_measured(command, on_line=watch)
    return {"launch_to_step_1_s": step_one[0] if step_one else None, "train_s": seconds, "peak_rss_gib": rss / 2**30}


def spread(values: list[float]) -> str:
    """Median (min-max) of ``values``."""
    ordered = sorted(values)
    return f"{ordered[len(ordered) // 2]:.1f} ({ordered[0]:.1f}-{ordered[-1]:.1f})"


def format_tables(preparation: dict[str, Any] | None, training: list[dict[str, Any]]) -> str:
    lines = []
    if preparation:
        p = preparation
        lines += [
            "| corpus MB | shards MB/s | shards tokens/s | library MB/s | library tokens/s | ratio "
            "| shards peak RSS GiB | library peak RSS GiB |",
            "|---|---|---|---|---|---|---|---|",
            f"| {p['corpus_mb']:.0f} | {p['shards_mb_s']:.2f} | {p['shards_tokens_s']:,.0f} | {p['library_mb_s']:.2f} "
            f"| {p['library_tokens_s']:,.0f} | {p['ratio']:.2f} | {p['shards_peak_rss_gib']:.2f} "
            f"| {p['library_peak_rss_gib']:.2f} |",
        ]
    if training:
        lines += [
            "",
            "| corpus MB | prepare s | prepare peak RSS GiB | launch to step 1 s, median (min-max) | train peak RSS GiB |",
            "|---|---|---|---|---|",
        ]
        for t in training:
            firsts = [r["launch_to_step_1_s"] for r in t["rounds"] if r["launch_to_step_1_s"] is not None]
            first = spread(firsts) if firsts else "n/a"
            rss = max(r["peak_rss_gib"] for r in t["rounds"])
            lines.append(
                f"| {t['corpus_mb']:.0f} | {t['prepare_s']:.1f} | {t['prepare_peak_rss_gib']:.2f} | {first} | {rss:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--prepare-mb", type=float, default=100, help="corpus size of the throughput comparison; 0 skips it"
    )
    parser.add_argument("--sizes-mb", default="", help="comma-separated corpus sizes of the training runs")
    parser.add_argument("--rounds", type=int, default=3, help="training runs per corpus size")
    parser.add_argument("--workers", type=int, default=0, help="preparing processes (0: one per core)")
    parser.add_argument("--tokenizer", default="", help="tokenizer path (default: the default tokenizer)")
    parser.add_argument("--work", default="/tmp/tessera-data-scale", help="folder of the corpora and caches")
    parser.add_argument("--out", default=os.path.join(REPO, "bench", "results", "data_scale.json"))
    args = parser.parse_args(argv)
    work = Path(args.work).resolve()
    if str(work).startswith(REPO + os.sep):
        parser.error("--work must lie outside the repository")
    sizes = [float(size) for size in args.sizes_mb.split(",") if size]

    info = {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "workers": args.workers or len(os.sched_getaffinity(0)),
        "tokenizer": args.tokenizer or "default (sentencepiece BPE, 2048 ids)",
        "loadavg_start": os.getloadavg(),
    }
    preparation = None
    if args.prepare_mb > 0:
        corpus = build_corpus(work / f"corpus-{args.prepare_mb:g}MB.jsonl", args.prepare_mb)
        print(f"preparation of {corpus} ...", flush=True)
        preparation = measure_preparation(corpus, work, args.tokenizer, args.workers)
    corpora = [build_corpus(work / f"corpus-{size:g}MB.jsonl", size) for size in sizes]
    options = [training_options(corpus, work, args.tokenizer, args.workers) for corpus in corpora]
    training = [prepare_for_training(corpus, o) for corpus, o in zip(corpora, options)]
    for round_number in range(args.rounds):  # the sizes in turn each round: drift of the machine hits all
        for corpus, o, record in zip(corpora, options, training):
            print(f"round {round_number + 1}: training on {corpus} ...", flush=True)
            record["rounds"].append(time_training(corpus, work, o))
    info["loadavg_end"] = os.getloadavg()

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"machine": info, "preparation": preparation, "training": training}, f, indent=1)
    print()
    print(format_tables(preparation, training))
    print(
        "\nratio: shards' MB/s over the library's batch encoding of the same text on the same cores (encode calls "
        "only); peak RSS: the process tree's.\n"
        f"Results in {os.path.relpath(args.out, REPO)}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
