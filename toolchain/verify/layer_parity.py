"""Parity layer by layer: each exported decoder layer against transformers' own layer module, on the same inputs,
for models whose whole fp32 reference does not fit in memory.

The saved graph is cut into pieces by the exporter's scope names (toolchain/export/graph.py): the prologue
(embedding, RoPE tables, attention mask), ``layers.N/...`` for each layer and the epilogue (final norm, lm_head).
Each piece is a small ONNX file beside model.onnx whose initializers still point into model.onnx.data, so a
runtime reads that piece's weights only. The reference is built one layer at a time from the checkpoint reader
(toolchain/export/reference.py), so the check holds one layer of each, whatever the model's size.

Each case (the export's parity prompts) is a prefill of the prompt and then ``steps`` single-token steps through
the KV cache. The tokens of those steps are fixed in advance (the prompt's own, cycled) rather than chosen
greedily, so that the layers can be checked one after another: layer N of the graph gets the hidden states the
reference's layer N got, at every step, and keeps its own KV cache (the exporter reorders MLA's RoPE dims, so the
reference's cache is not its). A piece passes when its outputs at every step and real position are within the
runtime's tolerance of the reference's range, as the end-to-end check judges logits.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch

from toolchain.checkpoint.reader import EMBEDDING, open_checkpoint
from toolchain.export import reference as ref
from toolchain.interface.graph import PRESENT_PREFIX, cache_dtype, cache_spec, onnx_inputs, present_of
from toolchain.reference.layered import additive_mask
from toolchain.runtime.engines import GraphRunner
from toolchain.runtime.generate import left_pad
from toolchain.verify.parity import Case, tolerance as parity_tolerance

PIECE_PREFIX = ".parity-piece-"
# a layer's fp32 reference module, or its graph piece on a runtime (which widens bf16-stored weights), one after
# the other: V2-Lite's MoE layer (64 experts, 2.2 GB in fp32) takes the export to 5.4 GiB (7.5 with both at once)
MEMORY_FACTOR = 3.0
GRAPH_TABLE = "embed_tokens.weight"  # the exporter's name for the embedding table


@dataclass
class Piece:
    scope: str
    nodes: list = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)  # values it reads from other pieces or the graph inputs
    outputs: list[str] = field(default_factory=list)  # values other pieces read, and graph outputs


def _scope(node: onnx.NodeProto) -> str:
    head = node.name.split("/", 1)[0]
    if head.startswith("layers."):
        return head
    return "epilogue" if head in ("norm", "lm_head") else "prologue"


def _widens_initializer(node: onnx.NodeProto, initializers: set[str]) -> bool:
    """A Cast of an initializer: how a bf16-stored weight is read (toolchain/export/graph.py)."""
    return node.op_type == "Cast" and node.domain in ("", "ai.onnx") and node.input[0] in initializers


def cut(graph: onnx.GraphProto) -> dict[str, Piece]:
    """The pieces of a graph the exporter wrote, by scope, each with its boundary values. The Cast that widens a
    bf16-stored weight goes into every piece that reads the weight (a tied embedding table is read by the
    prologue and the epilogue), so that weights stay initializers of their pieces, never values between them."""
    initializers = {t.name for t in graph.initializer}
    pieces: dict[str, Piece] = {}
    widened = {node.output[0]: node for node in graph.node if _widens_initializer(node, initializers)}
    casts: dict[str, set[str]] = {}  # piece -> the widened weights it has its Cast of
    for node in graph.node:
        if node.output[0] in widened:
            continue
        piece = pieces.setdefault(_scope(node), Piece(_scope(node)))
        for name in node.input:
            if name in widened and name not in casts.setdefault(piece.scope, set()):
                casts[piece.scope].add(name)
                piece.nodes.append(widened[name])
        piece.nodes.append(node)
    produced_in = {out: scope for scope, p in pieces.items() for n in p.nodes for out in n.output}
    for scope, piece in pieces.items():
        for node in piece.nodes:
            for name in node.input:
                if name and name not in initializers and name not in widened and produced_in.get(name) != scope \
                        and name not in piece.inputs:
                    piece.inputs.append(name)
                    if name in produced_in:
                        source = pieces[produced_in[name]]
                        if name not in source.outputs:
                            source.outputs.append(name)
    for output in graph.output:
        pieces[produced_in[output.name]].outputs.append(output.name)
    return pieces


def _write(model: onnx.ModelProto, piece: Piece, directory: Path) -> Path:
    """The piece as an ONNX file in the graph's directory (its external weights resolve to model.onnx.data)."""
    used = {name for node in piece.nodes for name in node.input}
    types = {v.name: v.type for v in [*model.graph.input, *model.graph.output, *model.graph.value_info]}

    def info(name: str) -> onnx.ValueInfoProto:
        value = onnx.ValueInfoProto(name=name)
        if name in types:
            value.type.CopyFrom(types[name])
        else:  # an intermediate value: every value between pieces is float
            value.type.tensor_type.elem_type = onnx.TensorProto.FLOAT
        return value

    graph = onnx.helper.make_graph(piece.nodes, piece.scope, [info(n) for n in piece.inputs],
                                   [info(n) for n in piece.outputs],
                                   [t for t in model.graph.initializer if t.name in used])
    path = directory / f"{PIECE_PREFIX}{piece.scope}.onnx"
    onnx.save(onnx.helper.make_model(graph, opset_imports=model.opset_import, ir_version=model.ir_version), str(path))
    return path


