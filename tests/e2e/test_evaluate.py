"""Evaluation during training on 2 CPU ranks (FSDP): its accuracy and exact match at the last step
equal what lm-evaluation-harness's own HF backend gives on the run's Hugging Face export (the same
choices picked, the same texts generated), and what the "tessera" adapter gives on the run's DCP
checkpoint and on the export, in Python and through lm_eval's command line; under tensor parallelism
(tp 2) what the adapter gives in one process on that run's checkpoint; and a run with evaluation
trains bitwise as the same run without it."""

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
MAX_NEW_TOKENS = 8
STOPS = [" ", ".", ","]  # of the generation task: a word's end


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


def write_generation(path: str, records: int, seed: int) -> str:
    """A task of ``records`` word ends from the training corpus: a sentence cut inside a word, to be
    continued by the rest of that word; or cut after a word, to be continued by a space or a punctuation
    mark (the answer is empty: they are the stop strings). The model of 10 steps gets a few right."""
    sentences = [line for line in corpus_text(1).splitlines() if line.endswith(".")]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(records):
            sentence = rng.choice(sentences)
            cut = rng.choice([i for i in range(1, len(sentence) - 1) if sentence[i - 1] != " "])
            answer = sentence[cut:].split(" ")[0].split(".")[0]
            f.write(json.dumps({"context": sentence[:cut], "answer": answer, "until": STOPS}) + "\n")
    return path


def harness_task(path: str) -> dict:
    """The task of a local JSONL file, as lm-evaluation-harness reads it (no download)."""
    with open(path) as f:
        generation = "choices" not in json.loads(f.readline())
    source = {
        "task": os.path.splitext(os.path.basename(path))[0],
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": path}},
        "test_split": "test",
        "doc_to_text": "context",
        "doc_to_target": "answer",
    }
    if generation:
        return {
            **source,
            "output_type": "generate_until",
            "generation_kwargs": {"until": STOPS, "max_gen_toks": MAX_NEW_TOKENS, "do_sample": False},
            "metric_list": [{"metric": "exact_match"}],
        }
    return {
        **source,
        "output_type": "multiple_choice",
        "doc_to_choice": "choices",
        "metric_list": [{"metric": "acc"}, {"metric": "acc_norm"}],
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Three 2-rank runs of the same job: with evaluation every FREQ steps and without (FSDP), and with
    it under tensor parallelism."""
    root = tmp_path_factory.mktemp("evaluate")
    write_tokenizer(str(root / "tokenizer"))
    (root / "corpus.txt").write_text(corpus_text())
    # 50 questions of 4 choices and 3 of 3: 209 requests, 105 and 104 a rank, 14 and 13 batches of 8
    # before the shorter share is padded to the longer.
    tasks = [
        write_multiple_choice(str(root / "sentences.jsonl"), 50, 4, seed=0),
        write_multiple_choice(str(root / "short.jsonl"), 3, 3, seed=1),
        write_generation(str(root / "ends.jsonl"), 15, seed=3),  # 8 and 7 a rank
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
    evaluation = [
        *("--eval.freq", str(FREQ), "--eval.tasks", ",".join(tasks), "--eval.batch_size", "8"),
        *("--eval.max_new_tokens", str(MAX_NEW_TOKENS)),
    ]
    launch_train(str(root / "with"), 2, *job, *evaluation, timeout=600)
    launch_train(str(root / "without"), 2, *job, timeout=600)
    launch_train(str(root / "tp"), 2, *job, *evaluation, "--parallelism.tensor_parallel_degree", "2", timeout=600)
    evaluations = {}
    for run in ("with", "tp"):
        with open(root / run / "evaluation.jsonl") as f:
            evaluations[run] = [json.loads(line) for line in f]
    return {"root": root, "tasks": tasks, "evaluations": evaluations["with"], "tp": evaluations["tp"]}


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
    # Each choice's log-likelihood, or each generated text.
    picks = {
        name: [[r if isinstance(r, str) else r[0] for r in sample["filtered_resps"]] for sample in samples]
        for name, samples in out["samples"].items()
    }
    metrics = ("acc", "acc_norm", "exact_match")
    return {
        name: {**{m: values[f"{m},none"] for m in metrics if f"{m},none" in values}, "picks": picks[name]}
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
    print({"in training": in_training, "hf": hf})
    for name in in_training:
        scores = {k: v for k, v in hf[name].items() if k != "picks"}
        assert in_training[name] == scores
        for adapter in (dcp, folder):
            assert {k: v for k, v in adapter[name].items() if k != "picks"} == scores
            # The same picks: each choice's log-likelihood within float32 noise of the HF model's, the
            # same generated texts.
            for ours, theirs in zip(adapter[name]["picks"], hf[name]["picks"]):
                assert ours == (theirs if isinstance(theirs[0], str) else pytest.approx(theirs, abs=1e-3))
    # Not a model that picks the same index every time, nor one that never or always says the answer.
    assert 0 < in_training["sentences"]["acc"] < 1
    assert 0 < in_training["ends"]["exact_match"] < 1, hf["ends"]["picks"]


@pytest.mark.slow  # the runs of the fixture
def test_in_training_evaluation_under_tensor_parallelism_equals_one_process(runs):
    """At tp 2 (sequence-parallel shards, vocabulary-sharded logits) the scores equal those of the adapter
    in one process on the same step's checkpoint."""
    root, tasks = runs["root"], runs["tasks"]
    in_training = runs["tp"][-1]["tasks"]
    one = harness_scores("tessera", f"checkpoint={root / 'tp' / 'checkpoint' / f'step-{STEPS}'}", tasks)
    assert in_training == {name: {k: v for k, v in one[name].items() if k != "picks"} for name in in_training}


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
