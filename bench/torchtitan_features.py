"""Trains every torchtitan v0.2.2 Llama 3 integration-test flag list (tests/torchtitan_lists.py) through
run_train.sh with torchtitan's debug config on CPU ranks, and writes what each did to
bench/results/torchtitan_features.json: trained (its runs' last losses) or refused (the one line). Lists run one after the other; each run is one run_train.sh launch. The
file is rewritten after every list; ``--only`` reruns the lists named and keeps the others' entries.

    python bench/torchtitan_features.py [--only NAME ...] [--output PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.launch import REPO, read_metrics, script_env  # noqa: E402
from tests.torchtitan_lists import DEBUG_CONFIG, LISTS, FlagList  # noqa: E402


def launch(flag_list: FlagList, dump: str) -> dict:
    """The list's runs one after the other in ``dump``, until one fails."""
    runs = []
    for run in range(len(flag_list.runs)):
        start = time.perf_counter()
        result = subprocess.run(
            ["./run_train.sh", *flag_list.argv(run, dump)],
            cwd=REPO,
            env=script_env(flag_list.ranks, {"CONFIG_FILE": DEBUG_CONFIG, "MAX_RESTARTS": "0"}),
            capture_output=True,
            text=True,
        )
        errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
        record = {"returncode": result.returncode, "seconds": round(time.perf_counter() - start, 1)}
        if result.returncode == 0:
            record["losses"] = [r["loss"] for r in read_metrics(dump)]
            record["estimate"] = "dry run: rank 0 of" in result.stdout
        else:
            record["error"] = errors[-1] if errors else result.stderr[-1500:]
        runs.append(record)
        if result.returncode != 0:
            break
    trained = all(r["returncode"] == 0 for r in runs) and len(runs) == len(flag_list.runs)
    refused = len(runs) == 1 and runs[0]["returncode"] == 2
    return {"outcome": "trains" if trained else "refused" if refused else "failed", "runs": runs}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="list names (default: all)")
    parser.add_argument("--output", default=os.path.join(REPO, "bench", "results", "torchtitan_features.json"))
    args = parser.parse_args()
    # With --only, the other lists keep their entries of an earlier run of the file.
    table = _read(args.output)["lists"] if args.only else {}
    if "TORCHFT_LIGHTHOUSE" not in os.environ:  # ft.py's list trains as a replica group: a lighthouse for it
        from torchft.coordination import LighthouseServer

        os.environ.setdefault("RUST_LOG", "warn")
        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1)
        os.environ["TORCHFT_LIGHTHOUSE"] = lighthouse.address()
    print(f"{'list':<34} {'ranks':>5} {'expected':<10} {'outcome':<8} {'seconds':>7}  note", flush=True)
    for flag_list in LISTS:
        if args.only and flag_list.name not in args.only:
            continue
        expected = flag_list.expect.split(":")[0]
        with tempfile.TemporaryDirectory() as dump:
            entry = launch(flag_list, dump)
        entry.update(ranks=flag_list.ranks, expected=flag_list.expect)
        table[flag_list.name] = entry
        seconds = sum(r["seconds"] for r in entry["runs"])
        note = entry["runs"][-1].get("error", "")[:80] if entry["runs"] else ""
        print(
            f"{flag_list.name:<34} {flag_list.ranks:>5} {expected:<10} {entry['outcome']:<8} {seconds:>7.1f}  {note}",
            flush=True,
        )
        _write(args.output, table)  # after every list: a long run stopped part-way keeps what it did
    counts = _write(args.output, table)
    print(f"{counts} in {sum(r['seconds'] for e in table.values() for r in e['runs']):.0f} s of launches")
    return 0 if counts["failed"] == 0 else 1


def _read(path: str) -> dict:
    if not os.path.isfile(path):
        return {"lists": {}}
    with open(path) as f:
        return json.load(f)


def _write(path: str, table: dict) -> dict:
    """Writes the table in the lists' order with its counts and launch seconds; returns the counts."""
    order = [flag_list.name for flag_list in LISTS]
    table = {name: table[name] for name in sorted(table, key=order.index)}
    outcomes = ("trains", "refused", "failed")
    counts = {o: sum(e["outcome"] == o for e in table.values()) for o in outcomes}
    seconds = round(sum(r["seconds"] for e in table.values() for r in e["runs"]))
    with open(path, "w") as f:
        json.dump({"launch_seconds": seconds, "counts": counts, "lists": table}, f, indent=1)
    return counts


if __name__ == "__main__":
    sys.exit(main())
