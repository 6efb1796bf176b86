"""Standard tasks (lm-evaluation-harness) scored on a dstc Decoder, from local task data only.

lm-eval's own task configs, prompts, filters, metrics and standard errors; dstc supplies the model calls:

* :class:`DecoderLM`: an lm-eval ``LM`` over any Decoder (toolchain/runtime/decoder.py: an artifact's ORT or
  OpenVINO decoder, the PyTorch reference) and its Hugging Face tokenizer. ``loglikelihood`` and
  ``loglikelihood_rolling`` (lm-eval's rolling windows of ``max_length`` tokens) score left-padded batches sorted
  by length as lm-eval's HFLM does; only the scored positions' logits are asked for, at most ``LOGIT_ROWS``
  positions x rows per forward (the rest of a long input fills the KV cache first), so memory does not grow with
  the vocabulary times the window. ``generate_until`` decodes greedily with the runtime's loop
  (toolchain/runtime/generate.py) until a stop string, an eos id or ``max_gen_toks``; sampling is refused.
* local task data: lm-eval's tasks by name (its TaskManager), each split read from ``task_data`` instead of the
  Hugging Face Hub: ``task_data/<task>/<split>.jsonl`` (or ``.json``, ``.parquet``) in the schema of the task's
  own dataset (its ``dataset_path``), the split names being the task config's (arc_easy: ``test.jsonl``, and
  ``train.jsonl`` for few-shot examples). Nothing is downloaded: datasets and the hub run offline. A missing file
  is an InputError naming the path expected, and so is an unknown task.
* :func:`evaluate_lm`: any lm-eval LM (DecoderLM, or lm-eval's own HFLM) on those tasks through
  ``lm_eval.simple_evaluate``; :func:`score_tasks` does it for a Decoder.
* :func:`check_tasks`: every problem of the tasks and their data (an unknown task, a missing split, a file that is
  empty, binary or does not parse, data that lacks what the task's prompts read) as one InputError, before any
  model runs: `dstc eval` and `dstc build` check them before the reference is computed.

Each task's result: ``{"metrics": {"acc,none": 0.71, ...}, "stderr": {"acc,none": 0.045, ...}, "samples": 100,
"samples_total": 500, "num_fewshot": 0, "version": 1.0, "higher_is_better": {"acc": True, ...}}``; the keys are
lm-eval's ``metric,filter`` names, a standard error lm-eval does not give (perplexities) is None.

    from toolchain.runtime.artifact import open_artifact
    from toolchain.runtime.decoder import open_decoder

    artifact = open_artifact("out/qwen-int4")
    scores = score_tasks(open_decoder(artifact), artifact.tokenizer(), ["arc_easy", "gsm8k"], Path("tasks"),
                         max_length=artifact.context_length, stop_ids=artifact.eos_token_ids, limit=200)
"""

from __future__ import annotations

import codecs
import difflib
import functools
import os
import re
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

from toolchain.errors import InputError
from toolchain.runtime.decoder import Decoder
from toolchain.runtime.generate import greedy_loop, left_pad

