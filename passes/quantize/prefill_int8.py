"""prefill-int8: a second, int8 per-column copy of each 4-bit MatMulNBits weight, read when the MatMul has enough
rows (a prompt) through ``com.microsoft.DynamicQuantizeMatMul``; decode keeps MatMulNBits.

Why. ONNX Runtime 1.32's MatMulNBits (accuracy_level 4) runs its own int8 kernels (AVX-512 VNNI at best), which
are efficient for the one row of a decode step and slow for a prompt: a [128, 1536] x [1536, 8960] product took
24 ms, where DynamicQuantizeMatMul on the same product with int8 weights took 1.4-5.4 ms, MLAS's u8s8 GEMM (AMX on
CPUs that have it, VNNI otherwise). Measured on one weight, 2 threads (Xeon with AMX), the crossover is at 4 rows:
MatMulNBits is 2x faster at 1 row, equal at 4, 1.6x slower at 8 and 3-10x slower from 16 rows. A group-wise
exact int4 product on the u8s8 GEMM (one batched MatMulInteger per group of 128 rows of K) was measured slower
than MatMulNBits (56 ms), so the prompt path uses one scale per output column.

The form. Each 4-bit MatMulNBits node (no g_idx) becomes ``If(rows >= min_rows)``: the then-branch runs
DynamicQuantizeMatMul(A, W8, scale8[, bias]) and the else-branch the MatMulNBits node as it was. W8 [K, N] is the
MatMulNBits weight dequantized (its group scales and zero points) and requantized to symmetric int8 per output
column, computed lazily when the graph is saved, so a pass over a large model holds one weight at a time. ``rows``
is the product of A's dims but the last, computed once per distinct A. Costs: activations are quantized per tensor
(uint8, one scale) at the prompt, instead of per block of 32-128 values in MatMulNBits, and the weights are stored
twice (3x the 4-bit bytes on disk; decode reads only the 4-bit copy). A second run finds no MatMulNBits in the
main graph and changes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from passes.base import CountingPass
from passes.graph import Names, name_of, present, set_dtype
from passes.quantize._weights import MS_DOMAIN, _attr_int, nbits_weight
from passes.registry import register

DEFAULT_MIN_ROWS = 8  # the measured crossover above, with margin


def int8_per_column(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 [K, N] and its scale [N]: max |column| / 127 (a zero column gets scale 1); _weights.
    quantize_int8's rule, vectorized over columns (it loops over groups, 19k of them in a 7B MLP weight)."""
    scale = np.abs(w).max(axis=0) / 127.0
    scale = np.where(scale > 0, scale, 1.0).astype(np.float32)
    return np.clip(np.rint(w / scale), -127, 127).astype(np.int8), scale


def _input(node: ir.Node, index: int) -> ir.Value | None:
    return node.inputs[index] if len(node.inputs) > index else None


@register("prefill-int8", targets=("onnxruntime",),
          description="4-bit MatMulNBits -> If(rows >= 8) DynamicQuantizeMatMul on an int8 per-column copy "
                      "(prompt) else MatMulNBits (decode)")
