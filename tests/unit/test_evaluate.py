"""Downstream evaluation's parts, each against lm-evaluation-harness's own code: the split of a context
and a continuation into ids, the scores and truncation of its HF backend, rolling log-likelihoods;
acc and acc_norm; the task files' mistakes before the ranks start; the metrics written."""

from __future__ import annotations

import json

import pytest
import torch
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM

from config.errors import ConfigError
from config.evaluation import Record
from config.manager import load_config
from programs import preflight
from programs.lm_eval_model import TesseraLM
from tests.hf_folders import SHAPES, corpus_text, write_llama_folder
from trainer.data.tokenizer import load_tokenizer
from trainer.evaluate import accuracies, encode_pair
from trainer.evaluate_generation import cut_at_stops
from trainer.metrics import MetricsLogger

PAIRS = [
    ("The model reads", " a token"),
    ("The model reads ", "a token"),  # the context's trailing space goes to the continuation
    ("The model reads  \n", " the ones"),
    ("def add(x, y):\n", "    return x + y"),
    ("", " Each rank keeps"),  # an empty context is the BOS token
    ("Rotary embeddings turn each pai", "r of features"),  # a token across the boundary
]


class HarnessSplit(TemplateLM):
    """The harness's own tokenization (TemplateLM.loglikelihood) over a transformers tokenizer, as its HF
    backend runs it; returns the ids it would score."""

    def __init__(self, tokenizer) -> None:
        super().__init__()
        self.hf = tokenizer

    @property
    def eot_token_id(self) -> int:
        return self.hf.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        return self.hf.bos_token_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **_) -> list[int]:
        return self.hf.encode(
            string, **({} if add_special_tokens is None else {"add_special_tokens": add_special_tokens})
        )

    def _loglikelihood_tokens(self, requests, **_):
        return [(context, continuation) for _, context, continuation in requests]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError

    def generate_until(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError


def instances(pairs: list[tuple[str, str]]) -> list[Instance]:
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    """A tiny Llama HF folder with random weights and the test tokenizer."""
    return write_llama_folder(str(tmp_path_factory.mktemp("evaluate") / "hf"), SHAPES["llama3.0"])


def test_a_context_and_a_choice_are_split_into_ids_as_the_harness_splits_them(folder):
    from transformers import AutoTokenizer

    harness = HarnessSplit(AutoTokenizer.from_pretrained(folder)).loglikelihood(instances(PAIRS), disable_tqdm=True)
    tokenizer = load_tokenizer(folder)
    assert [encode_pair(tokenizer, *pair, add_bos=False) for pair in PAIRS] == harness


def test_scores_and_truncation_equal_the_harness_hf_backend(folder):
    """Contexts longer than max_length are cut from the left as the HF backend cuts them; the sums of
    log-probabilities equal its (float32) within 1e-4, the greedy flags exactly; rolling too."""
    from lm_eval.models.huggingface import HFLM

    options = {"max_length": 16, "batch_size": 4}
    hf = HFLM(pretrained=folder, dtype="float32", device="cpu", **options)
    ours = TesseraLM(checkpoint=folder, **options)
    long = " ".join(corpus_text(1).split()[:40])
    pairs = [*PAIRS, (long, " the ones before it"), (long[:50], " a shard")]
    expected = hf.loglikelihood(instances(pairs), disable_tqdm=True)
    actual = ours.loglikelihood(instances(pairs), disable_tqdm=True)
    assert [g for _, g in actual] == [g for _, g in expected]
    torch.testing.assert_close([s for s, _ in actual], [s for s, _ in expected], atol=1e-4, rtol=0)
    rolling = [Instance("loglikelihood_rolling", {}, (text,), i) for i, text in enumerate([long, "A checkpoint"])]
    torch.testing.assert_close(
        ours.loglikelihood_rolling(rolling), hf.loglikelihood_rolling(rolling, disable_tqdm=True), atol=1e-4, rtol=0
    )


@pytest.mark.parametrize(
    "text, until, expected",
    [
        ("a token. Then", ["."], "a token"),
        ("a token. Then\n", ["\n", "."], "a token"),  # the first stop in the text, not in the list
        ("no stop here", ["\n\n"], "no stop here"),
        ("keeps all", ["", "z"], "keeps all"),  # an empty stop is ignored
        (" leading", [" "], ""),
    ],
)
def test_stop_strings_cut_as_the_harness_cuts(text, until, expected):
    from lm_eval.models.utils import postprocess_generated_text

    assert cut_at_stops(text, until) == expected == postprocess_generated_text(text, until, None)


def test_generate_until_equals_the_harness_hf_backend(folder):
    """Greedy continuations of the harness's HF backend, token for token, then cut: its left truncation of
    a long context to max_length - max_gen_toks, its stop strings, a batch of requests of two gen_kwargs."""
    from lm_eval.models.huggingface import HFLM

    options = {"max_length": 32, "batch_size": 3}
    hf = HFLM(pretrained=folder, dtype="float32", device="cpu", **options)
    ours = TesseraLM(checkpoint=folder, **options)
    contexts = [pair[0] or "A" for pair in PAIRS] + [" ".join(corpus_text(1).split()[:40])]
    kinds = [{"until": ["at"], "max_gen_toks": 8}, {"until": ["e", "\x00"], "max_gen_toks": 6, "do_sample": False}]
    requests = [
        Instance("generate_until", {}, (context, kinds[i % 2]), i) for i, context in enumerate(contexts + contexts)
    ]
    expected = hf.generate_until(requests, disable_tqdm=True)
    assert ours.generate_until(requests) == expected
    # The stops cut: not every text is its full 6 or 8 tokens.
    assert len({len(text) for text in expected}) > 2, expected


def test_acc_takes_the_first_of_equal_scores_and_acc_norm_divides_by_characters():
    tasks = {
        "a": [Record("q", ["x", "y"], 0), Record("q", ["long choice", "s"], 0)],
        "b": [Record("q", ["one", "two", "three"], 2)],
    }
    # a: a tie (the first wins), then -2 over 11 characters beats -1 over 1 under acc_norm only;
    # b: -4 over 5 characters beats -3 over 3.
    sums = [-1.0, -1.0, -2.0, -1.0, -3.0, -3.3, -4.0]
    assert accuracies(tasks, sums) == {"a": {"acc": 0.5, "acc_norm": 1.0}, "b": {"acc": 0.0, "acc_norm": 1.0}}


GOOD = {"context": "The model reads", "choices": [" a token", " a shard"], "answer": 0}
BAD_TASKS = {
    "missing_field": ([{"context": "x", "choices": ["a", "b"]}], "line 1 has no answer"),
    "answer_out_of_range": ([GOOD, {**GOOD, "answer": 2}], "line 2: answer 2 is not an index of its 2 choices"),
    "one_choice": ([{**GOOD, "choices": ["a"]}], "line 1: choices must be a list of 2 or more non-empty strings"),
    "not_json": (["{'context': 1}"], "line 1 is not JSON"),
    "missing_file": (None, "is not a file"),
    "generation_missing_answer": ([{"context": "x", "until": ["\n"]}], "line 1 has no answer (a generation record"),
    "generation_after_choice": ([GOOD, {"context": "x", "answer": "y"}], "line 2 has no choices"),
    "until_not_a_list": ([{"context": "x", "answer": "y", "until": "\n"}], "line 1: until must be a list"),
}


@pytest.mark.parametrize("name", BAD_TASKS)
def test_a_broken_task_file_is_one_line_before_the_ranks_start(name, tmp_path, capsys):
    records, message = BAD_TASKS[name]
    path = tmp_path / f"{name}.jsonl"
    if records is not None:
        path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    argv = ["--world-size=2", "--job.dump_folder", str(tmp_path / "run"), "--eval.freq", "5", "--eval.tasks", str(path)]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: eval.tasks: {path} {message}") and err.count("\n") == 1, err


def test_max_new_tokens_that_leave_no_context_are_one_line_before_the_ranks_start(tmp_path, capsys):
    path = tmp_path / "ends.jsonl"
    path.write_text(json.dumps({"context": "The model reads", "answer": " a token"}) + "\n")
    argv = ["--world-size=2", "--job.dump_folder", str(tmp_path / "run"), "--eval.freq", "5", "--eval.tasks", str(path)]
    assert preflight.main([*argv, "--training.seq_len", "64", "--eval.max_new_tokens", "64"]) == 2
    assert capsys.readouterr().err == "error: eval.max_new_tokens 64 must be 1 to 63 (below eval.max_length)\n"


@pytest.mark.parametrize(
    "options, message",
    [
        (["--eval.freq", "5"], "eval.freq 5 needs eval.tasks"),
        (["--eval.freq", "5", "--eval.tasks", "t.jsonl", "--parallelism.pipeline_parallel_degree", "2"], "pipeline"),
        (["--eval.freq", "5", "--eval.tasks", "a/t.jsonl,b/t.jsonl"], "two files of the same name"),
        (["--eval.freq", "5", "--eval.tasks", "t.jsonl", "--eval.max_length", "4096"], "eval.max_length 4096"),
    ],
)
def test_the_sections_mistakes_are_refused_when_the_config_loads(options, message):
    with pytest.raises(ConfigError, match=message):
        load_config(options)


def test_the_accuracies_go_to_the_console_the_evaluation_file_and_tensorboard(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(str(tmp_path), enable=True, enable_tensorboard=True, tensorboard_dir=str(tmp_path / "tb"))
    logger.start(0)
    with caplog.at_level("INFO"):
        logger.log_evaluation(5, {"sentences": {"acc": 0.5, "acc_norm": 0.25}, "ends": {"exact_match": 0.75}}, 1.5)
    logger.close()
    assert "step 5 | eval sentences acc 0.5000 acc_norm 0.2500 | ends exact_match 0.7500 | 1.50s" in caplog.text
    with open(tmp_path / "evaluation.jsonl") as f:
        assert json.loads(f.read()) == {
            "step": 5,
            "tasks": {"sentences": {"acc": 0.5, "acc_norm": 0.25}, "ends": {"exact_match": 0.75}},
            "seconds": 1.5,
        }
    events = EventAccumulator(str(tmp_path / "tb")).Reload()
    assert [e.value for e in events.Scalars("eval/sentences/acc_norm")] == [0.25]
    assert [e.value for e in events.Scalars("eval/ends/exact_match")] == [0.75]
