"""Standard tasks in `dstc eval`: the artifact and its reference scored by lm-evaluation-harness on the same local
task data (toolchain/evaluate/harness.py), the reference's scores kept in the reference cache, and each task's
metrics in the report beside the reference's, with the harness's standard errors and the drop in points."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from toolchain.errors import InputError
from toolchain.report.schema import Metric
from toolchain.settings.evaluation import EvalSettings


def task_files(task_data: Path) -> dict[str, str]:
    """sha256 of every file below ``task_data`` by relative path: what the task scores depend on, of the data."""
    if not task_data.is_dir():
        raise InputError(f"--task-data {task_data} is not a directory (task_data/<task>/<split>.jsonl)")
    return {str(p.relative_to(task_data)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(task_data.rglob("*")) if p.is_file()}


def check(settings: EvalSettings) -> None:
    """The settings' tasks and their data checked before any model runs (toolchain/evaluate/harness.py
    check_tasks): what is wrong is an InputError now, not after the reference has run."""
    if not settings.tasks:
        return
    # lm-evaluation-harness loads only when tasks are scored
    from toolchain.evaluate.harness import check_tasks

    check_tasks(settings.tasks, Path(str(settings.task_data)), limit=settings.task_limit,
                num_fewshot=settings.num_fewshot)


def score(decoder, tokenizer, settings: EvalSettings, *, max_length: int, stop_ids: list[int],
          log: Callable[[str], None]) -> dict[str, dict]:
    # lm-evaluation-harness loads only when tasks are scored
    from toolchain.evaluate.harness import score_tasks

    return score_tasks(decoder, tokenizer, settings.tasks, Path(str(settings.task_data)), max_length=max_length,
                       limit=settings.task_limit, num_fewshot=settings.num_fewshot, batch=settings.batch,
                       stop_ids=stop_ids, log=log)


def _name(task: str, key: str) -> str:
    metric, _, filtered = key.partition(",")
    return f"{task}/{metric}" + ("" if filtered in ("", "none") else f",{filtered}")


def task_metrics(scores: dict[str, dict], reference: dict[str, dict]) -> dict[str, Metric]:
    """``<task>/<metric>`` for every metric the harness gave (the reference's value beside it, the standard error),
    and ``<task>/drop``: the points lost on the task's first higher-is-better metric against the reference."""
    metrics: dict[str, Metric] = {}
    for task, result in scores.items():
        ref = reference.get(task, {})
        better = result.get("higher_is_better", {})
        primary = None
        for key, value in result["metrics"].items():
            higher = better.get(key.partition(",")[0])
            if value is None or isinstance(value, str):
                continue
            if primary is None and higher:
                primary = key
            metrics[_name(task, key)] = Metric(
                value=float(value), unit="", direction="higher" if higher else "lower" if higher is False else "none",
                reference=ref.get("metrics", {}).get(key), stderr=result.get("stderr", {}).get(key),
                description=f"lm-eval {task} {key} ({result['samples']} of {result['samples_total']} examples, "
                            f"{result['num_fewshot']}-shot)")
        if primary is not None:
            value, base = result["metrics"][primary], ref.get("metrics", {}).get(primary)
            metrics[f"{task}/drop"] = Metric(
                value=None if base is None else 100 * (base - value), unit="points", direction="lower",
                description=f"{task} {primary} points lost against the fp32 reference")
    return metrics