class PrefillInt8(CountingPass):
    def __init__(self, min_rows: int = DEFAULT_MIN_ROWS) -> None:
        super().__init__()
        self.min_rows = min_rows

    def apply(self, model: ir.Model) -> Mapping[str, int]:
        graph = model.graph
        names = Names(graph)
        conditions: dict[ir.Value, ir.Value] = {}
        wrapped = 0
        for node in list(graph):
            if node.op_type != "MatMulNBits" or node.domain != MS_DOMAIN:
                continue
            if _attr_int(node, "bits", 0) != 4:
                self.near_miss("prefill-int8", node, f"{_attr_int(node, 'bits', 0)}-bit weights (4-bit only)")
                continue
            if _input(node, 4) is not None:
                self.near_miss("prefill-int8", node, "g_idx (act-order) weights")
                continue
            if any(v is not None and v.const_value is None for v in (_input(node, i) for i in (1, 2, 3))):
                self.near_miss("prefill-int8", node, "weights that are not initializers")
                continue
            a = present(node.inputs[0])
            if a not in conditions:
                conditions[a] = self._condition(graph, names, node, a)
            self._wrap(graph, names, node, conditions[a])
            wrapped += 1
        return {"prefill_int8": wrapped}

    def _condition(self, graph: ir.Graph, names: Names, before: ir.Node, a: ir.Value) -> ir.Value:
        """rows(a) >= min_rows as a bool scalar: ReduceProd(Shape(a)[:-1]) (opset 18's ReduceProd with no axes
        reduces everything)."""
        base = names.fresh(f"{a.name}_prefill")
        shape = ir.node("Shape", [a], attributes={"end": -1}, name=f"{base}/Shape")
        rows = ir.node("ReduceProd", [shape.outputs[0]], attributes={"keepdims": 0}, name=f"{base}/ReduceProd")
        limit = names.add_initializer(np.array(self.min_rows - 1, np.int64), f"{base}_min_rows")
        test = ir.node("Greater", [rows.outputs[0], limit], name=f"{base}/Greater")
        for n in (shape, rows, test):
            n.outputs[0].name = names.fresh(f"{n.name}/out")
        test.outputs[0].dtype, test.outputs[0].shape = ir.DataType.BOOL, ir.Shape([])
        graph.insert_before(before, [shape, rows, test])
        return test.outputs[0]

    def _wrap(self, graph: ir.Graph, names: Names, node: ir.Node, condition: ir.Value) -> None:
        k, n = _attr_int(node, "K", 0), _attr_int(node, "N", 0)
        # the tensors, not the values: a serializer may lift initializers to graph inputs while it writes
        tensors = [None if v is None else v.const_value for v in (_input(node, i) for i in (1, 2, 3))]
        held: dict[str, np.ndarray] = {}  # q8 or s8, from computing both until the other is written
        lock = threading.Lock()  # a writer may save the two on two threads

        def weight8(part: str) -> ir.TensorProtocol:
            with lock:
                if part not in held:
                    b, scales, zero_points = (None if t is None else t.numpy() for t in tensors)
                    assert b is not None and scales is not None  # checked in apply
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

        out = node.outputs[0]
        bias = _input(node, 5)
        prompt = ir.node("DynamicQuantizeMatMul", [node.inputs[0], q8, s8, None, bias] if bias is not None else
                         [node.inputs[0], q8, s8], domain=MS_DOMAIN, name=names.fresh(f"{node.name}/prefill"))
        prompt.outputs[0].name = names.fresh(f"{out.name}/prefill")
        decode = ir.node("MatMulNBits", list(node.inputs), attributes=dict(node.attributes), domain=MS_DOMAIN,
                         name=node.name)
        decode.outputs[0].name = names.fresh(f"{out.name}/decode")
        dtype = out.dtype or ir.DataType.FLOAT  # MatMulNBits outputs A's type; DynamicQuantizeMatMul float
        a_shape = present(node.inputs[0]).shape
        # a branch output needs a shape (the checker): A's with N last where shape inference left none
        shape = out.shape or (ir.Shape([*list(a_shape)[:-1], n]) if a_shape is not None else None)
        for branch_out in (prompt.outputs[0], decode.outputs[0]):
            set_dtype(branch_out, dtype)
            branch_out.shape = shape
        then_graph = ir.Graph([], [prompt.outputs[0]], nodes=[prompt], name=f"{node.name}/then")
        else_graph = ir.Graph([], [decode.outputs[0]], nodes=[decode], name=f"{node.name}/else")
        choose = ir.node("If", [condition], attributes={"then_branch": ir.AttrGraph("then_branch", then_graph),
                                                       "else_branch": ir.AttrGraph("else_branch", else_graph)},
                         name=names.fresh(f"{node.name}/If"))
        graph.insert_before(node, choose)
        result = choose.outputs[0]
        set_dtype(result, dtype)
        result.shape = shape
        name = out.name
        out.replace_all_uses_with(result, replace_graph_outputs=True)
        out.name = None
        result.name = name
        graph.remove(node, safe=True)
