"""A streamed compression split into parts by ranges of decoder layers, each part written by a process of its own
(a Ray task, perhaps on another node: toolchain/distributed/ray_parts.py), and the parts assembled into the files
the single-process streamed compression writes, byte for byte.

Why the bytes are the same. The weights file of a streamed compression (toolchain/export/graph.py save_graph,
onnx-ir's writer) holds each tensor above 1 KiB at an offset that depends only on the sizes of the tensors before
it, in initializer order, and each tensor's bytes depend only on the export and the checkpoint (one weight's
quantization reads no other weight). So each part plans the whole compression as the stage does (a graph of lazy
tensors: nothing is computed by planning), computes and writes only its own tensors, packed in the file's order,
and the assembly writes the graph file with the single-process offsets (save_graph_references) and copies each
tensor's bytes from its part.

The ranges. The export's weights carry their decoder layer (``dstc.layer``) and role: a part is a contiguous run of
[embeddings, layer 0, ..., layer L-1, the weights outside the layers (final norm, lm_head)], cut where the float32
bytes of its weights reach their share. A written tensor goes with the export weight whose name its own extends
(the compression names what it makes of a weight ``<weight>_<what>``); one that extends none goes with the weights
outside the layers. How the ranges are cut changes how long each part takes, never the bytes.

A part is written under a temporary name and renamed into place (onnx-ir's writer), and its task returns its size
and BLAKE3; the assembly checks both before it reads a byte of it, so a part a dead writer left half-written, or
one changed since, is never used.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import onnx_ir as ir

from toolchain.errors import DstcError
from toolchain.export.graph import EXTERNAL_THRESHOLD_BYTES, save_graph_references
from toolchain.hashing import blake3_file
from toolchain.interface.graph import LAYER, ROLE
from toolchain.recipe import CompressSection

Log = Callable[[str], None]
BEFORE, AFTER = -1, math.inf  # the embeddings' place among the layers, and the other weights outside them
COPY_BYTES = 16 << 20


@dataclass(frozen=True)
class Part:
    """One range of layers: the tensors of the weights file it writes, in the file's order."""

    index: int
    count: int
    what: str  # "embeddings, layers 0-3"
    names: tuple[str, ...]

    @property
    def title(self) -> str:
        return f"part {self.index + 1}/{self.count} ({self.what})"


@dataclass(frozen=True)
class PartTask:
    """What a part's process needs (it plans the compression again from the same inputs): picklable."""

    export_dir: Path
    source: Path
    section: CompressSection
    target: str
    part: Part
    path: Path


@dataclass(frozen=True)
class PartFile:
    """A written part, as its task saw it, and the errors of the weights it computed."""

    path: Path
    size: int
    blake3: str
    seconds: float
    stats: dict[str, dict] = field(default_factory=dict)  # weight name -> its job's stats
    expert_stats: dict[str, dict] = field(default_factory=dict)  # stacked experts' name -> their job's stats


class PartRunner(Protocol):
    """Runs the parts' tasks somewhere (``work`` is the stage's function that writes one part); ``count``: how
    many parts to cut."""

    count: int

    def run(self, work: Callable[[PartTask, Log], PartFile], tasks: list[PartTask], log: Log) -> list[PartFile]: ...


def _initializers(model: ir.Model) -> dict[str, ir.Value]:
    return {v.name: v for graph in model.graphs() for v in graph.initializers.values() if v.name}


def weight_places(model: ir.Model) -> dict[str, tuple[float, int]]:
    """Each export weight's place among the layers (BEFORE, its layer, AFTER) and its float32 bytes: read before
    the compression replaces the weights."""
    places = {}
    for name, value in _initializers(model).items():
        tensor = value.const_value
        if tensor is None:
            continue
        layer = tensor.metadata_props.get(LAYER)
        place = float(layer) if layer is not None else \
            BEFORE if tensor.metadata_props.get(ROLE) == "embeddings" else AFTER
        places[name] = (place, tensor.size * 4)
    return places


def _owner(name: str, places: dict) -> str | None:
    """The export weight whose name ``name`` extends at a "_" (or is), or None."""
    while name not in places:
        name, sep, _ = name.rpartition("_")
        if not sep:
            return None
    return name


def written_names(model: ir.Model) -> list[str]:
    """The tensors of the weights file, in its order (save_graph's threshold, onnx-ir's order)."""
    return [name for name, v in _initializers(model).items()
            if v.const_value is not None and v.const_value.nbytes > EXTERNAL_THRESHOLD_BYTES]


