"""The ``[eval]`` section: tasks in local JSONL files, multiple choice scored by log-likelihood
(trainer/evaluate.py) and generation scored by exact match of a greedy continuation
(trainer/evaluate_generation.py), every ``freq`` steps of training, as lm-evaluation-harness scores
them; and the reading of those files, which the pre-launch check and the ranks share."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from config.errors import ConfigError

EVALUATION_FILE = "evaluation.jsonl"  # in job.dump_folder: one JSON record per evaluation
RECORD_FIELDS = ("context", "choices", "answer")
GENERATION_FIELDS = ("context", "answer")  # and optionally "until"


@dataclass
class Evaluation:
    tasks: list[str] = field(default_factory=list)
    """JSONL files of tasks, one record a line; multiple choice: {"context": "...", "choices": ["...", ...],
    "answer": index of the right choice}; generation: {"context": "...", "answer": "the expected text",
    "until": ["stop strings", ...] (optional)}. A file's first record sets its kind. A task is named by
    its file's name without the extension."""
    freq: int = 0
    """Evaluate every this many steps and at the last step; 0 = never."""
    limit: int = 0
    """Records scored of each task (its first ones); 0 = all."""
    batch_size: int = 8
    """Sequences of a forward pass on each rank."""
    max_length: int | None = None
    """Tokens of a scored sequence: a longer context is cut from the left, as lm-evaluation-harness cuts it;
    unset = training.seq_len."""
    max_new_tokens: int = 32
    """Tokens generated greedily for each record of a generation task; its context keeps its last
    max_length - max_new_tokens tokens, as lm-evaluation-harness's max_gen_toks."""
    add_bos: bool = False
    """Begin each context with the BOS token, as lm-evaluation-harness does with add_bos_token=True or with a
    tokenizer that adds one itself (Llama 3's): set it to score as the harness scores that model."""


@dataclass
class Record:
    """A multiple-choice question: the continuation of ``context`` by " " + each choice is scored."""

    context: str
    choices: list[str]
    answer: int


@dataclass
class GenerationRecord:
    """A generation question: the greedy continuation of ``context``, cut at the first of ``until``,
    is right when it equals ``answer``."""

    context: str
    answer: str
    until: list[str]


def task_name(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def check_evaluation(e: Evaluation, seq_len: int, pipeline_degree: int, context_degree: int) -> None:
    """The section's mistakes that need no file read, at training.seq_len and the parallelism degrees."""
    if e.freq < 0 or e.limit < 0 or e.batch_size < 1:
        raise ConfigError(
            f"eval.freq {e.freq} and eval.limit {e.limit} must be 0 or more, eval.batch_size {e.batch_size} 1 or more"
        )
    if e.freq == 0:
        return
    if not e.tasks:
        raise ConfigError(f"eval.freq {e.freq} needs eval.tasks: the JSONL files of the tasks to score")
    if e.max_length is not None and not 2 <= e.max_length <= seq_len:
        raise ConfigError(f"eval.max_length {e.max_length} must be 2 to training.seq_len {seq_len}")
    if pipeline_degree > 1 or context_degree > 1:
        raise ConfigError(
            "eval.freq: evaluation runs on layouts without pipeline or context parallelism (it scores every "
            "sequence whole on one stage); set eval.freq 0 or parallelism.pipeline/context_parallel_degree 1"
        )
    names = [task_name(path) for path in e.tasks]
    if len(set(names)) < len(names):
        raise ConfigError(f"eval.tasks: two files of the same name in {', '.join(e.tasks)}: a task is named by it")


def read_tasks(e: Evaluation, seq_len: int) -> dict[str, list[Record] | list[GenerationRecord]]:
    """Each task's records by its name; a ConfigError for a broken file, or for eval.max_new_tokens
    leaving no room for a context when a task is a generation one."""
    tasks = {task_name(path): read_task(path, e.limit) for path in e.tasks}
    length = e.max_length or seq_len
    if any(isinstance(records[0], GenerationRecord) for records in tasks.values()):
        if not 1 <= e.max_new_tokens < length:
            raise ConfigError(
                f"eval.max_new_tokens {e.max_new_tokens} must be 1 to {length - 1} (below eval.max_length)"
            )
    return tasks


def read_task(path: str, limit: int = 0) -> list[Record] | list[GenerationRecord]:
    """The records of a task file (its first ``limit``, 0 = all), of the kind of its first; a ConfigError
    names the file and line of a record that is not a question of that kind."""
    where = f"eval.tasks: {path}"
    if not os.path.isfile(path):
        raise ConfigError(f"{where} is not a file")
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            records.append(_record(line, f"{where} line {number}", records[0] if records else None))
            if len(records) == limit:
                break
    if not records:
        raise ConfigError(f"{where} holds no records")
    return records


def _record(line: str, where: str, first: Record | GenerationRecord | None) -> Record | GenerationRecord:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not JSON ({e.msg})") from None
    if not isinstance(record, dict):
        raise ConfigError(f"{where} is not a JSON object")
    # Multiple choice unless the file's first record is a generation one (no choices nor an index answer).
    if isinstance(first, GenerationRecord) or (
        first is None and "choices" not in record and not isinstance(record.get("answer"), int)
    ):
        return _generation_record(record, where)
    if missing := [name for name in RECORD_FIELDS if name not in record]:
        raise ConfigError(f"{where} has no {', '.join(missing)} (a record holds {', '.join(RECORD_FIELDS)})")
    context, choices, answer = (record[name] for name in RECORD_FIELDS)
    if not isinstance(context, str):
        raise ConfigError(f"{where}: context must be a string")
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        raise ConfigError(f"{where}: choices must be a list of 2 or more non-empty strings")
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        raise ConfigError(f"{where}: answer {answer!r} is not an index of its {len(choices)} choices")
    return Record(context, choices, answer)


def _generation_record(record: dict, where: str) -> GenerationRecord:
    if missing := [name for name in GENERATION_FIELDS if name not in record]:
        raise ConfigError(f"{where} has no {', '.join(missing)} (a generation record holds context, answer, until)")
    context, answer, until = record["context"], record["answer"], record.get("until", [])
    if not isinstance(context, str) or not context or not isinstance(answer, str):
        raise ConfigError(f"{where}: context must be a non-empty string and answer a string")
    if not isinstance(until, list) or not all(isinstance(stop, str) and stop for stop in until):
        raise ConfigError(f"{where}: until must be a list of non-empty stop strings")
    return GenerationRecord(context, answer, until)
