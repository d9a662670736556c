"""Benchmark: what evaluation every N steps (eval.freq) adds to a run, against the time of its own passes.

    python bench/eval_cost.py [--rounds N] [--steps N] [--freq N] [--records N] [--ranks N] [--seq-len N]

Each run is one torchrun launch of train.py (gloo, OMP_NUM_THREADS=1 per rank, debugmodel of 2 blocks,
float32) on the test tokenizer and corpus (tests/hf_folders.py), with a multiple-choice task of
``records`` questions of 4 choices; each round runs the job with evaluation and without, in turn. The
training time is metrics.jsonl's elapsed_s at the last step; the evaluation's time is the sum of
evaluation.jsonl's seconds (each evaluation's forward passes and its one all-reduce) of the evaluations
before the last step (the last one comes after the last step's elapsed_s). Writes bench/results/eval_cost.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tests.e2e.test_evaluate import write_multiple_choice  # noqa: E402
from tests.hf_folders import corpus_text, write_tokenizer  # noqa: E402

RESULTS = os.path.join(REPO, "bench", "results", "eval_cost.json")


def run_once(args: argparse.Namespace, folder: str, evaluation: bool) -> tuple[float, float, int]:
    """(seconds to the last step, seconds of the evaluations before it, their count) of one launch."""
    dump = os.path.join(folder, "with" if evaluation else "without")
    command = [
        sys.executable,
        *("-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}", "train.py"),
        *("--model.flavor", "debugmodel", "--model.n_layers", "2", "--training.seq_len", str(args.seq_len)),
        *("--model.tokenizer_path", os.path.join(folder, "tokenizer")),
        *("--training.dataset", os.path.join(folder, "corpus.txt"), "--training.steps", str(args.steps)),
        *("--metrics.log_freq", "1", "--metrics.enable_tensorboard", "false", "--metrics.peak_flops", "1e12"),
        *("--training.mixed_precision_param", "float32", "--job.dump_folder", dump),
    ]
    if evaluation:
        command += ["--eval.freq", str(args.freq), "--eval.tasks", os.path.join(folder, "task.jsonl")]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    subprocess.run(command, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    with open(os.path.join(dump, "metrics.jsonl")) as f:
        elapsed = [json.loads(line) for line in f][-1]["elapsed_s"]
    if not evaluation:
        return elapsed, 0.0, 0
    with open(os.path.join(dump, "evaluation.jsonl")) as f:
        before_last = [r["seconds"] for r in map(json.loads, f) if r["step"] < args.steps]
    return elapsed, sum(before_last), len(before_last)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--freq", type=int, default=5)
    parser.add_argument("--records", type=int, default=50)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    rounds = []
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(os.path.join(folder, "tokenizer"))
        with open(os.path.join(folder, "corpus.txt"), "w") as f:
            f.write(corpus_text())
        write_multiple_choice(os.path.join(folder, "task.jsonl"), args.records, 4, seed=0)
        for index in range(args.rounds):
            without, _, _ = run_once(args, folder, evaluation=False)
            with_eval, eval_seconds, evaluations = run_once(args, folder, evaluation=True)
            rounds.append({"without_s": without, "with_s": with_eval, "eval_s": eval_seconds, "evals": evaluations})
            added = with_eval - without
            print(
                f"round {index + 1}/{args.rounds}: +{added:.2f} s with {evaluations} evaluations of {eval_seconds:.2f} s"
            )

    def median(key: str) -> float:
        return statistics.median(r[key] for r in rounds)

    added = statistics.median(r["with_s"] - r["without_s"] for r in rounds)
    print(f"\n{'run':<34} {'median s':>9}")
    print(f"{'training without evaluation':<34} {median('without_s'):>9.2f}")
    print(f"{f'training with eval.freq {args.freq}':<34} {median('with_s'):>9.2f}")
    print(f"{'added by evaluation':<34} {added:>9.2f}")
    print(f"{'the evaluations themselves':<34} {median('eval_s'):>9.2f}")
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
        "options": vars(args),
        "requests_per_evaluation": args.records * 4,
        "rounds": rounds,
        "median_without_s": median("without_s"),
        "median_with_s": median("with_s"),
        "median_added_s": added,
        "median_evaluations_s": median("eval_s"),
    }
    os.makedirs(os.path.dirname(RESULTS), exist_ok=True)
    with open(RESULTS, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
