"""Chat data: ChatEncoder's ids equal transformers' apply_chat_template on a Llama-3-style folder, its mask
covers the assistant's messages and nothing else, masked tokens take no gradient, and bad records, folders
and templates fail in one line naming them."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hf_folders import LLAMA3_CHAT_TEMPLATE, LLAMA3_CHAT_TOKENS, write_chat_tokenizer, write_tokenizer
from trainer.data.batch import IGNORE_INDEX
from trainer.data.chat import CHAT_TEMPLATE_FILE, ChatEncoder

transformers = pytest.importorskip("transformers")

# A multi-line template: indented block tags on their own lines render nothing only with trim_blocks and
# lstrip_blocks; it also uses a namespace, loop controls, tojson on non-ASCII text, strftime_now and
# raise_exception.
MULTILINE_TEMPLATE = """{{ bos_token }}
{% if strftime_now('%Y') | int < 2000 %}
    {{ raise_exception('the clock is wrong') }}
{% endif %}
{% set ns = namespace(turns=0) %}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('this template has no role ' + message['role']) }}
    {% endif %}
    {% if ns.turns > 1000 %}
        {% break %}
    {% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|start_header_id|>{{ message['role'] }}<|end_header_id|>

    {% if message['role'] == 'system' %}
{{ message | tojson }}
    {% else %}
{{ message['content'] }}
    {% endif %}
<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}
<|start_header_id|>assistant<|end_header_id|>