# Most logits (positions x rows) one forward returns: 1024 rows of a 152k vocabulary are 0.6 GB of float32.
LOGIT_ROWS = 1024
# Data files of a split, by suffix, and the `datasets` builder that reads them.
BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Generation settings that greedy decoding ignores (transformers' generate ignores them as well with
# do_sample=False); any other one changes what HFLM would generate, and is refused.
GREEDY_IGNORES = {"until", "max_gen_toks", "do_sample", "temperature", "top_p", "top_k", "min_p", "typical_p"}


def _offline() -> None:
    """datasets and huggingface_hub offline for the rest of the process: the environment for what imports them
    later, their flags for what already has (they read the environment once, at import)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["HF_DATASETS_OFFLINE"] = "1"
    import datasets
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = datasets.config.HF_DATASETS_OFFLINE = True


@dataclass
class _Scores:
    """One batch's scored positions, right-aligned: per row, the targets' log-probabilities and whether each was the
    argmax; and the log-softmax of the last position, for any other last token of the same input."""

    logprob: np.ndarray  # [rows, scored]
    greedy: np.ndarray  # [rows, scored]
    last: np.ndarray  # [rows, vocab]

    def answer(self, row: int, continuation: list[int]) -> tuple[float, bool]:
        """(log-likelihood, is greedy) of ``continuation``, which ends the row's input but for its last token."""
        n, last = len(continuation), int(continuation[-1])
        head = float(self.logprob[row, -n:-1].sum()) if n > 1 else 0.0
        greedy = bool(self.greedy[row, -n:-1].all()) and int(self.last[row].argmax()) == last
        return head + float(self.last[row, last]), greedy


def _score(decoder: Decoder, inputs: list[list[int]], targets: list[list[int]], scored: int, pad_id: int) -> _Scores:
    """Log-probabilities of ``targets`` (each input shifted by one) at the last ``scored`` positions of a
    left-padded batch: the earlier positions go in one forward that keeps one logit row, the scored ones in
    forwards of at most LOGIT_ROWS rows."""
    ids, mask = left_pad(inputs, pad_id)
    goal, _ = left_pad(targets, pad_id)
    rows, width = ids.shape
    start = width - scored
    decoder.reset()
    if start > 0:
        decoder.forward(ids[:, :start], mask[:, :start], 1)
    step = max(1, LOGIT_ROWS // rows)
    logprob, greedy = np.zeros((rows, scored)), np.zeros((rows, scored), bool)
    last = np.zeros(0)
    for a in range(start, width, step):
        b = min(a + step, width)
        logits = decoder.forward(ids[:, a:b], mask[:, :b], 0)[:, -(b - a):]
        peak = logits.max(-1, keepdims=True)
        lse = peak[..., 0] + np.log(np.exp(logits - peak).sum(-1, dtype=np.float64))
        picked = np.take_along_axis(logits, goal[:, a:b, None], -1)[..., 0]
        logprob[:, a - start:b - start] = picked - lse
        greedy[:, a - start:b - start] = logits.argmax(-1) == goal[:, a:b]
        if b == width:
            last = logits[:, -1] - lse[:, -1:]
    return _Scores(logprob, greedy, last)


class DecoderLM(TemplateLM):
    """lm-eval's model interface on a dstc Decoder and a Hugging Face tokenizer.

    Tokenization follows HFLM's (the tokenizer's own special tokens, none added before a text that starts with
    BOS; an empty context is the BOS token, else EOS), and so do truncation (the last ``max_length`` tokens of an
    input; contexts of generations to ``max_length - max_gen_toks``) and stop strings (the EOS token's text
    added), so that scores compare with HFLM's on the same checkpoint.

    ``stop_ids``: the token ids that end a generation (the model's generation_config eos ids; default the
    tokenizer's EOS). ``batch``: requests per forward.
    """

    def __init__(self, decoder: Decoder, tokenizer, *, max_length: int, batch: int = 8,
                 stop_ids: Sequence[int] | None = None, max_gen_toks: int = 256) -> None:
        super().__init__()
        if max_length < 2:
            raise InputError(f"max_length must be at least 2 tokens, not {max_length}")
        if batch < 1:
            raise InputError(f"batch must be at least 1, not {batch}")
        self.decoder, self.tokenizer = decoder, tokenizer
        self._max_length, self.batch, self._max_gen_toks = max_length, batch, max_gen_toks
        eos = tokenizer.eos_token_id
        self.stop_ids = set(stop_ids) if stop_ids is not None else ({eos} if eos is not None else set())
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else (eos if eos is not None else 0)

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tokenizer.decode(self.prefix_token_id))
        return list(self.tokenizer.encode(string, add_special_tokens=add_special_tokens))

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, is greedy) per (strings, context ids, continuation ids), in batches of the longest
        first; requests whose context and continuation but its last token are the same tokens share one input
        (lm-eval's Collator groups them, as HFLM's logits cache does; HFLM 0.4.13 scores a shorter continuation of
        such a group on the wrong positions, these are scored on their own last ones)."""
        del disable_tqdm  # no progress bars: dstc logs its own progress
        order = Collator(requests, sort_fn=lambda r: (-len(r[1] + r[2]), tuple(r[1] + r[2])),
                         group_by="contexts", group_fn=lambda r: r[1] + r[2][:-1])
        results: list[tuple[float, bool]] = []
        for chunk in order.get_batched(n=self.batch):
            scored = max(len(continuation) for _, _, continuation in chunk)
            if scored > self.max_length:
                raise InputError(f"a continuation of {scored} tokens is longer than the {self.max_length} tokens "
                                 "the model is given")
            windows = [(context + continuation)[-(self.max_length + 1):] for _, context, continuation in chunk]
            scores = _score(self.decoder, [w[:-1] for w in windows], [w[1:] for w in windows], scored, self.pad_id)
            for row, (strings, context, continuation) in enumerate(chunk):
                # Collator.get_cache yields every request of the row's group (its own continuation); the "logits"
                # it passes through are not used here, the row's scores answer for any last token.
                for member_strings, member_continuation, _ in order.get_cache(
                        req_str=strings, cxt_toks=context, cont_toks=continuation, logits=_Expandable()):
                    answer = scores.answer(row, member_continuation)
                    results.append(answer)
                    if member_strings is not None:
                        self.cache_hook.add_partial("loglikelihood", member_strings, answer)
        return order.get_original(results)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of each whole text in lm-eval's disjoint rolling windows of max_length tokens, the
        first conditioned on the prefix token (BOS, else EOS)."""
        windows, owners = [], []
        for index, (text,) in enumerate(request.args for request in requests):
            for context, continuation in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (logprob, _) in zip(owners, self._loglikelihood_tokens(windows, disable_tqdm)):
            totals[owner] += logprob
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations until a stop string (and the EOS text), a stop id or max_gen_toks, cut before the
        first stop string; batches of requests with the same generation settings, longest context first."""
        del disable_tqdm
        order = Collator([request.args for request in requests], sort_fn=lambda r: (-len(self.tok_encode(r[0])), r[0]),
                         group_by="gen_kwargs", group_fn=lambda r: r[1])
        eos_text = self.tokenizer.decode(self.eot_token_id, skip_special_tokens=False)
        results: list[str] = []
        for chunk in order.get_batched(n=self.batch):
            contexts = [context for context, _ in chunk]
            settings = normalize_gen_kwargs(chunk[0][1], self.max_gen_toks)
            _refuse_sampling(settings)
            until = handle_stop_sequences(settings["until"], eos=eos_text)
            new_tokens = int(settings["max_gen_toks"])
            room = self.max_length - new_tokens
            if room < 1:
                raise InputError(f"the task asks for up to {new_tokens} generated tokens, which leaves no room for "
                                 f"its prompt in the model's {self.max_length} tokens")
            prompts = [self.tok_encode(context)[-room:] for context in contexts]
            for context, tokens in zip(contexts, self._generate(prompts, until, new_tokens)):
                text = postprocess_generated_text(self.tokenizer.decode(tokens, skip_special_tokens=True),
                                                  stop=until, think_end_token=None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, chunk[0][1]), text)
        return order.get_original(results)

    def _generate(self, prompts: list[list[int]], until: list[str], new_tokens: int) -> list[list[int]]:
        """Per prompt, the greedy tokens up to a stop id (excluded), or up to the step where a stop string
        appeared in the row's text (HFLM's stopping criteria stop the row there too), or ``new_tokens``."""
        out: list[list[int]] = [[] for _ in prompts]
        done = np.zeros(len(prompts), bool)
        for step, (tokens, _, _) in enumerate(greedy_loop(self.decoder, prompts, self.stop_ids, self.pad_id), 1):
            for row, token in enumerate(tokens.tolist()):
                if done[row]:
                    continue
                if token < 0:
                    done[row] = True
                    continue
                out[row].append(token)
                text = self.tokenizer.decode(out[row], skip_special_tokens=False)
                done[row] = any(stop and stop in text for stop in until)
            if done.all() or step == new_tokens:
                break
        return out


class _Expandable:
    """What Collator.get_cache passes through for each request of a group: it only calls expand and chunk."""

    def expand(self, *_):
        return self

    def chunk(self, n: int) -> list[_Expandable]:
        return [self] * n


def _refuse_sampling(settings: dict) -> None:
    if settings.get("do_sample"):
        raise InputError(f"the task asks for sampling ({_shown(settings)}): dstc scores tasks with greedy decoding "
                         "only")
    if int(settings.get("num_beams", 1)) != 1:
        raise InputError(f"the task asks for beam search ({_shown(settings)}): dstc scores tasks with greedy "
                         "decoding only")
    other = sorted(set(settings) - GREEDY_IGNORES - {"num_beams"})
    if other:
        raise InputError(f"the task sets generation options dstc's greedy decoding does not apply: "
                         f"{', '.join(other)} ({_shown(settings)})")


def _shown(settings: dict) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in settings.items() if key != "until")


# -- tasks from local data ---------------------------------------------------------------------------------------


def _split_files(directory: Path, split: str) -> list[Path]:
    return [directory / f"{split}{suffix}" for suffix in BUILDERS if (directory / f"{split}{suffix}").is_file()]


def _readable(task: str, path: Path) -> Path:
    """``path``, if it is not empty and is what its suffix says (UTF-8 text for JSON, Parquet's magic number at both
    ends): else an InputError, rather than what datasets raises on it (StopIteration on an empty file, ArrowInvalid
    on a file that is not Parquet)."""
    where = f"task {task}: {path}"
    try:
        size = path.stat().st_size
        if size == 0:
            raise InputError(f"{where} is empty")
        with open(path, "rb") as f:
            head = f.read(1 << 16)
            if path.suffix == ".parquet":  # "PAR1" at both ends; what is between, datasets reads
                f.seek(max(size - 4, 0))
                if size < 12 or not head.startswith(b"PAR1") or f.read(4) != b"PAR1":
                    raise InputError(f"{where} is not a Parquet file (no PAR1 at its start and end)")
                return path
    except OSError as exc:
        raise InputError(f"{where} cannot be read: {exc.strerror}") from None
    text: str | None
    try:  # a multi-byte character cut at the end of what was read is still text
        text = codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) == size)
    except UnicodeDecodeError:
        text = None
    if text is None or "\0" in text:
        raise InputError(f"{where} is binary, not UTF-8 JSON")
    if not text.strip():
        raise InputError(f"{where} holds only whitespace, no examples")
    return path


def _local_config(manager, name: str, task_data: Path, num_fewshot: int | None, cache_dir: str,
                  log: Callable[[str], None]) -> dict:
    """The task's config with its dataset read from ``task_data/<name>/<split>.<suffix>``."""
    from lm_eval.tasks._index import Kind
    from lm_eval.tasks._yaml_loader import load_yaml

    entry = manager.task_index.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, manager.all_subtasks, n=3)
        raise InputError(f"unknown lm-eval task {name!r}" + (f"; close: {', '.join(close)}" if close else ""))
    if entry.kind in (Kind.GROUP, Kind.TAG):
        raise InputError(f"{name!r} is an lm-eval {entry.kind.name.lower()} of several tasks: name its tasks, each "
                         f"with its data under {task_data}")
    if entry.kind != Kind.TASK or entry.yaml_path is None:
        raise InputError(f"lm-eval task {name!r} is defined in Python, with its own data loading: dstc scores "
                         "tasks defined by YAML configs, whose datasets it reads from local files")
    config = load_yaml(entry.yaml_path, resolve_func=True)
    if config.get("custom_dataset") is not None:
        raise InputError(f"lm-eval task {name!r} builds its dataset in Python (custom_dataset): dstc reads task "
                         "data from local files only")
    # The few-shot count simple_evaluate will set: a task config's 0 stands, else the caller's, else the
    # config's default.
    shots = 0 if config.get("num_fewshot") == 0 else num_fewshot if num_fewshot is not None else \
        config.get("num_fewshot") or 0
    fewshot = dict(config.get("fewshot_config") or {})
    fewshot_split = fewshot.get("split") or config.get("fewshot_split")
    evaluated = config.get("test_split") or config.get("validation_split")
    if evaluated is None:
        raise InputError(f"lm-eval task {name!r} has neither a test nor a validation split")
    needed = [evaluated]
    if shots and fewshot_split:
        needed.append(fewshot_split)
    elif shots and fewshot.get("samples") is None:
        source = config.get("training_split") or config.get("validation_split")
        if source is not None:
            needed.append(source)
    directory = task_data / name
    schema = f"the schema of {config.get('dataset_path')}" + \
        (f" ({config['dataset_name']})" if config.get("dataset_name") else "")
    files: dict[str, Path] = {}
    for split in dict.fromkeys(s for s in (*needed, config.get("training_split"), config.get("validation_split"),
                                           fewshot_split) if s):
        found = _split_files(directory, split)
        if len(found) > 1:
            raise InputError(f"task {name}: {' and '.join(map(str, found))} are both the {split} split; keep one")
        if found:
            files[split] = _readable(name, found[0])
        elif split in needed:
            role = "" if split == evaluated else f" (its {shots}-shot examples)"
            raise InputError(f"task {name}: no {split} split{role}: expected {directory / split}.jsonl (or .json, "
                             f".parquet) in {schema}")
    builders = {BUILDERS[path.suffix] for path in files.values()}
    if len(builders) > 1:
        raise InputError(f"task {name}: its splits mix JSON and Parquet files ({', '.join(map(str, files.values()))})"
                         "; give them in one format")
    for key in ("training_split", "validation_split", "test_split", "fewshot_split"):
        if config.get(key) not in files:
            config[key] = None  # a split with no file, and not needed: no docs, rather than a hub download
    if fewshot.get("split") not in files and "split" in fewshot:
        fewshot["split"] = None
        config["fewshot_config"] = fewshot
    config.update(dataset_path=builders.pop(), dataset_name=None,
                  dataset_kwargs={"data_files": {split: str(path) for split, path in files.items()},
                                  "cache_dir": cache_dir})
    log(f"{name}: {', '.join(f'{split} {path}' for split, path in files.items())} ({shots}-shot)")
    return config


