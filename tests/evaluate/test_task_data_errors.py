"""Every problem of `--tasks` / `--task-data` (an unknown task, a missing split, a file that is empty, binary, not
JSON, not Parquet or damaged Parquet, or not in the task's schema) is one line on stderr, exit 2, before the
reference runs (no reference cache entry is written): `dstc eval` checks the tasks, loads their data and builds their
prompts before anything else; `dstc build` does it for a recipe's eval tasks before the first stage."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from cli_helpers import assert_one_line_error, run_cli

from toolchain.evaluate.harness import check_tasks

GOOD = [{"id": f"q{i}", "question": f"Where is the book number {i}?",
         "choices": {"text": ["on the shelf.", "in the river."], "label": ["A", "B"]}, "answerKey": "A"}
        for i in range(6)]


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def parquet(rows: list[dict]) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue().to_pybytes()


# problem -> (the --tasks value, the files under --task-data, what the error line says)
PROBLEMS = {
    "unknown-task": ("arc_eazy", {"arc_easy/test.jsonl": jsonl(GOOD)}, "unknown lm-eval task 'arc_eazy'; close: "),
    "missing-split": ("arc_easy", {"arc_easy/train.jsonl": jsonl(GOOD)}, "task arc_easy: no test split: expected "),
    "no-directory": ("arc_easy", None, "is not a directory"),
    "empty": ("arc_easy", {"arc_easy/test.jsonl": b""}, "arc_easy/test.jsonl is empty"),
    "blank": ("arc_easy", {"arc_easy/test.jsonl": b"\n \n"}, "arc_easy/test.jsonl holds only whitespace"),
    "binary": ("arc_easy", {"arc_easy/test.jsonl": random.Random(0).randbytes(4096)},
               "arc_easy/test.jsonl is binary, not UTF-8 JSON"),
    "not-json": ("arc_easy", {"arc_easy/test.jsonl": b'{"question": "Where was the book?", \n'},
                 "test.jsonl) does not load: JSON parse error"),
    "wrong-schema": ("arc_easy", {"arc_easy/test.jsonl": jsonl([{"text": "Alice found the red book."}])},
                     "test.jsonl) does not load: 'question' is undefined"),
    # the first example renders; the fourth has choices of the wrong type, the fifth an answer not among them
    "wrong-type": ("arc_easy", {"arc_easy/test.jsonl": jsonl([*GOOD[:3], {**GOOD[3], "choices": 5}])},
                   "test.jsonl) does not make the task's prompts: UndefinedError: 'int object' has no attribute"),
    "bad-answer": ("arc_easy", {"arc_easy/test.jsonl": jsonl([*GOOD[:4], {**GOOD[4], "answerKey": "Z"}])},
                   "test.jsonl) does not make the task's prompts: ValueError: 'Z' is not in list"),
    "empty-parquet": ("arc_easy", {"arc_easy/test.parquet": b""}, "arc_easy/test.parquet is empty"),
    "not-parquet": ("arc_easy", {"arc_easy/test.parquet": jsonl(GOOD)},
                    "arc_easy/test.parquet is not a Parquet file (no PAR1"),
    "binary-parquet": ("arc_easy", {"arc_easy/test.parquet": random.Random(1).randbytes(4096)},
                       "arc_easy/test.parquet is not a Parquet file (no PAR1"),
    "bad-parquet": ("arc_easy", {"arc_easy/test.parquet": b"PAR1" + random.Random(2).randbytes(4096) + b"PAR1"},
                    "test.parquet) does not load: "),
    "parquet-wrong-schema": ("arc_easy", {"arc_easy/test.parquet": parquet([{"text": "Alice found the book."}])},
                             "test.parquet) does not load: 'question' is undefined"),
}


def task_data(root: Path, files: dict[str, bytes] | None) -> Path:
    data = root / "tasks"
    if files is None:
        data.write_text("not a directory\n")
    for name, content in (files or {}).items():
        (data / name).parent.mkdir(parents=True, exist_ok=True)
        (data / name).write_bytes(content)
    return data


@pytest.fixture(scope="module")
def qwen(artifact) -> Path:
    return artifact("r1-distill-qwen-tiny", "onnxruntime").path


def test_good_task_data_passes_the_check(tmp_path):
    for files in ({"arc_easy/test.jsonl": jsonl(GOOD)}, {"arc_easy/test.parquet": parquet(GOOD)}):
        check_tasks(["arc_easy"], task_data(tmp_path / next(iter(files)).rsplit(".", 1)[1], files), limit=5)


@pytest.mark.parametrize("problem", PROBLEMS)
def test_a_task_data_problem_is_one_line_before_the_reference_runs(problem, qwen, tmp_path, monkeypatch, capsys):
    tasks, files, said = PROBLEMS[problem]
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, err = run_cli(monkeypatch, capsys, "eval", qwen, "--tasks", tasks, "--task-data", task_data(tmp_path, files),
                        "--task-limit", "5", "--texts", "2", "--problems", "2", "--greedy-prompts", "0",
                        "--no-latency", "-o", tmp_path / "out")
    assert_one_line_error(code, err, said)
    assert "reference:" not in err  # the reference was neither computed nor read
    assert not (tmp_path / "cache" / "references").exists() and not (tmp_path / "out").exists()


def test_a_recipes_task_data_problem_is_one_line_before_the_first_stage(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    data = task_data(tmp_path, {"arc_easy/test.jsonl": b""})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({"name": "r", "model": "r1-distill-qwen-tiny", "export": {"parity": []},
                                      "compile": {"backend": "onnxruntime", "verify": False},
                                      "eval": {"tasks": ["arc_easy"], "task_data": str(data), "latency": False}}))
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "art")
    assert_one_line_error(code, err, "arc_easy/test.jsonl is empty")
    assert not (tmp_path / "cache" / "stages").exists() and not (tmp_path / "art").exists()
