"""to-matmul-nbits: quantized constant weights in the forms ONNX Runtime's CPU kernels run without materialising
a float weight, plus the repairs NNCF's ONNX output needs before ORT loads it.

ORT keeps ``DequantizeLinear -> MatMul`` on a constant weight as written (measured with ORT 1.32: no fusion at
opset 18, neither basic nor extended level): every call dequantizes the whole weight into a float buffer, then
runs an fp32 MatMul. So:

* per-axis (or per-tensor) 8-bit ``DequantizeLinear`` on the output axis of a [K, N] weight, read by a MatMul,
  becomes ``com.microsoft.MatMulNBits`` with ``bits=8``. MatMulNBits' block_size must be a power of two >= 16,
  so a column of K values is stored in the layout of fewer bytes (``nbits_layout``): blocks of the largest
  power of two dividing K, the column's scale (and zero point) repeated per block, or one block padded to the
  next power of two with the zero point. R1-Distill-Qwen's lm_head (K = 1536, N = 151936) thus takes 3 blocks
  of 512, 234 MB, where one padded block of 2048 took 311 MB, read at every token. Scales [N, blocks], zero
  points [N, blocks] (symmetric int8 is stored as uint8 + 128 with no zero-point input, ORT's default zero
  point for 8 bits);
* MatMulNBits written by NNCF 3.4 with ``bits=4`` carries one uint8 per zero point, shaped [N, blocks]; ORT
  1.32 wants them packed two per byte, [N, ceil(blocks / 2)], and refuses the model at load otherwise
  ("zero_points initializer shape {96,8} does not match attribute-derived shape [384] or [96,4]"): they are
  packed, low nibble first;
* NNCF 3.4 also copies the bias of a MatMul followed by Add(bias) into MatMulNBits' bias input and keeps the
  Add, so the bias is added twice (qwen2's q/k/v): the copy is dropped;
* every MatMulNBits gets ``accuracy_level`` (4: activations quantized to int8 per block and int8 dot products,
  0: as the weights' float type); ORT only uses levels its CPU build supports and otherwise falls back;
* ``DequantizeLinear`` (axis 0, one scale per row) -> ``Gather`` on an embedding table becomes a Gather of the
  quantized rows, of their scales and zero points, then Cast / Sub / Mul on the gathered rows only;
* a tied embedding table (the exporter's lm_head ``Gemm(x, table, transB=1)`` reads the table the Gathers read,
  and NNCF gives both one ``DequantizeLinear``, axis 0, one scale per row = per lm_head output) stays one
  8-bit tensor: it becomes MatMulNBits' B, [vocab, blocks, block], which the Gathers read rows of as above
  (reshaped to [..., hidden]), in the layout of a MatMul's weight above (``nbits_layout``: the row's scale
  repeated per block; where one padded block is chosen, the gathered rows are sliced back). Without this the shared
  DequantizeLinear is left as it is and dequantizes the whole table at every step, for each of its readers;
* a ``DequantizeLinear`` whose scale has the weight's rank (NNCF's INT8 of a 3-D weight: invalid below opset 21,
  and ORT fails at run time with "scale must be 1D tensor") becomes Cast / Sub / Mul with broadcasting.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

import numpy as np
import onnx_ir as ir

from passes.base import CountingPass
from passes.graph import (
    Names,
    bypass,
    constant_array,
    drop_orphaned_initializers,
    initializers_in_use,
    present,
    set_dtype,
)
from passes.quantize._weights import MS_DOMAIN, is_transposed_gemm
from passes.registry import register

ACCURACY_LEVELS = (0, 1, 2, 3, 4)


def block_size_for(k: int) -> int:
    """The smallest power of two >= k and >= 16 (MatMulNBits' block_size rule): one block per column."""
    return max(16, 1 << (k - 1).bit_length())


def nbits_layout(k: int, scale_bytes: int) -> tuple[int, int]:
    """(block_size, blocks) storing an 8-bit column of ``k`` values in the fewest bytes, each block costing
    ``scale_bytes`` of scale and zero point besides its ``block_size`` bytes: blocks of the largest power of two
    dividing k (no padding) unless one padded block is smaller (k = 16 x an odd number has blocks of 16)."""
    padded = block_size_for(k)
    divisor = k & -k
    if divisor >= 16 and k + k // divisor * scale_bytes <= padded + scale_bytes:
        return divisor, k // divisor
    return padded, 1


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """[..., n] 4-bit values -> [..., ceil(n / 2)] uint8, element 2i in the low nibble."""
    values = values.astype(np.uint8)
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros((*values.shape[:-1], 1), np.uint8)], axis=-1)
    return (values[..., 0::2] & 0x0F) | ((values[..., 1::2] & 0x0F) << 4)


