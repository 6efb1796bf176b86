"""int8-per-head: 8-bit weights with one scale (and zero point) per attention head on the projections that have
heads, per channel everywhere else.

Which weights have heads, and where. A projection whose output is split into heads (q_proj, k_proj, v_proj;
MLA's q_b_proj and kv_b_proj, whose per-head rows are [nope | rope] and [k_nope | v]) gets one scale per head's
block of output channels, so a scale never covers channels of two heads. The other attention weights have no
head structure on their output: MLA's q_a_proj and kv_a_proj_with_mqa write latents shared by every head, and
o_proj's outputs are hidden channels, each a sum over all heads. o_proj's heads are on its *input* side (rows
h*d .. (h+1)*d of the [K, N] weight); a scale per input-head block would be one scalar for a head's whole
[d, hidden] slab, which no per-axis DequantizeLinear over the output can express and which measures far worse
than per output channel (benchmarks/compression.py prints both), so o_proj is quantized per output channel, like
every MatMul without heads. Embedding tables (Gather on axis 0) get one scale per row (token); a tied table, also
read by the lm_head as Gemm(x, table, transB=1), is quantized once for both: its rows are the lm_head's output
channels, so the per-row scales are per output channel there.

The form. Per-head scales are written expanded to per-channel values (identical within a head) and emitted as a
standard per-axis ``DequantizeLinear`` (axis 1 of the [K, N] weight; axis 0 of an embedding table) feeding the
original MatMul / Gather, valid at opset 13+, so the model stays a plain ONNX graph at the exporter's opset 18
(blocked DequantizeLinear needs opset 21). OpenVINO reads it as its compressed-weight pattern; for ONNX Runtime
the ``to-matmul-nbits`` pass turns it into MatMulNBits(bits=8), which ORT runs without materialising the float
weight.

Which projections have heads, and their widths, come from ``head_blocks`` ({projection name: head width}) when
given, empty or not: dstc's compress stage passes the exporter's record of them (the graph metadata
``dstc.head_layout``, written by each architecture), the one source. Only when none is given (a foreign graph run
through this pass alone) does the pass fall back to the usual projection names (``HEAD_PROJECTIONS``) and the
Reshape to [..., heads, head_dim] that reads the projection's output (through a bias Add). A projection whose heads
cannot be found is quantized per channel and reported as a near-miss.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping

import onnx_ir as ir

from passes.base import CountingPass
from passes.graph import Names, constant_array
from passes.quantize._weights import WeightUse, float_weights, group_bounds, is_transposed_gemm, quantize_int8
from passes.registry import register

# Projections whose output channels are heads, by the name of the scope that holds their weight: only for graphs
# without head_blocks (module docstring).
HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj")
GRANULARITIES = ("head", "channel", "tensor")


def projection_of(weight_name: str) -> str:
    """'layers.3/self_attn/q_proj/weight' -> 'q_proj'."""
    parts = weight_name.split("/")
    return parts[-2] if len(parts) >= 2 else ""


def inferred_head_width(use: WeightUse) -> int | None:
    """The head_dim of the Reshape [.., heads, head_dim] reading the MatMul's output (possibly after an Add)."""
    n = use.columns
    frontier = [use.node.outputs[0]]
    for _ in range(2):
        next_frontier = []
        for value in frontier:
            for consumer, index in value.uses():
                if consumer.op_type == "Reshape" and index == 0:
                    shape = constant_array(consumer.inputs[1])
                    if shape is not None and shape.ndim == 1 and len(shape) >= 2:
                        heads, width = int(shape[-2]), int(shape[-1])
                        if heads > 0 and width > 0 and heads * width == n:
                            return width
                elif consumer.op_type == "Add":
                    next_frontier.append(consumer.outputs[0])
        frontier = next_frontier
    return None


@register("int8-per-head", description="8-bit weights: a scale per attention head on q/k/v (MLA q_b/kv_b), "
                                       "per channel elsewhere, as per-axis DequantizeLinear")