def plan_parts(places: dict[str, tuple[float, int]], names: list[str], count: int) -> list[Part]:
    """At most ``count`` parts over the weights file's tensors ``names``, each a contiguous range of places with
    about an equal share of the export's float32 weight bytes."""
    place_of: dict[str, float] = {}
    cost: dict[float, int] = {}
    counted: set[str] = set()
    for name in names:
        owner = _owner(name, places)
        place_of[name] = places[owner][0] if owner else AFTER
        if owner and owner not in counted:
            counted.add(owner)
            cost[place_of[name]] = cost.get(place_of[name], 0) + places[owner][1]
        cost.setdefault(place_of[name], 0)
    order = sorted(cost)
    count = max(1, min(count, len(order)))
    total = sum(cost.values()) or 1
    ranges: list[list[float]] = [[]]
    done = 0
    for i, place in enumerate(order):
        needed = count - len(ranges)  # parts still to start
        boundary = total * len(ranges) / count
        if ranges[-1] and needed and (done + cost[place] / 2 > boundary or len(order) - i <= needed):
            ranges.append([])
        ranges[-1].append(place)
        done += cost[place]
    index = {place: i for i, places_ in enumerate(ranges) for place in places_}
    return [Part(i, len(ranges), _describe(places_), tuple(n for n in names if index[place_of[n]] == i))
            for i, places_ in enumerate(ranges)]


def _describe(places: list[float]) -> str:
    layers = [int(p) for p in places if p not in (BEFORE, AFTER)]
    words = (["embeddings"] if BEFORE in places else []) + \
        ([f"layer{'s' if len(layers) > 1 else ''} {layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else "")]
         if layers else []) + (["weights outside the layers"] if AFTER in places else [])
    return ", ".join(words)


def write_part(model: ir.Model, part: Part, path: Path, log: Log) -> tuple[int, str]:
    """Compute ``part``'s tensors of the planned ``model`` and write them packed, in order, into ``path`` (under a
    temporary name, renamed once complete); its size and BLAKE3."""
    values = _initializers(model)
    tensors = [values[name].const_value for name in part.names]
    path.parent.mkdir(parents=True, exist_ok=True)
    done, step = [0], max(1, len(tensors) // 4)

    def progress(_tensor, _info) -> None:
        done[0] += 1
        if done[0] % step == 0 and done[0] < len(tensors):
            log(f"{part.title}: {done[0]} of {len(tensors)} tensors")

    # two threads, as the single-process save: NNCF's numpy on one tensor, another's beside it
    ir.external_data.convert_tensors_to_external(tensors, base_dir=path.parent, relative_path=path.name,  # type: ignore[arg-type]
                                                 callback=progress, max_workers=2)
    return path.stat().st_size, blake3_file(path)


def assemble(model: ir.Model, parts: list[Part], files: list[PartFile], path: Path) -> list[str]:
    """The graph file and weights file save_graph(model, path, external=True) writes, from the parts' files, each
    checked against the size and BLAKE3 its task returned; the files written."""
    for part, file in zip(parts, files, strict=True):
        actual = file.path.stat().st_size if file.path.is_file() else None
        if actual != file.size or blake3_file(file.path) != file.blake3:
            raise DstcError(f"{file.path}, {part.title} of the streamed compression, is not what its task wrote "
                            f"({'missing' if actual is None else f'{actual} bytes, {file.size} written'} or "
                            f"changed since); nothing is assembled from it")
    placed = save_graph_references(model, path)
    lengths = {name: length for name, _, length in placed}
    source: dict[str, tuple[Path, int]] = {}
    for part, file in zip(parts, files):
        offset = 0
        for name in part.names:
            source[name] = (file.path, offset)
            offset += lengths[name]
        if offset != file.size:
            raise DstcError(f"{file.path} holds {file.size} bytes where {part.title} has {offset}")
    if set(source) != set(lengths):
        raise DstcError(f"the parts hold other tensors than the weights file {path.name}.data")
    handles = {file.path: open(file.path, "rb") for file in files}  # noqa: SIM115  (closed below)
    try:
        with open(path.with_name(path.name + ".data"), "wb") as out:
            for name, _offset, length in placed:
                part_path, start = source[name]
                handle = handles[part_path]
                handle.seek(start)
                while length:
                    chunk = handle.read(min(COPY_BYTES, length))
                    out.write(chunk)
                    length -= len(chunk)
    finally:
        for handle in handles.values():
            handle.close()
    return [path.name, path.name + ".data"]

