"""What `dstc eval` measures accuracy on: the embedded corpus's held-out split (the default), or the user's data file.

A data file is JSONL or plain text:

* JSONL records with ``text`` (perplexity, next-token distributions, greedy continuations), with ``prompt`` and
  ``answer`` (exact match of a greedy answer), or with chat ``messages`` (rendered by the tokenizer's chat template:
  a conversation ending with an assistant message is a prompt and its answer, any other one is text);
* any other file is read as plain UTF-8 text, one document.

The texts are tokenized and concatenated into one stream, cut into windows of ``window`` tokens every ``stride``
tokens; each window scores the tokens the previous one did not (HF's strided perplexity), so every token is
predicted once, with up to ``window - stride`` tokens of context before it. The embedded corpus keeps what eval has
always measured: each held-out text a sequence of its own, scored whole.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from toolchain.chat_roles import CHAT_ROLES
from toolchain.errors import InputError
from toolchain.models import corpus
from toolchain.reference.data import EvalData, Sequence
from toolchain.settings.evaluation import DEFAULT_WINDOW, EvalSettings

GREEDY_PREFIX_MAX = 256  # tokens of a window that prompt its greedy continuation


def load_data(settings: EvalSettings, tokenizer, *, task: bool, max_length: int) -> EvalData:
    """The data ``settings`` names, tokenized. ``task``: the model was trained on the embedded arithmetic task;
    ``max_length``: the model's context, which a window may not exceed."""
    if settings.dataset is None:
        return _embedded(settings, tokenizer, task)
    return _from_file(Path(settings.dataset), settings, tokenizer, max_length)


def _embedded(settings: EvalSettings, tokenizer, task: bool) -> EvalData:
    texts = [tokenizer(t)["input_ids"] for t in corpus.text_samples("heldout", settings.texts, settings.seed)]
    problems = corpus.task_examples("heldout", settings.problems, settings.seed) if task else []
    return EvalData(sequences=[Sequence(ids) for ids in texts],
                    prefixes=[ids[:max(2, len(ids) // 2)] for ids in texts[:settings.greedy_prompts]],
                    problems=[(tokenizer(p)["input_ids"], a) for p, a in problems], answer_tokens=8,
                    answer_stops_at_newline=True,
                    description={"dataset": "embedded held-out split", "texts": len(texts),
                                 "problems": len(problems)})


def _records(path: Path) -> tuple[str, list[dict] | str]:
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise InputError(f"--dataset {path}: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--dataset {path}: not UTF-8 (byte {e.start})") from None
    if path.suffix.lower() not in (".jsonl", ".json"):
        return "text", text
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            raise InputError(f"--dataset {path}:{n}: not a JSON object") from None
        if not isinstance(record, dict):
            raise InputError(f"--dataset {path}:{n}: not a JSON object")
        records.append(record)
    if not records:
        raise InputError(f"--dataset {path}: no records")
    return "jsonl", records


def _record(path: Path, n: int, record: dict, tokenizer) -> tuple[str | None, tuple[list[int], str] | None]:
    """A record as text, or as a prompt and its answer."""
    where = f"--dataset {path}:{n}"
    if "messages" in record:
        messages = record["messages"]
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise InputError(f"{where}: messages must be a list of {{role, content}} strings")
        if unknown := sorted({m["role"] for m in messages} - set(CHAT_ROLES)):
            raise InputError(f"{where}: unknown message role {', '.join(map(repr, unknown))} (one of "
                             f"{', '.join(CHAT_ROLES)}, as the server's)")
        if getattr(tokenizer, "chat_template", None) is None:
            raise InputError(f"{where}: chat messages, but the artifact's tokenizer has no chat template")
        if messages[-1]["role"] == "assistant" and len(messages) > 1:
            prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
            return None, (tokenizer(prompt, add_special_tokens=False)["input_ids"], messages[-1]["content"])
        return tokenizer.apply_chat_template(messages, tokenize=False), None
    if "prompt" in record or "answer" in record:
        prompt, answer = record.get("prompt"), record.get("answer")
        if not isinstance(prompt, str) or not isinstance(answer, str) or not prompt:
            raise InputError(f"{where}: prompt and answer must both be strings (and the prompt not empty)")
        return None, (tokenizer(prompt)["input_ids"], answer)
    if isinstance(record.get("text"), str):
        return record["text"], None
    raise InputError(f"{where}: a record needs text, prompt and answer, or messages")


def _from_file(path: Path, settings: EvalSettings, tokenizer, max_length: int) -> EvalData:
    kind, content = _records(path)
    texts: list[str] = []
    problems: list[tuple[list[int], str]] = []
    if isinstance(content, str):
        texts = [content]
    else:
        for n, record in enumerate(content, 1):
            text, problem = _record(path, n, record, tokenizer)
            if text is not None:
                texts.append(text)
            if problem is not None:
                problems.append(problem)
    window = settings.window or min(DEFAULT_WINDOW, max_length)
    stride = settings.stride or window
    if window > max_length:
        raise InputError(f"--window {window} is longer than the model's context ({max_length} tokens)")
    if stride > window:
        raise InputError(f"--stride {stride} is longer than the window ({window} tokens, the model's context)")
    stream = [t for text in texts if text for t in tokenizer(text, verbose=False)["input_ids"]]
    sequences: list[Sequence] = []
    begin = 0
    while begin < len(stream) and len(sequences) < settings.windows:
        ids = stream[begin:begin + window]
        if len(ids) < 2:
            break
        sequences.append(Sequence(ids, 1 if begin == 0 else window - stride))
        if begin + window >= len(stream):
            break
        begin += stride
    problems = problems[:settings.problems]
    if not sequences and not problems:
        raise InputError(f"--dataset {path}: no text of two tokens or more and no prompt/answer records")
    return EvalData(
        sequences=sequences,
        prefixes=[s.ids[:max(2, min(len(s.ids) // 2, GREEDY_PREFIX_MAX))] for s in sequences[:settings.greedy_prompts]],
        problems=problems, answer_tokens=settings.answer_tokens, answer_stops_at_newline=False,
        description={"dataset": str(path.resolve()), "format": kind,
                     "sha256": hashlib.sha256(path.read_bytes()).hexdigest(), "window": window, "stride": stride,
                     "windows": len(sequences), "tokens": len(stream),
                     "scored_tokens": sum(len(s.ids) - max(s.score_from, 1) for s in sequences),
                     "problems": len(problems)})