def _schedule(case: Case, steps: int, pad_id: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, mask, position ids) of the prefill and of each single-token step of a case, tokens fixed in advance."""
    ids, mask = left_pad(case.prompts, pad_id)
    out = [(ids, mask, np.clip(mask.cumsum(-1) - 1, 0, None))]
    for k in range(steps):
        mask = np.concatenate([mask, np.ones((len(mask), 1), np.int64)], axis=1)
        token = np.array([[p[k % len(p)]] for p in case.prompts], np.int64)
        out.append((token, mask, np.clip(mask.cumsum(-1) - 1, 0, None)[:, -1:]))
    return out


def _relative(reference: np.ndarray, candidate: np.ndarray, real: np.ndarray) -> float:
    """Largest |difference| over real (non-padding) positions, relative to the reference's range there."""
    ref, cand = reference[real], candidate[real]
    span = float(ref.max() - ref.min())
    return float(np.abs(ref - cand).max()) / span if span else 0.0


def _logits(hiddens: list[torch.Tensor], head: torch.Tensor, rows: int = 8192) -> list[np.ndarray]:
    """hidden @ head.T in fp32 for each of ``hiddens`` ([..., hidden]), the [vocab, hidden] head widened a block
    of rows at a time, once for all of them (widening it per step was most of the epilogue's check)."""
    flat = torch.cat([h.reshape(-1, h.shape[-1]) for h in hiddens])
    logits = torch.cat([flat @ head[start:start + rows].float().T for start in range(0, len(head), rows)], dim=-1)
    out, start = [], 0
    for h in hiddens:
        count = int(np.prod(h.shape[:-1]))
        out.append(logits[start:start + count].reshape(*h.shape[:-1], -1).numpy())
        start += count
    return out


@dataclass
class _Step:
    hidden: torch.Tensor  # the reference's hidden states entering the current layer
    rope: tuple  # the reference's position embeddings
    mask: torch.Tensor  # the reference's additive mask
    positions: torch.Tensor
    real: np.ndarray  # [batch, new] True at real (non-padding) positions
    shared: dict  # the graph prologue's outputs the layers read (RoPE tables, mask)


def compare_layers(graph_path: Path, source_path: Path, backend: str, cases: list[Case], steps: int, pad_id: int,
                   log: Callable[[str], None] = lambda _: None) -> dict:
    """Every piece of the graph at ``graph_path`` on ``backend`` against the reference built from the checkpoint
    at ``source_path``; the result has the keys export.json's parity entries have."""
    return compare_layers_on(graph_path, source_path, [backend], cases, steps, pad_id, log)[backend]


