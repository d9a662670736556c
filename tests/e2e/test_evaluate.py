"""Evaluation during training on 2 CPU ranks (FSDP): its accuracy at the last step equals what
lm-evaluation-harness's own HF backend gives on the run's Hugging Face export (the same choices
picked), and what the "tessera" adapter gives on the run's DCP checkpoint and on the export, in
Python and through lm_eval's command line; and a run with evaluation trains bitwise as the same run
without it."""

from __future__ import annotations

import glob
import json
import os
import random
import subprocess
import sys

import pytest

from tests.hf_folders import corpus_text, write_tokenizer
from tests.launch import REPO, TWO_BLOCKS, launch_train, read_metrics, train_env

STEPS, FREQ = 10, 5
MAX_LENGTH = 64  # training.seq_len: no record is cut


def write_multiple_choice(path: str, records: int, choices: int, seed: int) -> str:
    """A task of ``records`` questions from the training corpus: a sentence's first words, then its next
    three words among three other sentences' three words, the right one at a random place."""
    sentences = [line.split() for line in corpus_text(1).splitlines() if len(line.split()) >= 6]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(records):
            words = rng.choice(sentences)
            cut = rng.randint(2, len(words) - 3)
            options = [" ".join(rng.choice(sentences)[:3]) for _ in range(choices - 1)]
            answer = rng.randrange(choices)
            options.insert(answer, " ".join(words[cut : cut + 3]))
            f.write(json.dumps({"context": " ".join(words[:cut]), "choices": options, "answer": answer}) + "\n")
    return path


def harness_task(path: str) -> dict:
    """The task of a local JSONL file, as lm-evaluation-harness reads it (no download)."""
    return {
        "task": os.path.splitext(os.path.basename(path))[0],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": path}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "context",
        "doc_to_choice": "choices",
        "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Two 2-rank runs of the same job, with evaluation every FREQ steps and without."""
    root = tmp_path_factory.mktemp("evaluate")
    write_tokenizer(str(root / "tokenizer"))
    (root / "corpus.txt").write_text(corpus_text())
    # 50 questions of 4 choices and 3 of 3: 209 requests, 105 and 104 a rank, 14 and 13 batches of 8
    # before the shorter share is padded to the longer.
    tasks = [
        write_multiple_choice(str(root / "sentences.jsonl"), 50, 4, seed=0),
        write_multiple_choice(str(root / "short.jsonl"), 3, 3, seed=1),
    ]
    job = [
        *TWO_BLOCKS,
        "--model.tokenizer_path",
        str(root / "tokenizer"),
        "--training.dataset",
        str(root / "corpus.txt"),
        "--training.steps",
        str(STEPS),
        "--checkpoint.enable",
        "--checkpoint.export_hf",
    ]
    evaluation = ["--eval.freq", str(FREQ), "--eval.tasks", ",".join(tasks), "--eval.batch_size", "8"]
    launch_train(str(root / "with"), 2, *job, *evaluation, timeout=600)
    launch_train(str(root / "without"), 2, *job, timeout=600)
    with open(root / "with" / "evaluation.jsonl") as f:
        evaluations = [json.loads(line) for line in f]
    return {"root": root, "tasks": tasks, "evaluations": evaluations}


@pytest.mark.slow  # two 2-rank launches
def test_evaluation_does_not_change_the_losses(runs):
    root = runs["root"]
    with_eval, without = read_metrics(str(root / "with")), read_metrics(str(root / "without"))
    assert [r["loss"] for r in with_eval] == [r["loss"] for r in without]
    assert len(with_eval) == STEPS
    assert [e["step"] for e in runs["evaluations"]] == [FREQ, STEPS]


def harness_scores(model: str, model_args: str, tasks: list[str]) -> dict[str, dict]:
    import lm_eval

    import programs.lm_eval_model  # noqa: F401  registers "tessera"

    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[harness_task(t) for t in tasks],
        batch_size=8,
        device="cpu",
        log_samples=True,
    )
    picks = {
        name: [[ll for ll, _ in sample["filtered_resps"]] for sample in samples]
        for name, samples in out["samples"].items()
    }
    return {
        name: {"acc": values["acc,none"], "acc_norm": values["acc_norm,none"], "lls": picks[name]}
        for name, values in out["results"].items()
    }


@pytest.mark.slow  # the runs of the fixture
def test_in_training_accuracy_equals_the_harness_on_the_export_and_the_adapter(runs):
    root, tasks = runs["root"], runs["tasks"]
    in_training = runs["evaluations"][-1]["tasks"]
    export = str(root / "with" / "checkpoint" / "hf")
    hf = harness_scores("hf", f"pretrained={export},dtype=float32,max_length={MAX_LENGTH}", tasks)
    dcp = harness_scores("tessera", f"checkpoint={root / 'with' / 'checkpoint' / f'step-{STEPS}'}", tasks)
    folder = harness_scores("tessera", f"checkpoint={export},max_length={MAX_LENGTH}", tasks)
    print({"in training": in_training, **{k: {n: v["acc"] for n, v in s.items()} for k, s in [("hf", hf)]}})
    for name in in_training:
        assert in_training[name] == {"acc": hf[name]["acc"], "acc_norm": hf[name]["acc_norm"]}
        for adapter in (dcp, folder):
            assert (adapter[name]["acc"], adapter[name]["acc_norm"]) == (hf[name]["acc"], hf[name]["acc_norm"])
            # The same picks: each choice's log-likelihood within float32 noise of the HF model's.
            for ours, theirs in zip(adapter[name]["lls"], hf[name]["lls"]):
                assert ours == pytest.approx(theirs, abs=1e-3)
    # Not a model that picks the same index every time: the accuracies tell choices apart.
    assert 0 < in_training["sentences"]["acc"] < 1


@pytest.mark.slow  # the runs of the fixture, and lm_eval's command line in a process
def test_lm_eval_command_line_scores_the_checkpoint_through_this_module(runs, tmp_path):
    """``python -m programs.lm_eval_model`` is lm_eval's command line with "tessera" registered: a task of
    --include_path on the run's DCP checkpoint gives the accuracy the run logged."""
    import yaml

    task = runs["tasks"][0]
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "sentences.yaml").write_text(yaml.safe_dump(harness_task(task)))
    checkpoint = runs["root"] / "with" / "checkpoint" / f"step-{STEPS}"
    command = [
        *(sys.executable, "-m", "programs.lm_eval_model", "--model", "tessera"),
        *("--model_args", f"checkpoint={checkpoint}", "--tasks", "sentences"),
        *("--include_path", str(tmp_path / "tasks"), "--device", "cpu", "--output_path", str(tmp_path / "out")),
    ]
    subprocess.run(command, cwd=REPO, env=train_env(), check=True, capture_output=True, text=True, timeout=300)
    (results,) = glob.glob(str(tmp_path / "out" / "**" / "results_*.json"), recursive=True)
    with open(results) as f:
        scores = json.load(f)["results"]["sentences"]
    logged = runs["evaluations"][-1]["tasks"]["sentences"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (logged["acc"], logged["acc_norm"])
