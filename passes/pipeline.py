"""Run a list of registered passes on a model, with per-pass stats, expectations and final validation."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from functools import partial

import onnx_ir as ir

from passes.errors import PassError, PassValidationError
from passes.expectations import check_expectation, parse_expectations
from passes.graph import count_nodes
from passes.registry import create_pass, get_pass
from passes.validation import validate_model


@dataclasses.dataclass
class PassStats:
    """What one pass run did; ``to_dict`` gives plain JSON-ready data (for passes.json)."""

    name: str
    modified: bool
    counts: dict[str, int]
    nodes_before: int
    nodes_after: int
    seconds: float

    def to_dict(self) -> dict[str, object]:
        return dataclasses.asdict(self)


def run_pass(name: str, pass_: ir.passes.PassBase, model: ir.Model) -> PassStats:
    """Run one pass in place; any failure becomes a :class:`PassError` naming it."""
    nodes_before = count_nodes(model)
    start = time.perf_counter()
    try:
        result = pass_(model)
    except PassError as e:
        e.pass_name = e.pass_name or name
        raise
    except Exception as e:
        raise PassError(f"pass {name!r} failed: {type(e).__name__}: {e}", pass_name=name) from e
    seconds = time.perf_counter() - start
    if result.model is not model:
        raise PassError(f"pass {name!r} is not in-place; pipelines need in-place passes", pass_name=name)
    counts = dict(getattr(result, "counts", {}))
    return PassStats(name, bool(result.modified), counts, nodes_before, count_nodes(model), seconds)


def run_pipeline(
    model: ir.Model,
    pass_names: Sequence[str],
    *,
    expectations: Mapping[str, Mapping[str, object]] | None = None,
    validate: bool = True,
) -> list[PassStats]:
    """Run the named passes on ``model`` in place, in order, and return one :class:`PassStats` per run.

    ``expectations`` (e.g. ``{"fold-batchnorm": {"min": 2}}``) are checked after the last run of each named
    pass; a shortfall raises ``ExpectationError`` with the pass's closest near-miss. With ``validate``, the
    result must pass the ONNX checker and strict shape inference; if it does not, the pipeline is replayed on
    a copy of the input (taken up front; tensors are shared, so it is cheap) to name the pass that broke it.
    """
    infos = [get_pass(name) for name in pass_names]  # unknown names fail before anything changes
    checks = parse_expectations(expectations, pass_names)
    last_run = {info.name: i for i, info in enumerate(infos)}
    original = model.clone() if validate else None
    totals: dict[str, Counter] = {}
    stats = []
    for i, info in enumerate(infos):
        pass_ = info.factory()
        stat = run_pass(info.name, pass_, model)
        stats.append(stat)
        totals.setdefault(info.name, Counter()).update(stat.counts)
        if info.name in checks and last_run[info.name] == i:
            near_misses = getattr(pass_, "near_misses", None)
            check_expectation(
                info.name, checks[info.name], totals[info.name], partial(near_misses, model) if near_misses else list
            )
    if original is not None:
        try:
            validate_model(model)
        except PassValidationError as e:
            raise _blame(original, pass_names, e) from e
    return stats


def _blame(original: ir.Model, pass_names: Sequence[str], error: PassValidationError) -> PassValidationError:
    """Replay the pipeline on ``original``, validating after each pass, to name the first pass that breaks it."""
    try:
        validate_model(original)
    except PassValidationError as e:
        return PassValidationError(f"the input model is invalid before any pass ran: {e}")
    for name in pass_names:
        create_pass(name)(original)
        try:
            validate_model(original)
        except PassValidationError as e:
            return PassValidationError(f"the model is invalid after pass {name!r}: {e}", pass_name=name)
    last = pass_names[-1] if pass_names else None
    return PassValidationError(
        f"the model is invalid after the pipeline (replay did not reproduce it; last pass {last!r}): {error}",
        pass_name=last,
    )
