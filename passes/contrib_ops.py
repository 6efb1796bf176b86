"""ONNX schemas for the ONNX Runtime contrib ops that dstc's fusions emit, so the ONNX checker and shape inference
(the pipeline's validation, ``infer-shapes``) accept and type them.

ONNX Runtime registers these ops in its own process only; ``onnx`` does not know them. Without a schema the
checker rejects ``SimplifiedLayerNormalization``, which ORT registers in the *default* domain, and shape
inference leaves every value after a ``com.microsoft`` op untyped. The signatures below follow ONNX Runtime
1.32's registrations (inputs, outputs and attributes by position and name); each comes with a shape inference
function for the outputs dstc relies on. Registration is process-wide and idempotent: :func:`register` is
called when a fusion module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import onnx
from onnx import defs

MS_DOMAIN = "com.microsoft"
_S = defs.OpSchema
_FLOATS = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(double)"]
_registered = False


def _param(name: str, type_str: str, optional: bool = False) -> defs.OpSchema.FormalParameter:
    option = _S.FormalParameterOption.Optional if optional else _S.FormalParameterOption.Single
    return _S.FormalParameter(name, type_str, param_option=option)


def _attr(name: str, kind: str) -> defs.OpSchema.Attribute:
    return _S.Attribute(name, getattr(_S.AttrType, kind), "", required=False)


def _tensor(elem_type: int, dims: Sequence[int | str | None] | None) -> onnx.TypeProto:
    t = onnx.TypeProto()
    t.tensor_type.elem_type = elem_type
    if dims is not None:
        shape = t.tensor_type.shape
        shape.SetInParent()
        for d in dims:
            dim = shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
    return t


def _dims(ctx, index: int) -> list[int | str | None] | None:
    """The input's dims (int, symbol or None for unknown), or None when its shape is unknown."""
    if index >= ctx.get_num_inputs() or not ctx.has_input(index):
        return None
    t = ctx.get_input_type(index)
    if t is None or not t.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.tensor_type.shape.dim]


def _elem(ctx, index: int) -> int:
    return ctx.get_input_type(index).tensor_type.elem_type


def _int_attr(ctx, name: str, default: int) -> int:
    attr = ctx.get_attribute(name)
    return attr.i if attr is not None else default


def _set(ctx, index: int, elem_type: int, dims) -> None:
    if index < ctx.get_num_outputs() and ctx.has_output(index):
        ctx.set_output_type(index, _tensor(elem_type, dims))


def _same_as_input(*outputs: int) -> Callable:
    def infer(ctx) -> None:
        for i in outputs:
            _set(ctx, i, _elem(ctx, 0), _dims(ctx, 0))

    return infer


def _group_query_attention(ctx) -> None:
    """output [B, S, num_heads * head_size]; present [B, kv_num_heads, ?, head_size] (total length unknown)."""
    query = _dims(ctx, 0)
    num_heads, kv_heads = _int_attr(ctx, "num_heads", 0), _int_attr(ctx, "kv_num_heads", 0)
    head_size = None
    if query is not None and isinstance(query[2], int) and num_heads and ctx.has_input(1):
        head_size = query[2] // num_heads
    elif query is not None and isinstance(query[2], int) and num_heads and kv_heads:  # packed QKV
        head_size = query[2] // (num_heads + 2 * kv_heads)
    batch, seq = (query[0], query[1]) if query is not None else (None, None)
    _set(ctx, 0, _elem(ctx, 0), [batch, seq, num_heads * head_size if head_size else None])
    for i in (1, 2):
        _set(ctx, i, _elem(ctx, 0), [batch, kv_heads, None, head_size])


def _multi_head_attention(ctx) -> None:
    query, value = _dims(ctx, 0), _dims(ctx, 2)
    v_hidden = None
    if value is not None and len(value) == 3:
        v_hidden = value[2]
    elif value is not None and len(value) == 4 and isinstance(value[3], int) and isinstance(value[1], int):
        v_hidden = value[1] * value[3]
    _set(ctx, 0, _elem(ctx, 0), [query[0], query[1], v_hidden] if query is not None else None)


def _schema(name: str, domain: str, inputs, outputs, constraints, attributes, infer: Callable) -> defs.OpSchema:
    schema = _S(name, domain, 1, doc=f"ONNX Runtime contrib op {name} (schema registered by dstc passes)",
                inputs=inputs, outputs=outputs, type_constraints=constraints, attributes=attributes)
    schema.set_type_and_shape_inference_function(infer)
    return schema


