"""A stateless runner that appends each step's new cache entries itself, instead of receiving the whole grown cache
back from the graph.

The graph interface's present.N.* output is the past input grown by the step's entries (toolchain/interface/
graph.py), which the exporter writes as ``Concat(past_key_values.N.*, new)`` on the sequence axis: a copy of the
whole cache per step and tensor, the dominant cost of a long-context decode step once attention reads a bounded
number of cached entries (DeepSeek-V3.2's gathered attention: 92 MB per layer at 32k, ~30 ms on a loaded 2-core
EPYC). Where such a Concat feeds its present output and nothing else (the graph's attention reads the past and the
new entries apart, as V3.2's latent layout does), :func:`appending_onnx` / :func:`appending_openvino` give a runner
a copy of the graph whose present outputs are the new entries only (an Identity where the Concat was; inside
prefill-int8's If both branches' alike), and :class:`AppendingCache` keeps the caches in buffers with room to grow,
feeding each buffer whole as the next past with its free slots masked: no copy per step, at any batch, and one
past length for many steps. Graphs whose present outputs are anything else are run as they are; every other
runner keeps the interface's contract.
"""

from __future__ import annotations

import numpy as np

from toolchain.interface.graph import PAST_PREFIX, PRESENT_PREFIX, SEQUENCE_AXIS


def appending_onnx(proto) -> bool:
    """Rewrite an onnx.ModelProto (in place) so that its present.* outputs are each step's new entries; False, and
    the model untouched, unless every present output is such a Concat."""
    pasts = {i.name for i in proto.graph.input if i.name.startswith(PAST_PREFIX)}
    outputs = [o for o in proto.graph.output if o.name.startswith(PRESENT_PREFIX)]
    found: list = []
    if not outputs or not all(_find_concats(proto.graph, o.name, pasts, found) for o in outputs):
        return False
    for node in found:
        node.op_type = "Identity"
        del node.input[0]
        del node.attribute[:]
    for graph in _graphs(proto.graph):  # the grown length's declared shapes no longer hold
        for info in [*graph.output, *graph.value_info]:
            if info.name in {n.output[0] for n in found} | {o.name for o in outputs}:
                _free_sequence_dim(info)
    return True


def _find_concats(graph, name: str, pasts: set[str], found: list) -> bool:
    """Whether ``name`` in ``graph`` is a past input's Concat with new entries on the sequence axis that nothing
    else reads, or an If whose branches output one each; the Concats join ``found``."""
    node = next((n for n in graph.node if name in n.output), None)
    if node is None or _read(graph, name):
        return False
    if node.op_type == "If":
        position = list(node.output).index(name)
        branches = [a.g for a in node.attribute if a.name in ("then_branch", "else_branch")]
        return all(_find_concats(b, b.output[position].name, pasts, found) for b in branches)
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    if not (node.op_type == "Concat" and len(node.input) == 2 and node.input[0] in pasts
            and axis in (SEQUENCE_AXIS, SEQUENCE_AXIS - 4)):
        return False
    found.append(node)
    return True


def _read(graph, name: str) -> bool:
    """Whether a node of ``graph`` (or of its subgraphs) reads ``name``."""
    return any(name in n.input for g in _graphs(graph) for n in g.node)


def _graphs(graph):
    yield graph
    for node in graph.node:
        for attribute in node.attribute:
            if attribute.HasField("g"):
                yield from _graphs(attribute.g)


def _free_sequence_dim(info) -> None:
    shape = info.type.tensor_type.shape
    if len(shape.dim) == 4:
        shape.dim[SEQUENCE_AXIS].Clear()
        shape.dim[SEQUENCE_AXIS].dim_param = "new_positions"