def _int(node: ir.Node, name: str, default: int) -> int:
    attr = node.attributes.get(name)
    return default if attr is None else int(attr.as_int())


def _is_table_gather(node: ir.Node, index: int) -> bool:
    return node.op_type == "Gather" and node.domain in ("", "ai.onnx") and index == 0 and _int(node, "axis", 0) == 0


def _dq_parts(dq: ir.Node):
    """(quantized, scale, zero point or None) of a DequantizeLinear with constant inputs, else None."""
    if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or _int(dq, "block_size", 0):
        return None
    arrays = [constant_array(v) if v is not None else None for v in dq.inputs]
    if arrays[0] is None or arrays[1] is None or (len(arrays) > 2 and dq.inputs[2] is not None and arrays[2] is None):
        return None
    zp = arrays[2] if len(arrays) > 2 else None
    return arrays[0], arrays[1], zp


@register("to-matmul-nbits", targets=("onnxruntime",),
          description="8-bit DequantizeLinear->MatMul to MatMulNBits, pack NNCF's 4-bit zero points, set "
                      "accuracy_level, gather-then-dequantize embeddings, one 8-bit tied table")
class ToMatMulNBits(CountingPass):
    def __init__(self, accuracy_level: int | None = 4) -> None:
        super().__init__()
        if accuracy_level is not None and accuracy_level not in ACCURACY_LEVELS:
            raise ValueError(f"accuracy_level must be one of {ACCURACY_LEVELS}")
        self.accuracy_level = accuracy_level

    def apply(self, model: ir.Model) -> Mapping[str, int]:
        graph = model.graph
        names = Names(graph)
        counts: Counter = Counter()
        used_before = initializers_in_use(graph)
        for node in list(graph):
            if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx"):
                consumers = node.outputs[0].uses()
                if node.outputs[0].is_graph_output() or not consumers:
                    continue
                parts = _dq_parts(node)
                if parts is not None and parts[1].ndim > 1 and not _int(node, "block_size", 0):
                    counts["dequantize_broadcast"] += self._broadcast(graph, names, node, *parts)
                elif all(c.op_type == "MatMul" and i == 1 for c, i in consumers):
                    counts["matmul_nbits_8bit"] += self._matmul(graph, names, node)
                elif all(_is_table_gather(c, i) for c, i in consumers):
                    counts["gather_dequantize"] += self._gather(graph, names, node)
                elif all(_is_table_gather(c, i) or is_transposed_gemm(c, i) for c, i in consumers):
                    counts["tied_table"] += self._tied(graph, names, node)
        for node in graph:
            if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
                counts["zero_points_packed"] += self._pack_zero_points(graph, names, node)
                counts["double_bias_dropped"] += self._drop_double_bias(node)
                if self.accuracy_level is not None and _int(node, "accuracy_level", 0) != self.accuracy_level:
                    node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", self.accuracy_level)
                    counts["accuracy_level_set"] += 1
        if (counts["matmul_nbits_8bit"] or counts["tied_table"]) and model.opset_imports.get(MS_DOMAIN) is None:
            model.opset_imports[MS_DOMAIN] = 1
        drop_orphaned_initializers(graph, used_before)
        return counts

    def _matmul(self, graph: ir.Graph, names: Names, dq: ir.Node) -> int:
        parts = _dq_parts(dq)
        if parts is None:
            self.near_miss("dq-matmul", dq, "DequantizeLinear inputs are not all constants")
            return 0
        q, scale, zp = parts
        if q.ndim != 2 or q.dtype not in (np.int8, np.uint8):
            self.near_miss("dq-matmul", dq, f"weight is {q.dtype} of rank {q.ndim}, not a 2-D 8-bit matrix")
            return 0
        k, n = q.shape
        axis = _int(dq, "axis", 1) % 2
        if scale.size == 1:
            scale, zp = np.full(n, scale.item(), np.float32), None if zp is None else np.full(n, zp.item(), zp.dtype)
        elif axis != 1 or scale.size != n:
            self.near_miss("dq-matmul", dq, f"scales along axis {axis} of a [{k}, {n}] weight, not per column",
                           score=1)
            return 0
        if q.dtype == np.int8:  # symmetric: uint8 = int8 + 128, MatMulNBits' default zero point for 8 bits
            if zp is not None and np.any(zp):
                self.near_miss("dq-matmul", dq, "int8 weight with non-zero zero points")
                return 0
            u, zp_u8 = (q.astype(np.int16) + 128).astype(np.uint8), None
        else:
            u, zp_u8 = q, (None if zp is None else zp.astype(np.uint8).reshape(n))
        block, blocks = nbits_layout(k, 4 if zp_u8 is None else 5)
        b = u.T  # [N, K]
        if block * blocks > k:
            b = np.concatenate([b, np.full((n, block - k), 128, np.uint8) if zp_u8 is None else
                                np.repeat(zp_u8[:, None], block - k, 1)], axis=1)  # dequantizes to exactly 0
        base = present(dq.inputs[0]).name or "weight"
        inputs = [names.add_initializer(np.ascontiguousarray(b).reshape(n, blocks, block), f"{base}_nbits"),
                  names.add_initializer(np.repeat(scale.astype(np.float32).reshape(n, 1), blocks, 1),
                                        f"{base}_nbits_scale")]
        if zp_u8 is not None:
            inputs.append(names.add_initializer(np.repeat(zp_u8.reshape(n, 1), blocks, 1), f"{base}_nbits_zero_point"))
        for matmul, _ in list(dq.outputs[0].uses()):
            attrs = {"K": k, "N": n, "bits": 8, "block_size": block}
            if self.accuracy_level is not None:
                attrs["accuracy_level"] = self.accuracy_level
            new = ir.node("MatMulNBits", [matmul.inputs[0], *inputs], attributes=attrs, domain=MS_DOMAIN,
                          name=matmul.name)
            graph.insert_before(matmul, new)
            new.outputs[0].dtype, new.outputs[0].shape = ir.DataType.FLOAT, matmul.outputs[0].shape
            name = matmul.outputs[0].name
            bypass(graph, matmul.outputs[0], new.outputs[0])
            new.outputs[0].name = name
            graph.remove(matmul, safe=True)
        graph.remove(dq, safe=True)
        return 1

    def _gather(self, graph: ir.Graph, names: Names, dq: ir.Node) -> int:
        parts = _dq_parts(dq)
        if parts is None:
            return 0
        q, scale, zp = parts
        if q.ndim != 2 or _int(dq, "axis", 1) % 2 != 0 or scale.size != q.shape[0]:
            self.near_miss("dq-gather", dq, "not one scale per row of a 2-D table")
            return 0
        table = present(dq.inputs[0])
        scale_v = names.add_initializer(scale.astype(np.float32).reshape(-1, 1), f"{table.name}_row_scale")
        zp_v = None if zp is None or not np.any(zp) else names.add_initializer(
            zp.astype(np.float32).reshape(-1, 1), f"{table.name}_row_zero_point")
        for gather, _ in list(dq.outputs[0].uses()):
            self._dequantized_rows(graph, names, gather, table, scale_v, zp_v)
        graph.remove(dq, safe=True)
        return 1

    @staticmethod
    def _dequantized_rows(graph: ir.Graph, names: Names, gather: ir.Node, table: ir.Value, scale_v: ir.Value,
                          zp_v: ir.Value | None, width: int | None = None) -> None:
        """Replace ``gather`` (of the float table) by a Gather of the quantized ``table``'s rows, Cast, minus the
        gathered zero point (``zp_v`` [rows, 1]; a scalar is subtracted as it is), times the gathered scale. A
        ``table`` of MatMulNBits' [rows, blocks, block] is reshaped to [..., blocks * block], then sliced to
        ``width`` when that is less."""
        indices = present(gather.inputs[1])
        rows = ir.node("Gather", [table, indices], attributes={"axis": 0}, name=names.fresh(f"{gather.name}_q"))
        new_nodes = [rows]
        if table.shape is not None and len(table.shape) == 3:
            if indices.shape is None:  # the callers reading a 3-D table check it first
                raise ValueError(f"the rank of {gather.name}'s indices is unknown")
            flat = names.add_initializer(np.array([0] * len(indices.shape) + [-1]), f"{table.name}_row_shape")
            new_nodes.append(ir.node("Reshape", [rows.outputs[0], flat]))
            if width is not None and width < math.prod(table.shape.numpy()[1:]):
                new_nodes.append(ir.node("Slice", [new_nodes[-1].outputs[0],
                                                   names.add_initializer(np.array([0]), f"{table.name}_start"),
                                                   names.add_initializer(np.array([width]), f"{table.name}_width"),
                                                   names.add_initializer(np.array([-1]), f"{table.name}_axis")]))
        quantized = list(new_nodes)  # the nodes whose outputs are still the table's 8-bit values
        as_float = ir.node("Cast", [new_nodes[-1].outputs[0]], attributes={"to": ir.DataType.FLOAT})
        new_nodes.append(as_float)
        value = as_float.outputs[0]
        if zp_v is not None:
            if zp_v.shape is not None and len(zp_v.shape) == 2:
                zps = ir.node("Gather", [zp_v, indices], attributes={"axis": 0})
                new_nodes.append(zps)
                zp_v = zps.outputs[0]
            sub = ir.node("Sub", [value, zp_v])
            new_nodes.append(sub)
            value = sub.outputs[0]
        scales = ir.node("Gather", [scale_v, indices], attributes={"axis": 0})
        mul = ir.node("Mul", [value, scales.outputs[0]])
        new_nodes += [scales, mul]
        for i, node in enumerate(new_nodes):
            node.name = node.name or names.fresh(f"{gather.name}_dq{i}")
            for out in node.outputs:
                out.name = names.fresh(f"{node.name}/out")
                set_dtype(out, table.dtype if node in quantized else ir.DataType.FLOAT)
        graph.insert_before(gather, new_nodes)
        mul.outputs[0].shape = gather.outputs[0].shape
        bypass(graph, gather.outputs[0], mul.outputs[0])
        graph.remove(gather, safe=True)

    def _tied(self, graph: ir.Graph, names: Names, dq: ir.Node) -> int:
        """One 8-bit table for the Gathers and the lm_head Gemm(transB=1) that read it (see the module doc)."""
        parts = _dq_parts(dq)
        if parts is None:
            self.near_miss("dq-tied", dq, "DequantizeLinear inputs are not all constants")
            return 0
        q, scale, zp = parts
        if q.ndim != 2 or q.dtype not in (np.int8, np.uint8):
            self.near_miss("dq-tied", dq, f"table is {q.dtype} of rank {q.ndim}, not a 2-D 8-bit matrix")
            return 0
        n, k = q.shape
        if any(c.op_type == "Gather" and present(c.inputs[1]).shape is None for c, _ in dq.outputs[0].uses()):
            self.near_miss("dq-tied", dq, "the rank of a Gather's indices is unknown (run infer-shapes first)")
            return 0
        if scale.size == 1:
            scale, zp = np.full(n, scale.item(), np.float32), None if zp is None else np.full(n, zp.item(), zp.dtype)
        elif _int(dq, "axis", 1) % 2 != 0 or scale.size != n:
            self.near_miss("dq-tied", dq, f"scales of a [{n}, {k}] table are not one per row", score=1)
            return 0
        if q.dtype == np.int8:
            if zp is not None and np.any(zp):
                self.near_miss("dq-tied", dq, "int8 table with non-zero zero points")
                return 0
            u, zp_u8 = (q.astype(np.int16) + 128).astype(np.uint8), None
        else:
            u, zp_u8 = q, (None if zp is None else zp.astype(np.uint8).reshape(n))
        block, blocks = nbits_layout(k, 4 if zp_u8 is None else 5)
        if block * blocks > k:
            fill = np.full((n, block - k), 128, np.uint8) if zp_u8 is None else np.repeat(zp_u8[:, None], block - k, 1)
            u = np.concatenate([u, fill], axis=1)  # padded columns dequantize to exactly 0
        base = present(dq.inputs[0]).name or "table"
        b = names.add_initializer(u.reshape(n, blocks, block), f"{base}_nbits")
        nbits_inputs = [b, names.add_initializer(np.repeat(scale.astype(np.float32)[:, None], blocks, 1),
                                                 f"{base}_nbits_scale")]
        if zp_u8 is not None:
            nbits_inputs.append(names.add_initializer(np.repeat(zp_u8[:, None], blocks, 1), f"{base}_nbits_zero_point"))
        scale_v = names.add_initializer(scale.astype(np.float32).reshape(-1, 1), f"{base}_row_scale")
        zp_v = (names.add_initializer(np.array(128, np.float32), f"{base}_zero_point") if zp_u8 is None else
                names.add_initializer(zp_u8.astype(np.float32).reshape(-1, 1), f"{base}_row_zero_point"))
        for consumer, _ in list(dq.outputs[0].uses()):
            if consumer.op_type == "Gather":
                self._dequantized_rows(graph, names, consumer, b, scale_v, zp_v, k)
                continue
            attrs = {"K": k, "N": n, "bits": 8, "block_size": block}
            if self.accuracy_level is not None:
                attrs["accuracy_level"] = self.accuracy_level
            new = ir.node("MatMulNBits", [consumer.inputs[0], *nbits_inputs], attributes=attrs, domain=MS_DOMAIN,
                          name=consumer.name)
            graph.insert_before(consumer, new)
            new.outputs[0].dtype, new.outputs[0].shape = ir.DataType.FLOAT, consumer.outputs[0].shape
            name = consumer.outputs[0].name
            bypass(graph, consumer.outputs[0], new.outputs[0])
            new.outputs[0].name = name
            graph.remove(consumer, safe=True)
        graph.remove(dq, safe=True)
        return 1

    def _broadcast(self, graph: ir.Graph, names: Names, dq: ir.Node, q, scale, zp) -> int:
        """A DequantizeLinear with a scale of rank > 1 (NNCF's INT8 of a 3-D [E, K, N] weight has an [E, N] scale:
        invalid below opset 21, refused by ORT) -> (Cast(q) - zero point) * scale with the scale broadcast over K:
        the weight stays 8-bit."""
        if scale.ndim == q.ndim - 1:  # NNCF squeezes the reduction axis, K of a [..., K, N] MatMul weight
            scale = np.expand_dims(scale, -2)
            zp = None if zp is None else np.expand_dims(zp, -2)
        if scale.ndim != q.ndim:
            self.near_miss("dq-broadcast", dq, f"scale of rank {scale.ndim} for a weight of rank {q.ndim}")
            return 0
        base = present(dq.inputs[0]).name or "weight"
        value = ir.node("Cast", [dq.inputs[0]], attributes={"to": ir.DataType.FLOAT})
        new_nodes = [value]
        if zp is not None and np.any(zp):
            new_nodes.append(ir.node("Sub", [value.outputs[0], names.add_initializer(
                zp.astype(np.float32), f"{base}_zero_point_f")]))
        new_nodes.append(ir.node("Mul", [new_nodes[-1].outputs[0], names.add_initializer(
            scale.astype(np.float32), f"{base}_scale_f")]))
        for node in new_nodes:
            node.name = names.fresh(f"{dq.name}_{node.op_type}")
            node.outputs[0].name = names.fresh(f"{node.name}/out")
            node.outputs[0].dtype = ir.DataType.FLOAT
        graph.insert_before(dq, new_nodes)
        new_nodes[-1].outputs[0].shape = ir.Shape(list(q.shape))
        bypass(graph, dq.outputs[0], new_nodes[-1].outputs[0])
        graph.remove(dq, safe=True)
        return 1

    def _drop_double_bias(self, node: ir.Node) -> int:
        """NNCF 3.4 copies the bias of a MatMul -> Add(bias) into MatMulNBits' bias input and keeps the Add: the
        bias is added twice. Drop the copy (the Add stays, as in the float graph)."""
        if len(node.inputs) < 6 or node.inputs[5] is None:
            return 0
        bias = node.inputs[5]
        if not any(user.op_type == "Add" and bias in user.inputs for user, _ in node.outputs[0].uses()):
            return 0
        keep = 4 if len(node.inputs) > 3 and node.inputs[3] is not None else 3
        node.resize_inputs(keep)
        return 1

    def _pack_zero_points(self, graph: ir.Graph, names: Names, node: ir.Node) -> int:
        if _int(node, "bits", 4) != 4 or len(node.inputs) < 4 or node.inputs[3] is None:
            return 0
        k, n, block = _int(node, "K", 0), _int(node, "N", 0), _int(node, "block_size", 0)
        blocks = -(-k // block) if block else 0
        shape = node.inputs[3].shape
        if shape is not None and shape.is_static() and math.prod(shape.numpy()) != n * blocks:
            return 0  # already packed, seen from the shape alone: a lazy tensor is not computed to be passed by
        zp = constant_array(node.inputs[3])
        if zp is None or zp.dtype != np.uint8 or blocks < 2 or zp.size != n * blocks:
            return 0  # already packed (or float zero points, which ORT takes as they are)
        packed = pack_nibbles(zp.reshape(n, blocks))
        node.replace_input_with(3, names.add_initializer(packed, f"{node.inputs[3].name}_packed"))
        return 1