@functools.cache
def _task_folders() -> dict[str, frozenset[Path]]:
    """Task name -> the folders of lm-eval's task configs that declare it (``task: NAME``), from a text search of its
    14k YAML files (1 s) rather than by parsing them all (25 s)."""
    declared = re.compile(r"^task:\s*['\"]?([^'\"\s]+)['\"]?\s*$", re.M)
    folders: dict[str, set[Path]] = {}
    for path in _task_configs():
        for name in declared.findall(path.read_text(errors="replace")):
            folders.setdefault(name, set()).add(path.parent)
    return {name: frozenset(found) for name, found in folders.items()}


def _task_configs() -> list[Path]:
    import lm_eval.tasks

    return sorted(Path(lm_eval.tasks.__file__).parent.rglob("*.yaml"))


def _task_manager(names: list[str]):
    """lm-eval's TaskManager over the folders of the configs that declare these tasks. A name no config declares
    but some config mentions (a group, a tag) takes the whole index, which tells them apart; one mentioned nowhere
    is unknown."""
    from lm_eval.tasks import TaskManager

    folders = _task_folders()
    missing = [name for name in names if name not in folders]
    if not missing:
        return TaskManager(include_defaults=False, include_path=sorted(set().union(*(folders[n] for n in names))))
    texts = [path.read_text(errors="replace") for path in _task_configs()]
    for name in missing:
        word = re.compile(rf"(?<![\w-]){re.escape(name)}(?![\w-])")
        if not any(word.search(text) for text in texts):
            close = difflib.get_close_matches(name, list(folders), n=3)
            raise InputError(f"unknown lm-eval task {name!r}" + (f"; close: {', '.join(close)}" if close else ""))
    return TaskManager()


