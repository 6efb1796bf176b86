"""prefill-int8: a second, int8 per-column copy of each 4-bit MatMulNBits weight, read when the MatMul has enough
rows (a prompt) through ``com.microsoft.DynamicQuantizeMatMul``; decode keeps MatMulNBits.

Why. ONNX Runtime 1.32's MatMulNBits (accuracy_level 4) runs its own int8 kernels (AVX-512 VNNI at best), which
are efficient for the one row of a decode step and slow for a prompt: a [128, 1536] x [1536, 8960] product took
24 ms, where DynamicQuantizeMatMul on the same product with int8 weights took 1.4-5.4 ms, MLAS's u8s8 GEMM (AMX on
CPUs that have it, VNNI otherwise). Measured on one weight, 2 threads (Xeon with AMX), the crossover is at 4 rows:
MatMulNBits is 2x faster at 1 row, equal at 4, 1.6x slower at 8 and 3-10x slower from 16 rows. A group-wise
exact int4 product on the u8s8 GEMM (one batched MatMulInteger per group of 128 rows of K) was measured slower
than MatMulNBits (56 ms), so the prompt path uses one scale per output column.

The form. The span of the main graph from the first 4-bit MatMulNBits (no g_idx) to the last, in graph order (a
decoder's layers: what the embedding, the masks and the positions feed, up to the final norm) becomes one
``If(tokens >= min_tokens)``, tokens a row's (the sequence axis): the else-branch is the span as it was, the
then-branch a copy of it in which each 4-bit MatMulNBits is DynamicQuantizeMatMul(A, W8, scale8[, bias]). Both
branches read the weights, inputs and values computed before the span from the outer scope, so each is stored once;
the If's outputs are what the span hands on (the hidden state, present.*). One If per forward: an If costs ~50 us a
run in ORT 1.32, and one around each MatMul (the earlier form of this pass) made a decode step 1.1x slower. A
MatMulNBits computing a graph output (an lm_head) stays out of the span: dstc's runner slices its input to the last
positions (toolchain/runtime/last_logits.py), so prompts read one row of it, and it needs no int8 copy. W8 [K, N] is
the MatMulNBits weight dequantized (its group scales and zero points) and requantized to symmetric int8 per output
column, computed lazily when the graph is saved, so a pass over a large model holds one weight at a time. The test
reads the sequence axis of the first 4-bit MatMul's input, not batch x sequence: a batch of decode steps (a server's
16 rows of one token) stays on MatMulNBits, whose activations are quantized per row, so a row's result does not
depend on the rows beside it; the prompt branch quantizes a whole prompt's activations with one scale. Costs:
activations are quantized per tensor (uint8, one scale) at the prompt, instead of per block of 32-128 values in
MatMulNBits, and the 4-bit weights are stored again in 8 bits (3x their bytes on disk; decode reads only the 4-bit
copy). A second run finds no MatMulNBits in the main graph's span and changes nothing; a span holding a node with
subgraphs of its own is left alone.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from passes.base import CountingPass
from passes.graph import Names, name_of, present, produced, set_dtype
from passes.quantize._weights import MS_DOMAIN, _attr_int, nbits_weight
from passes.registry import register

DEFAULT_MIN_TOKENS = 8  # the measured crossover above, with margin


# The int8 copy's largest code: 7 bits. MLAS's u8s8 GEMM on a CPU without an int8 dot product (AVX2, AVX-512
# without VNNI) adds pairs of u8 x s8 products in int16 (vpmaddubsw), which saturates above 32767: with codes up to
# 127 a prompt's logits differed from decode's by 17 % of their range on an AVX2 EPYC, with 63 they cannot
# (2 x 255 x 64 < 32768). An artifact runs on whatever CPU serves it, so the copy is safe on all of them; ONNX
# Runtime's quantization guide gives the same advice (reduce_range).
INT8_COPY_MAX = 63


def int8_per_column(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 7-bit codes in int8 [K, N] and their scale [N]: max |column| / INT8_COPY_MAX (a zero column gets
    scale 1), vectorized over columns (_weights.quantize_int8 loops over groups, 19k of them in a 7B MLP weight)."""
    scale = np.abs(w).max(axis=0) / float(INT8_COPY_MAX)
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -INT8_COPY_MAX, INT8_COPY_MAX).astype(np.int8), scale


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