@torch.no_grad()
def compare_layers_on(graph_path: Path, source_path: Path, backends: Sequence[str], cases: list[Case], steps: int,
                      pad_id: int, log: Callable[[str], None] = lambda _: None) -> dict[str, dict]:
    """``compare_layers`` on each of ``backends``, against one run of the reference: each layer's piece runs on
    every backend (one after the other, each released before the next is built), then the reference layer once,
    so the checkpoint is read and the reference computed once however many backends are checked."""
    from transformers import DynamicCache

    # shapes of the values between pieces (OpenVINO needs their ranks); the weights stay on disk
    model = onnx.shape_inference.infer_shapes(onnx.load(str(graph_path), load_external_data=False))
    pieces = cut(model.graph)
    layers = sorted((s for s in pieces if s.startswith("layers.")), key=lambda s: int(s.split(".")[1]))
    past_dims = cache_spec(onnx_inputs(model.graph))
    tables = {GRAPH_TABLE} | {n.output[0] for n in pieces["prologue"].nodes if n.op_type == "Cast"
                              and n.input[0] == GRAPH_TABLE}  # the table, or its Cast when stored in bf16
    embedded = next(n.output[0] for n in pieces["prologue"].nodes if n.op_type == "Gather" and n.input[0] in tables)
    config = ref.reference_config(source_path)
    worst: dict[str, dict[str, float]] = {b: {} for b in backends}
    written = [_write(model, piece, graph_path.parent) for piece in pieces.values()]
    try:
        paths = dict(zip(pieces, written))
        with open_checkpoint(source_path) as reader:
            runs: list[list[_Step]] = []  # per case, its steps
            rotary = ref.rotary_embedding(config)
            # the table in the dtype that holds it exactly (bf16 for bf16/FP8 checkpoints): rows gathered, then
            # widened, are the fp32 reference's rows, at half its memory
            table = reader.tensor(EMBEDDING, reader.natural_dtype(EMBEDDING))
            for case in cases:
                runs.append([])
                for ids, mask, positions in _schedule(case, steps, pad_id):
                    hidden, pos = table[torch.from_numpy(ids)].float(), torch.from_numpy(positions)
                    runs[-1].append(_Step(hidden, rotary(hidden, pos), additive_mask(mask, ids.shape[1]), pos,
                                          mask[:, -ids.shape[1]:].astype(bool), {}))
            del table
            shared: dict[str, list[list[dict]]] = {}  # per backend, case and step: the prologue's other outputs
            for backend in backends:
                prologue, worst[backend]["prologue"] = GraphRunner(paths["prologue"], backend), 0.0
                shared[backend] = []
                for case, case_steps in zip(cases, runs):
                    shared[backend].append([])
                    for (ids, mask, positions), step in zip(_schedule(case, steps, pad_id), case_steps):
                        out = prologue({"input_ids": ids, "attention_mask": mask, "position_ids": positions})
                        worst[backend]["prologue"] = max(worst[backend]["prologue"],
                                                         _relative(step.hidden.numpy(), out[embedded], step.real))
                        shared[backend][-1].append({k: v for k, v in out.items() if k != embedded})
                del prologue  # the graph's copy of the table, before any layer is loaded
            hidden_in = embedded
            for scope in layers:
                # the graph's piece first (on each backend), then the reference layer, each released before the
                # next is built: the check holds the largest one, not two (a MoE layer's experts are most of it)
                piece = pieces[scope]
                past_names = [n for n in piece.inputs if n in past_dims]
                hidden_out = next(n for n in piece.outputs if not n.startswith(PRESENT_PREFIX))
                graph_out: dict[str, list[list[np.ndarray]]] = {}
                for backend in backends:
                    run = GraphRunner(paths[scope], backend)
                    graph_out[backend] = []
                    for case_steps, case_shared in zip(runs, shared[backend]):
                        graph_out[backend].append([])
                        batch = len(case_steps[0].hidden)
                        past = {n: np.zeros((batch, past_dims[n][0], 0, past_dims[n][1]), np.float32)
                                for n in past_names}
                        for step, step_shared in zip(case_steps, case_shared):
                            feeds = {n: step_shared[n] for n in piece.inputs if n in step_shared}
                            out = run({**feeds, **past, hidden_in: step.hidden.numpy()})
                            past = {n: out[present_of(n)] for n in past_names}
                            graph_out[backend][-1].append(out[hidden_out])
                    del run
                layer = ref.decoder_layer(config, reader, int(scope.split(".")[1]))
                for backend in backends:
                    worst[backend][scope] = 0.0
                for c, case_steps in enumerate(runs):
                    cache = DynamicCache(config=config)
                    for k, step in enumerate(case_steps):
                        result = layer(step.hidden, attention_mask=step.mask, position_ids=step.positions,
                                       position_embeddings=step.rope, use_cache=True, **{ref.cache_argument(): cache})
                        result = result[0] if isinstance(result, tuple) else result
                        for backend in backends:
                            worst[backend][scope] = max(worst[backend][scope],
                                                        _relative(result.numpy(), graph_out[backend][c][k], step.real))
                        step.hidden = result  # the next layer gets the reference's states
                log(f"{scope}: max relative diff " + ", ".join(f"{worst[b][scope]:.1e} ({b})" for b in backends))
                hidden_in = hidden_out
                del layer
            norm, head = ref.final_norm(config, reader), reader.tensor("lm_head.weight",
                                                                        reader.natural_dtype("lm_head.weight"))
            steps_flat = [step for case_steps in runs for step in case_steps]
            reference_logits = _logits([norm(step.hidden) for step in steps_flat], head)
            del head
            for backend in backends:
                epilogue, worst[backend]["epilogue"] = GraphRunner(paths["epilogue"], backend), 0.0
                for step, logits in zip(steps_flat, reference_logits):
                    got = epilogue({hidden_in: step.hidden.numpy()})["logits"]
                    worst[backend]["epilogue"] = max(worst[backend]["epilogue"], _relative(logits, got, step.real))
                del epilogue
    finally:
        for path in written:
            path.unlink(missing_ok=True)
    results = {}
    for backend in backends:
        tolerance = parity_tolerance(backend, cache_dtype({p.key: p.value for p in model.metadata_props}))
        results[backend] = {
            "mode": "layer by layer", "passed": all(v <= tolerance for v in worst[backend].values()),
            "tolerance_relative_to_logits_range": tolerance, "max_relative_diff": max(worst[backend].values()),
            "max_abs_diff": None, "tokens_identical": None, "pieces": worst[backend],
            "cases": [{"name": c.name, "batch": len(c.prompts), "steps": steps} for c in cases]}
    return results