class Int8PerHead(CountingPass):
    """``names``: only these weight initializers (default: every float 2-D MatMul/Gather weight).
    ``granularity`` of the head projections: "head" (default), "channel" or "tensor" (for comparisons)."""

    def __init__(self, head_blocks: Mapping[str, int] | None = None, *, sym: bool = False,
                 names: Collection[str] | None = None, granularity: str = "head") -> None:
        super().__init__()
        if granularity not in GRANULARITIES:
            raise ValueError(f"granularity {granularity!r} is not one of {GRANULARITIES}")
        self.head_blocks = None if head_blocks is None else dict(head_blocks)
        self.sym = sym
        self.names = None if names is None else set(names)
        self.granularity = granularity
        # weight name -> [start, end) output channels sharing one scale, for whoever checks head boundaries
        self.groups: dict[str, list[tuple[int, int]]] = {}

    def _group(self, use: WeightUse) -> int | None:
        """Width of the channel groups sharing a scale, or None for per channel."""
        n = use.columns
        blocks = self.head_blocks
        if use.kind != "matmul" or projection_of(use.name) not in (HEAD_PROJECTIONS if blocks is None else blocks):
            return None
        if self.granularity == "channel":
            return None
        if self.granularity == "tensor":
            return n
        width = (blocks or {}).get(projection_of(use.name)) or inferred_head_width(use)
        if width is None or n % width:
            self.near_miss("int8-per-head", use.node, f"no head width for {use.value.name} ({n} outputs); "
                           f"quantized per channel", score=1)
            return None
        return width

    def apply(self, model: ir.Model) -> Mapping[str, int]:
        graph = model.graph
        names = Names(graph)
        counts: Counter = Counter()
        self.groups = {}
        for use in list(float_weights(graph)):
            weight, name = use.value, use.name
            if self.names is not None and name not in self.names:
                continue
            if use.node.inputs[1 if use.kind == "matmul" else 0] is not weight:
                continue  # a tied table's other reader, rewired when the table was quantized
            array = use.tensor.numpy()
            matrix = array if use.kind == "matmul" else array.T  # channels are columns
            width = self._group(use)
            quantized = quantize_int8(matrix, width or 1, sym=self.sym)
            self.groups[name] = group_bounds(matrix.shape[1], width or 1)
            q = quantized.q if use.kind == "matmul" else quantized.q.T
            inputs = [names.add_initializer(q, f"{name}_quantized"),
                      names.add_initializer(quantized.scale, f"{name}_scale")]
            if quantized.zero_point is not None:
                inputs.append(names.add_initializer(quantized.zero_point, f"{name}_zero_point"))
            dq = ir.node("DequantizeLinear", inputs, attributes={"axis": 1 if use.kind == "matmul" else 0},
                         name=names.fresh(f"{name}_DequantizeLinear"))
            dq.outputs[0].name = names.fresh(f"{name}_dequantized")
            dq.outputs[0].dtype = ir.DataType.FLOAT
            dq.outputs[0].shape = ir.Shape(list(array.shape))
            graph.insert_before(use.node, dq)
            use.node.replace_input_with(1 if use.kind == "matmul" else 0, dq.outputs[0])
            if use.kind == "gather":  # every reader of the table's rows: other Gathers, a tied lm_head
                for reader, index in list(weight.uses()):
                    if is_transposed_gemm(reader, index) or (
                            reader.op_type == "Gather" and index == 0 and reader.attributes.get_int("axis", 0) == 0):
                        reader.replace_input_with(index, dq.outputs[0])
            if not weight.uses() and not weight.is_graph_output():
                del graph.initializers[name]
            if use.kind == "gather":
                counts["per_row"] += 1
            elif width is None:
                counts["per_channel"] += 1
            else:
                counts[f"per_{self.granularity}"] += 1
        return counts
