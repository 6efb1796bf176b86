"""Which PyTorch reference an artifact is measured against: the checkpoint its manifest names, checked against the
source hashes it recorded (the reference itself runs in toolchain/reference/layered.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from toolchain import source as sources
from toolchain.errors import InputError
from toolchain.source_hashes import checkpoint_hashes

if TYPE_CHECKING:
    from toolchain.manifest_schema import Manifest


def source_changes(manifest: Manifest, source: sources.Source) -> list[str]:
    """How the checkpoint at ``source`` differs from the files the artifact was built from ([] when identical)."""
    recorded = manifest.source.files
    actual = checkpoint_hashes(source.path)
    changes = [f"changed {n}" for n in sorted(recorded) if n in actual and actual[n] != recorded[n]]
    changes += [f"missing {n}" for n in sorted(set(recorded) - set(actual))]
    changes += [f"extra {n}" for n in sorted(set(actual) - set(recorded))]
    return changes


def resolve_reference(manifest: Manifest | None, override: str | None) -> tuple[sources.Source, dict]:
    """The checkpoint an artifact was built from (its manifest's model and pinned revision), checked against the
    source hashes the manifest recorded; or ``override``, used as given. Returns the source and what the report
    records of the choice."""
    if override:
        source = sources.resolve(override, hint="--reference MODEL")
        changes = source_changes(manifest, source) if manifest and manifest.source.files else None
        return source, {"override": True, "matches_build_source": None if changes is None else not changes}
    if manifest is None or not manifest.source.model:
        raise InputError("the artifact has no manifest.json naming its source model: pass --reference MODEL")
    src = manifest.source
    source = sources.resolve(src.model, revision=src.revision, hint="--reference MODEL")
    changes = source_changes(manifest, source)
    if changes:
        raise InputError(f"the checkpoint now at {source.path} is not the one the artifact was built from "
                         f"({', '.join(changes[:3])}{' ...' if len(changes) > 3 else ''}); pass --reference "
                         f"{src.model} to evaluate against it anyway")
    return source, {"override": False, "matches_build_source": True}