def _dtype(value: ir.Value) -> ir.DataType | None:
    """A value's type. Where ONNX's shape inference left it unset, downstream of a contrib op it does not know
    (MatMulNBits, then the Adds after it), its producer's first input's: those ops keep their input's type."""
    seen: set[int] = set()
    while value.dtype is None:
        node = value.producer()
        if node is None or not node.inputs or node.inputs[0] is None or id(node) in seen:
            return None
        seen.add(id(node))
        value = node.inputs[0]
    return value.dtype


@register("prefill-int8", targets=("onnxruntime",),
          description="the decoder's 4-bit MatMulNBits span -> one If(tokens >= 8): DynamicQuantizeMatMul on int8 "
                      "per-column copies (prompt) else the span as it was (decode)")
class PrefillInt8(CountingPass):
    def __init__(self, min_tokens: int = DEFAULT_MIN_TOKENS) -> None:
        super().__init__()
        self.min_tokens = min_tokens

    def apply(self, model: ir.Model) -> Mapping[str, int]:
        graph = model.graph
        nodes = list(graph)
        chosen = [i for i, node in enumerate(nodes) if self._eligible(node)]
        if not chosen:
            return {}
        span = nodes[chosen[0]:chosen[-1] + 1]
        nested = next((n for n in span if any(a.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS)
                                              for a in n.attributes.values())), None)
        if nested is not None:
            self.near_miss("prefill-int8", nested, "a node with subgraphs between the 4-bit MatMulNBits")
            return {}
        inside = {id(n) for n in span}
        # what the span hands on: values read after it or leaving the graph (an If's outputs need their types)
        outs = [v for n in span for v in n.outputs
                if v.is_graph_output() or any(id(use.node) not in inside for use in v.uses())]
        dtypes = [_dtype(v) for v in outs]
        if None in dtypes:
            untyped = outs[dtypes.index(None)]
            self.near_miss("prefill-int8", produced(untyped), f"{untyped.name} has no known type")
            return {}
        names = Names(graph)
        wrapped = {id(nodes[i]) for i in chosen}
        condition = self._condition(graph, names, span[0], present(span[0].inputs[0]))
        prompt_nodes, mapped = self._prompt_copy(graph, names, span, wrapped)
        for n in span:
            graph.remove(n)
        choose = ir.node("If", [condition], num_outputs=len(outs), name=names.fresh("prefill_int8/If"))
        if chosen[-1] + 1 < len(nodes):
            graph.insert_before(nodes[chosen[-1] + 1], choose)
        else:
            graph.append(choose)
        for old, result, dtype in zip(outs, choose.outputs, dtypes):
            name = old.name
            for value in (old, mapped[old], result):
                set_dtype(value, dtype)
            for use in list(old.uses()):
                if id(use.node) not in inside:
                    use.node.replace_input_with(use.idx, result)
            for i, out in enumerate(graph.outputs):
                if out is old:
                    graph.outputs[i] = result
            result.shape = old.shape
            old.name = names.fresh(f"{name}/decode")
            result.name = name
        then_graph = ir.Graph([], [mapped[v] for v in outs], nodes=prompt_nodes, name="prefill_int8/then")
        else_graph = ir.Graph([], outs, nodes=span, name="prefill_int8/else")
        choose.attributes["then_branch"] = ir.AttrGraph("then_branch", then_graph)
        choose.attributes["else_branch"] = ir.AttrGraph("else_branch", else_graph)
        return {"prefill_int8": len(wrapped)}

    def _eligible(self, node: ir.Node) -> bool:
        if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
            return False
        if _attr_int(node, "bits", 0) != 4:
            self.near_miss("prefill-int8", node, f"{_attr_int(node, 'bits', 0)}-bit weights (4-bit only)")
            return False
        if _input(node, 4) is not None:
            self.near_miss("prefill-int8", node, "g_idx (act-order) weights")
            return False
        if any(v is not None and v.const_value is None for v in (_input(node, i) for i in (1, 2, 3))):
            self.near_miss("prefill-int8", node, "weights that are not initializers")
            return False
        if node.outputs[0].is_graph_output():
            # the lm_head: dstc's runner slices its input to the last positions (toolchain/runtime/last_logits)
            self.near_miss("prefill-int8", node, "it computes a graph output (the lm_head reads one row a step)")
            return False
        return True

    def _condition(self, graph: ir.Graph, names: Names, before: ir.Node, a: ir.Value) -> ir.Value:
        """tokens(a) >= min_tokens as a bool scalar: ReduceProd(Shape(a)[-2:-1]) (opset 18's ReduceProd with no axes
        reduces everything). ``a`` is the first 4-bit MatMul's input [..., sequence, hidden], as every other's."""
        base = names.fresh(f"{a.name}_prefill")
        shape = ir.node("Shape", [a], attributes={"start": -2, "end": -1}, name=f"{base}/Shape")
        rows = ir.node("ReduceProd", [shape.outputs[0]], attributes={"keepdims": 0}, name=f"{base}/ReduceProd")
        limit = names.add_initializer(np.array(self.min_tokens - 1, np.int64), f"{base}_min_tokens")
        test = ir.node("Greater", [rows.outputs[0], limit], name=f"{base}/Greater")
        for n in (shape, rows, test):
            n.outputs[0].name = names.fresh(f"{n.name}/out")
        test.outputs[0].dtype, test.outputs[0].shape = ir.DataType.BOOL, ir.Shape([])
        graph.insert_before(before, [shape, rows, test])
        return test.outputs[0]

    def _prompt_copy(self, graph: ir.Graph, names: Names, span: list[ir.Node],
                     wrapped: set[int]) -> tuple[list[ir.Node], dict[ir.Value, ir.Value]]:
        """The span again for prompts, each 4-bit MatMulNBits a DynamicQuantizeMatMul on its int8 copy; values
        from before the span (inputs, initializers) are read from the outer scope, so stored once."""
        mapped: dict[ir.Value, ir.Value] = {}
        copies = []
        for node in span:
            inputs = [None if v is None else mapped.get(v, v) for v in node.inputs]
            if id(node) in wrapped:
                q8, s8 = self._int8_copy(graph, names, node)
                bias = inputs[5] if len(inputs) > 5 else None
                copy = ir.node("DynamicQuantizeMatMul", [inputs[0], q8, s8, None, bias] if bias is not None else
                               [inputs[0], q8, s8], domain=MS_DOMAIN, name=names.fresh(f"{node.name}/prefill"))
            else:
                copy = ir.Node(node.domain, node.op_type, inputs,
                               attributes=[ir.Attr(a.name, a.type, a.value) for a in node.attributes.values()],
                               overload=node.overload, num_outputs=len(node.outputs), version=node.version,
                               name=names.fresh(f"{node.name}/prefill"))
                copy.metadata_props.update(node.metadata_props)
            for old, new in zip(node.outputs, copy.outputs):
                mapped[old] = new
                if old.dtype is not None:
                    set_dtype(new, old.dtype)
                new.shape = old.shape
                if old.name is not None:
                    new.name = names.fresh(f"{old.name}/prefill")
            copies.append(copy)
        return copies, mapped

    def _int8_copy(self, graph: ir.Graph, names: Names, node: ir.Node) -> tuple[ir.Value, ir.Value]:
        """W8 [K, N] and its scale [N], initializers computed when the graph is saved (one weight at a time)."""
        k, n = _attr_int(node, "K", 0), _attr_int(node, "N", 0)
        # the tensors, not the values: a serializer may lift initializers to graph inputs while it writes
        tensors = [None if v is None else v.const_value for v in (_input(node, i) for i in (1, 2, 3))]
        held: dict[str, np.ndarray] = {}  # q8 or s8, from computing both until the other is written
        lock = threading.Lock()  # a writer may save the two on two threads

        def weight8(part: str) -> ir.TensorProtocol:
            with lock:
                if part not in held:
                    b, scales, zero_points = (None if t is None else t.numpy() for t in tensors)
                    assert b is not None and scales is not None  # checked in _eligible
                    held["q"], held["scale"] = int8_per_column(nbits_weight(node, b, scales, zero_points))
                return ir.tensor(held.pop(part))

        base = name_of(present(node.inputs[1]))
        q8_name, s8_name = names.fresh(f"{base}_prefill_int8"), names.fresh(f"{base}_prefill_scale")
        q8 = ir.Value(name=q8_name, type=ir.TensorType(ir.DataType.INT8), shape=ir.Shape([k, n]),
                      const_value=ir.LazyTensor(lambda: weight8("q"), ir.DataType.INT8, ir.Shape([k, n]),
                                                name=q8_name))
        s8 = ir.Value(name=s8_name, type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([n]),
                      const_value=ir.LazyTensor(lambda: weight8("scale"), ir.DataType.FLOAT, ir.Shape([n]),
                                                name=s8_name))
        graph.register_initializer(q8)
        graph.register_initializer(s8)
        return q8, s8