def _tasks(tasks: Sequence[str], task_data: Path, limit: int | None):
    """The task names (deduplicated), the data directory and lm-eval's TaskManager over them; what is wrong with
    them, an InputError."""
    _offline()
    names = list(dict.fromkeys(tasks))
    if not names:
        raise InputError("no task named")
    if limit is not None and limit < 1:
        raise InputError(f"limit must be at least 1 example, not {limit}")
    task_data = Path(task_data)
    if not task_data.is_dir():
        raise InputError(f"{task_data} is not a directory (expected one folder of data files per task)")
    return names, task_data, _task_manager(names)


def check_tasks(tasks: Sequence[str], task_data: Path, *, limit: int | None = None,
                num_fewshot: int | None = None) -> None:
    """What :func:`evaluate_lm` would find wrong with the tasks and their data, found before any model runs: each
    task loaded from its files and its requests built (the prompts of the examples scored, with their few-shot
    examples), as simple_evaluate does. Anything wrong is an InputError naming the task and its files."""
    names, task_data, manager = _tasks(tasks, task_data, limit)
    with tempfile.TemporaryDirectory(prefix="dstc-tasks-") as cache_dir:
        for name in names:
            config = _local_config(manager, name, task_data, num_fewshot, cache_dir, lambda _: None)
            _requests(_load(manager, config), config, limit, num_fewshot)