def appending_openvino(model) -> bool:
    """The same rewrite of an ov.Model (in place): each present.* Result reads the Concat's new entries."""
    results = [r for r in model.get_results() if any(n.startswith(PRESENT_PREFIX) for n in r.output(0).get_names())]
    concats = []
    for result in results:
        node = result.input_value(0).get_node()
        if node.get_type_name() != "Concat" or node.get_input_size() != 2 \
                or len(node.output(0).get_target_inputs()) != 1:
            return False
        past = node.input_value(0).get_node()
        if past.get_type_name() != "Parameter" or not past.get_friendly_name().startswith(PAST_PREFIX) \
                or node.get_axis() not in (SEQUENCE_AXIS, SEQUENCE_AXIS - 4):
            return False
        concats.append((result, node))
    if not concats:
        return False
    for result, node in concats:
        names = node.output(0).get_names()
        new = node.input_value(1)
        node.output(0).get_tensor().set_names(set())
        new.get_tensor().set_names(names)  # the Result's port is named present.*, and nothing else
        result.input(0).replace_source_output(new)
    model.validate_nodes_and_infer_types()
    return True


class AppendingCache:
    """The caches of a runner whose graph outputs new entries: per past_key_values.* input a zeroed buffer
    [B, H, room, d] whose first ``held`` slots hold the positions so far, fed whole as the past with the free slots
    masked out (:meth:`graph_mask`). The room grows in steps of ROOM_STEP slots, so the graph sees one past length
    for ROOM_STEP decode steps (OpenVINO's CPU plugin builds its kernels once per input shape) and the feed is the
    buffer itself at any batch (no copy). A free slot between the held positions and the step's is a masked cached
    position, which the graph ignores as it ignores left padding (the positions come from the caller's mask):
    attention gives it exactly zero weight, and V3.2's indexer scores it the float32 minimum, below every allowed
    token, so the chosen tokens are the same (bit-equal logits once a context holds index_topk tokens; below, the
    chosen masked slots differ and add exact zeros). Zeroed, so that a masked slot is finite."""

    # Slots added at a time: the graph's past length changes once per ROOM_STEP positions (a kernel rebuild on
    # OpenVINO, a copy of the cache), and a step reads up to ROOM_STEP - 1 free slots (V3.2's indexer scores them)
    ROOM_STEP = 256

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._buffers: dict[str, np.ndarray] = {}
        self.held = 0

    def room(self) -> int:
        return next(iter(self._buffers.values())).shape[SEQUENCE_AXIS] if self._buffers else 0

    def past(self, name: str, empty: np.ndarray) -> np.ndarray:
        """``name``'s buffer, all its slots (``empty`` before the first append)."""
        return self._buffers.get(name, empty)

    def graph_mask(self, attention_mask: np.ndarray) -> np.ndarray:
        """The graph's attention mask [B, room + S] for the caller's [B, held + S]: the held positions' columns,
        the free slots' zeros, the step's columns."""
        free = np.zeros((len(attention_mask), self.room() - self.held), attention_mask.dtype)
        return np.concatenate([attention_mask[:, :self.held], free, attention_mask[:, self.held:]], axis=1)

    def append(self, new: dict[str, np.ndarray], reserve: int = 0) -> None:
        """Write the step's entries {name: [B, H, S, d]} into the slots after the held ones, with room for
        ``reserve`` more."""
        added = next(iter(new.values())).shape[SEQUENCE_AXIS]
        total = self.held + added
        if total + reserve > self.room():
            room = -(-(total + reserve) // self.ROOM_STEP) * self.ROOM_STEP
            for name, entries in new.items():
                grown = np.zeros((*entries.shape[:2], room, entries.shape[3]), entries.dtype)
                if name in self._buffers:
                    grown[:, :, :self.held] = self._buffers[name][:, :, :self.held]
                self._buffers[name] = grown
        for name, entries in new.items():
            self._buffers[name][:, :, self.held:total] = entries
        self.held = total

    def hold(self, caches: dict[str, np.ndarray], reserve: int) -> None:
        """Hold ``caches`` {name: [B, H, T, d]} as the positions so far, with room for ``reserve`` more (a
        benchmark's prepared context and the steps it measures)."""
        self.reset()
        self.append(caches, reserve)

    def trim(self, keep: int) -> None:
        """Keep the first ``keep`` positions (a speculative step's rejected drafts); the slots after are free."""
        if not 0 <= keep <= self.held:
            raise ValueError(f"cannot keep {keep} positions of a cache that holds {self.held}")
        self.held = keep