def _schemas() -> list[defs.OpSchema]:
    t, v = ("T", _FLOATS, ""), ("V", _FLOATS, "")
    u = ("U", ["tensor(float)", "tensor(double)"], "")
    return [
        # ORT registers SimplifiedLayerNormalization in the default ONNX domain, version 1.
        _schema("SimplifiedLayerNormalization", "",
                [_param("X", "T"), _param("scale", "V")],
                [_param("Y", "V"), _param("inv_std_var", "U", True)],
                [t, u, v], [_attr("axis", "INT"), _attr("epsilon", "FLOAT"), _attr("stash_type", "INT")],
                _same_as_input(0)),
        _schema("SkipSimplifiedLayerNormalization", MS_DOMAIN,
                [_param("input", "T"), _param("skip", "T"), _param("gamma", "T"), _param("bias", "T", True)],
                [_param("output", "T"), _param("mean", "U", True), _param("inv_std_var", "U", True),
                 _param("input_skip_bias_sum", "T", True)],
                [t, u], [_attr("epsilon", "FLOAT")], _same_as_input(0, 3)),
        _schema("RotaryEmbedding", MS_DOMAIN,
                [_param("input", "T"), _param("position_ids", "M"), _param("cos_cache", "T"),
                 _param("sin_cache", "T")],
                [_param("output", "T")], [t, ("M", ["tensor(int64)"], "")],
                [_attr(a, "INT") for a in ("interleaved", "is_packed_batching", "num_heads", "rotary_embedding_dim")]
                + [_attr("scale", "FLOAT")], _same_as_input(0)),
        _schema("QuickGelu", MS_DOMAIN, [_param("X", "T")], [_param("Y", "T")], [t], [_attr("alpha", "FLOAT")],
                _same_as_input(0)),
        _schema("GroupQueryAttention", MS_DOMAIN,
                [_param("query", "T"), _param("key", "T", True), _param("value", "T", True),
                 _param("past_key", "T", True), _param("past_value", "T", True), _param("seqlens_k", "M"),
                 _param("total_sequence_length", "M"), _param("cos_cache", "T", True),
                 _param("sin_cache", "T", True), _param("position_ids", "P", True),
                 _param("attention_bias", "T", True), _param("head_sink", "T", True), _param("k_scale", "T", True),
                 _param("v_scale", "T", True), _param("q_norm_weight", "T", True),
                 _param("k_norm_weight", "T", True), _param("query_seqlens", "M", True)],
                [_param("output", "T"), _param("present_key", "T", True), _param("present_value", "T", True),
                 _param("output_qk", "T", True)],
                [t, ("M", ["tensor(int32)"], ""), ("P", ["tensor(int64)"], "")],
                [_attr(a, "INT") for a in ("num_heads", "kv_num_heads", "do_rotary", "rotary_interleaved",
                                           "local_window_size", "causal", "smooth_softmax", "qk_output",
                                           "sliding_window_cache", "kv_cache_bit_width")]
                + [_attr(a, "FLOAT") for a in ("scale", "softcap", "qk_norm_epsilon", "q_norm_epsilon",
                                               "k_norm_epsilon")]
                + [_attr(a, "STRING") for a in ("k_quant_type", "v_quant_type")],
                _group_query_attention),
        _schema("MultiHeadAttention", MS_DOMAIN,
                [_param("query", "T"), _param("key", "T", True), _param("value", "T", True),
                 _param("bias", "T", True), _param("key_padding_mask", "M", True),
                 _param("attention_bias", "T", True), _param("past_key", "T", True),
                 _param("past_value", "T", True), _param("past_sequence_length", "M", True),
                 _param("cache_indirection", "M", True)],
                [_param("output", "T"), _param("present_key", "T", True), _param("present_value", "T", True),
                 _param("qk", "T", True)],
                [t, ("M", ["tensor(int32)"], "")],
                [_attr("num_heads", "INT"), _attr("unidirectional", "INT"), _attr("scale", "FLOAT"),
                 _attr("mask_filter_value", "FLOAT")],
                _multi_head_attention),
    ]


def register() -> None:
    """Make the schemas known to ``onnx`` (once per process; a schema ``onnx`` already has is left alone)."""
    global _registered
    if _registered:
        return
    # onnx.reference indexes schemas by name alone when first imported, and ONNX has its own RotaryEmbedding
    # (opset 23): let it build that index before com.microsoft's RotaryEmbedding joins the registry.
    import onnx.reference.op_run  # noqa: F401

    for schema in _schemas():
        try:
            defs.get_schema(schema.name, 1, schema.domain)
        except defs.SchemaError:
            defs.register_schema(schema)
    _registered = True