{% endif %}
"""
# Llama 3's template with transformers' marks of the assistant's text: its content and <|eot_id|>.
MARKED_TEMPLATE = (
    "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def _message(role: str, content: str) -> dict[str, str]:
    return {"role": role, "content": content}


CONVERSATIONS = {
    "system-user-assistant": [
        _message("system", "You answer in one sentence."),
        _message("user", "What does a checkpoint hold?"),
        _message("assistant", "The weights, the optimizer state and where the data loader stopped."),
    ],
    "multi-turn": [
        _message("user", "def add(x, y):"),
        _message("assistant", "    return x + y\n"),
        _message("user", "And the product?"),
        _message("assistant", "def mul(x, y):\n    return x * y"),
        _message("user", "Thanks."),
    ],
    "unicode": [
        _message("system", 'Réponds <b>brièvement</b> & "poliment"'),
        _message("user", "Grüße aus Köln 🌍 — 你好，世界！"),
        _message("assistant", "Bonjour à tous 👋🏽 ça va? ありがとう"),
    ],
    "empty content": [
        _message("system", ""),
        _message("user", ""),
        _message("assistant", ""),
    ],
    "special-token text in content": [
        _message("user", "What is <|eot_id|>?"),
        _message("assistant", "It ends a turn: <|eot_id|>"),
    ],
}


def _folder(tmp_path, template: str = LLAMA3_CHAT_TEMPLATE, in_file: bool = False) -> str:
    """A Llama-3-style folder whose template sits in tokenizer_config.json, or in chat_template.jinja."""
    folder = write_chat_tokenizer(str(tmp_path / "tokenizer"), chat_template=None if in_file else template)
    if in_file:
        with open(os.path.join(folder, CHAT_TEMPLATE_FILE), "w", encoding="utf-8") as f:
            f.write(template)
    return folder


def _encode(encoder: ChatEncoder, messages) -> tuple[np.ndarray, np.ndarray]:
    ((ids, mask),) = encoder.encode_batch([messages], ["chat.jsonl:1"])
    return ids, mask


@pytest.mark.parametrize("in_file", [False, True], ids=["config", "jinja-file"])
@pytest.mark.parametrize("template", [LLAMA3_CHAT_TEMPLATE, MULTILINE_TEMPLATE], ids=["llama3", "multiline"])
def test_ids_equal_transformers_apply_chat_template(tmp_path, template, in_file):
    folder = _folder(tmp_path, template, in_file)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = ChatEncoder(folder)
    names = list(CONVERSATIONS)
    encoded = encoder.encode_batch([CONVERSATIONS[name] for name in names], [f"chat.jsonl:{i}" for i in range(5)])
    for name, (ids, mask) in zip(names, encoded):
        expected = reference.apply_chat_template(CONVERSATIONS[name], tokenize=True, return_dict=False)
        assert ids.tolist() == expected, name
        assert ids.dtype == np.int64 and mask.dtype == bool and mask.shape == ids.shape
    assert encoded[0][0][0] == encoder.tokenizer.bos_id  # the template's BOS, not one added before it
    assert encoded[0][0][1] != encoder.tokenizer.bos_id


def test_mask_covers_each_assistant_message_and_its_end_of_turn(tmp_path):
    encoder = ChatEncoder(_folder(tmp_path))
    messages = [
        _message("system", "Be brief."),
        _message("user", "Hi?"),
        _message("assistant", "Hello there."),
        _message("user", "Bye?"),
        _message("assistant", "Bye 👋"),
    ]
    ids, mask = _encode(encoder, messages)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(int), [0]])))
    runs = [encoder.tokenizer.decode(ids[start:stop].tolist()) for start, stop in zip(edges[::2], edges[1::2])]
    assert runs == ["Hello there.<|eot_id|>", "Bye 👋<|eot_id|>"]
    unmasked = encoder.tokenizer.decode(ids[~mask].tolist())
    assert unmasked.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")  # headers are no targets


def test_mask_equals_transformers_assistant_mask_of_a_marked_template(tmp_path):
    """transformers' own assistant mask, from a template marking the assistant's text with {% generation %}."""
    folder = _folder(tmp_path, MARKED_TEMPLATE)
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    encoder = ChatEncoder(folder)
    for name, messages in CONVERSATIONS.items():
        expected = reference.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = _encode(encoder, messages)
        assert ids.tolist() == expected["input_ids"], name
        assert mask.astype(int).tolist() == expected["assistant_masks"], name


def test_a_conversation_without_assistant_has_no_targets(tmp_path):
    _, mask = _encode(ChatEncoder(_folder(tmp_path)), [_message("user", "Anyone?")])
    assert not mask.any()


def test_masked_tokens_take_no_gradient(tmp_path):
    ids, mask = _encode(ChatEncoder(_folder(tmp_path)), CONVERSATIONS["multi-turn"])
    labels = torch.from_numpy(ids[1:]).clone()
    labels[~torch.from_numpy(mask[1:])] = IGNORE_INDEX  # a label is trained when its token is a target
    logits = torch.randn(len(labels), 512, generator=torch.Generator().manual_seed(0), requires_grad=True)
    F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX).backward()
    ignored = labels == IGNORE_INDEX
    assert ignored.any() and (~ignored).any()
    assert torch.equal(logits.grad[ignored], torch.zeros_like(logits.grad[ignored]))
    assert (logits.grad[~ignored].abs().sum(dim=1) > 0).all()


BAD_RECORDS = {
    "no messages": (None, "chat.jsonl:7: the record has no 'messages'"),
    "not a list": ("hello", "'messages' is a str, not a non-empty list"),
    "empty": ([], "'messages' is an empty list"),
    "not an object": ([["user", "hi"]], "messages[0] is a list, not a {role, content} object"),
    "no content": ([{"role": "user"}], "messages[0]'s 'content' is missing"),
    "null content": ([{"role": "user", "content": None}], "messages[0]'s 'content' is missing"),
    "content not text": (
        [_message("user", "a"), {"role": "assistant", "content": 3}],
        "messages[1]'s 'content' is an int",
    ),
    "unknown role": ([_message("robot", "beep")], "messages[0] has the role 'robot'"),
}


@pytest.mark.parametrize("name", list(BAD_RECORDS))
def test_a_bad_record_is_one_line_naming_it(tmp_path, name):
    value, expected = BAD_RECORDS[name]
    encoder = ChatEncoder(_folder(tmp_path))
    good = CONVERSATIONS["unicode"]
    with pytest.raises(ValueError) as error:
        encoder.encode_batch([good, value], ["chat.jsonl:6", "chat.jsonl:7"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("chat.jsonl:7: ") and expected in message


def test_a_role_the_template_refuses_is_one_line_naming_the_record(tmp_path):
    encoder = ChatEncoder(_folder(tmp_path, MULTILINE_TEMPLATE))
    with pytest.raises(ValueError) as error:
        encoder.encode_batch([[_message("user", "ls"), _message("tool", "a.txt")]], ["chat.jsonl:3"])
    assert (
        str(error.value) == "chat.jsonl:3: the chat template refuses this conversation: this template has no role tool"
    )


def test_a_template_that_rewrites_earlier_messages_is_one_line(tmp_path):
    """The assistant's span is where the conversation through it ends: a template that renders a message
    differently once others follow leaves it nowhere to be found."""
    template = "{% for message in messages %}{{ message['content'] }}{% if loop.last %}!{% endif %}{% endfor %}"
    encoder = ChatEncoder(_folder(tmp_path, template))
    _, mask = _encode(encoder, [_message("user", "a"), _message("assistant", "b")])
    assert mask.any()
    with pytest.raises(ValueError) as error:
        _encode(encoder, [_message("user", "a"), _message("assistant", "b"), _message("user", "c")])
    assert str(error.value) == (
        "chat.jsonl:1: the chat template renders messages[1] differently once later messages follow, "
        "so its tokens cannot be located"
    )


def test_a_folder_without_a_chat_template_is_one_line(tmp_path):
    folder = write_chat_tokenizer(str(tmp_path / "plain"), chat_template=None)
    with pytest.raises(ValueError, match=r"^tokenizer folder .*plain has no chat template .*dataset_format = 'chat'"):
        ChatEncoder(folder)
    write_tokenizer(str(tmp_path / "older"))  # a folder made for text data
    with pytest.raises(ValueError, match="has no chat template"):
        ChatEncoder(str(tmp_path / "older"))


@pytest.mark.parametrize("path", ["", "tokenizer.model"], ids=["default", "tiktoken-file"])
def test_a_tokenizer_without_a_folder_is_one_line(tmp_path, path):
    with pytest.raises(ValueError, match="needs a Hugging Face tokenizer folder with a chat template"):
        ChatEncoder(str(tmp_path / path) if path else path)


def test_a_template_that_does_not_parse_is_one_line(tmp_path):
    with pytest.raises(ValueError) as error:
        ChatEncoder(_folder(tmp_path, "{% for message in messages %}{{ message['content'] }}"))
    assert "\n" not in str(error.value) and "chat template of" in str(error.value) and "line 1" in str(error.value)


def test_the_file_template_wins_and_a_named_list_takes_default(tmp_path):
    folder = _folder(tmp_path, MULTILINE_TEMPLATE, in_file=True)
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "y"}]
    with open(config_path, "w") as f:
        json.dump(config, f)
    assert ChatEncoder(folder).template == MULTILINE_TEMPLATE
    os.remove(os.path.join(folder, CHAT_TEMPLATE_FILE))
    assert ChatEncoder(folder).template == "y"


def test_the_encoder_pickles_and_its_fingerprint_follows_tokenizer_and_template(tmp_path):
    encoder = ChatEncoder(_folder(tmp_path / "a"))
    messages = CONVERSATIONS["multi-turn"]
    copy = pickle.loads(pickle.dumps(encoder))
    assert copy.field == "messages" and copy.fingerprint == encoder.fingerprint
    for got, want in zip(_encode(copy, messages), _encode(encoder, messages)):
        assert np.array_equal(got, want)
    assert ChatEncoder(_folder(tmp_path / "b")).fingerprint == encoder.fingerprint
    with open(os.path.join(str(tmp_path / "b" / "tokenizer"), CHAT_TEMPLATE_FILE), "w") as f:
        f.write(MULTILINE_TEMPLATE)  # the same tokenizer files, another template
    other_template = ChatEncoder(str(tmp_path / "b" / "tokenizer"))
    assert other_template.fingerprint != encoder.fingerprint
    assert other_template.tokenizer.fingerprint == encoder.tokenizer.fingerprint


def test_chat_offsets_cover_every_character_even_where_the_folder_trims_them(tmp_path):
    """A GPT-2-style post-processor trims whitespace off offsets; the chat encoding keeps whole offsets, so a
    whitespace token inside an assistant message still overlaps its span."""
    folder = _folder(tmp_path)
    json_path = os.path.join(folder, "tokenizer.json")
    with open(json_path) as f:
        spec = json.load(f)
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    with open(json_path, "w") as f:
        json.dump(spec, f)
    text = "<|start_header_id|>assistant<|end_header_id|>\n\n    return x  +  y\n\n<|eot_id|>"
    ((ids, offsets),) = ChatEncoder(folder).tokenizer.encode_rendered_chats([text])
    covered = np.zeros(len(text), dtype=bool)
    for start, end in offsets:
        covered[start:end] = True
    assert covered.all()
    assert ids[0] == LLAMA3_CHAT_TOKENS.index("<|start_header_id|>")  # special-token text recognised
    assert ids[-1] == LLAMA3_CHAT_TOKENS.index("<|eot_id|>")