def _requests(task, config: dict, limit: int | None, num_fewshot: int | None) -> None:
    """The task's requests built as simple_evaluate builds them (its few-shot count and seed): a field of the wrong
    type, or missing from an example after the first, fails here."""
    from lm_eval.defaults import DEFAULT_OTHER_SEED  # simple_evaluate's default fewshot_random_seed
    from lm_eval.evaluator_utils import get_sample_size

    try:
        if num_fewshot is not None and task.get_config("num_fewshot") != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=DEFAULT_OTHER_SEED)
        task.build_all_requests(limit=get_sample_size(task, limit))
    except InputError:
        raise
    except Exception as exc:  # lm-eval's prompt code on the user's data: anything it raises is the data's fault
        files = ", ".join(config["dataset_kwargs"]["data_files"].values())
        first = (str(exc).splitlines() or [""])[0]
        raise InputError(f"task {config['task']}: its data ({files}) does not make the task's prompts: "
                         f"{type(exc).__name__}: {first}") from exc


def evaluate_lm(lm, tasks: Sequence[str], task_data: Path, *, limit: int | None = None,
                num_fewshot: int | None = None, log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """Scores of any lm-eval LM (DecoderLM, HFLM) on the named tasks with their data from ``task_data`` (see the
    module's docstring): lm-eval's simple_evaluate, its metrics and standard errors."""
    from lm_eval import simple_evaluate

    names, task_data, manager = _tasks(tasks, task_data, limit)
    # datasets keeps Arrow copies of the files, read while the tasks run: in a directory of this call's own.
    with tempfile.TemporaryDirectory(prefix="dstc-tasks-") as cache_dir:
        loaded = [_load(manager, _local_config(manager, name, task_data, num_fewshot, cache_dir, log))
                  for name in names]
        results = simple_evaluate(model=lm, tasks=loaded, num_fewshot=num_fewshot, limit=limit, log_samples=False,
                                  task_manager=manager)
    return {name: _task_scores(results, name) for name in names}


def _load(manager, config: dict):
    """The lm-eval Task of a config; data that does not parse, or lacks a field the task's prompt reads (lm-eval
    renders the first example when it builds the task), is an InputError naming the files."""
    try:
        return manager.load([config])["tasks"][config["task"]]
    except InputError:
        raise
    except Exception as exc:  # datasets and lm-eval reading the user's files: anything they raise is the data's fault
        files = ", ".join(config["dataset_kwargs"]["data_files"].values())
        first = (str(exc.__cause__ or exc).splitlines() or [""])[0]
        raise InputError(f"task {config['task']}: its data ({files}) does not load: {first}") from exc


def _task_scores(results: dict, name: str) -> dict[str, Any]:
    values = results["results"][name]
    metrics = {key: float(v) for key, v in values.items() if "," in key and "_stderr," not in key}
    stderr = {}
    for key in metrics:
        metric, _, flt = key.partition(",")
        error = values.get(f"{metric}_stderr,{flt}")
        stderr[key] = float(error) if isinstance(error, (int, float)) else None  # lm-eval writes "N/A"
    counts = results["n-samples"][name]
    return {"metrics": metrics, "stderr": stderr, "samples": int(counts["effective"]),
            "samples_total": int(counts["original"]), "num_fewshot": int(results["n-shot"][name]),
            "version": results["versions"][name], "higher_is_better": dict(results["higher_is_better"][name])}


def score_tasks(decoder: Decoder, tokenizer, tasks: Sequence[str], task_data: Path, *, max_length: int,
                limit: int | None = None, num_fewshot: int | None = None, batch: int = 8,
                stop_ids: Sequence[int] | None = None,
                log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """lm-eval's scores of a Decoder (an artifact's or the reference's) on the named tasks, with their data from
    ``task_data`` (see the module's docstring). ``max_length``: the model's context in tokens (the longest input
    scored; rolling windows are this long). ``limit``: the first examples of each task only."""
    lm = DecoderLM(decoder, tokenizer, max_length=max_length, batch=batch, stop_ids=stop_ids)
    return evaluate_lm(lm, tasks, task_data, limit=limit, num_fewshot=num_fewshot, log=log)
