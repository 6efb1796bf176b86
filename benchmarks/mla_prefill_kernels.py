"""MLA prefill at DeepSeek-V3's attention widths, one layer's attention alone: today's absorbed form in query chunks
against the per-head form on ONNX Runtime's fused (score-free) attention kernels, to learn whether issue #37's
per-head prefill can be made fast before rebuilding the export.

The widths: 128 heads, qk_nope 128 + rope 64, v 128, kv_lora_rank 512; random queries, latent and rotary keys
(the time does not depend on the values); one sequence of --tokens positions from an empty cache, fp32, 2 threads.

- ``absorbed``: today's latent graph (toolchain/export/deepseek.py): per chunk of C queries (toolchain/runtime/
  prefill_chunks.py's spans, the score budget of a 2-layer shape-faithful V3 INT4 model, weights/16), scores
  q_nope·W_uk·latent^T + q_rot·k_rot^T against the T = end-of-chunk cached positions, masked Softmax, ·latent, ·W_uv.
- ``gqa``: the per-head form, K/V decompressed once with kv_b_proj, on com.microsoft.GroupQueryAttention, whose CPU
  kernel has a flash path that is causal and holds no [B, H, S, T] score tensor (ORT_GQA_DISABLE_FLASH_ATTENTION=1
  switches it off); the op wants V's head size equal to q/k's, so V is padded with zeros from 128 to 192 and the
  padding sliced off the output.
- ``flash``: the same on com.microsoft.MultiHeadAttention's MLAS flash path, which it takes only with no mask, no
  causal flag and no past/present (onnxruntime/contrib_ops/cpu/bert/multihead_attention.cc, the
  ``!is_unidirectional_ && key_padding_mask == nullptr && extra_add_qk == nullptr && past_key == nullptr``
  condition), but any v head size. Causality by query blocks of --block: block j's queries read the keys before
  the block through the flash kernel (unmasked: all visible) and the block's own keys through explicit masked
  MatMuls ([H, C, C] scores), the two merged exactly by their softmax normalisers. The flash kernel returns
  normalised outputs only; its normaliser comes back through one extra key whose score is the block's own row
  maximum m (an extra query component m against an extra key component 1/scale) and whose value is a unit extra
  column: that column's output is e^m / (Z + e^m), so Z·e^-m = 1/out - 1 and the numerator is the value columns
  / out. (Exact in arithmetic; in fp32 while a row's earlier scores stay within ~87 of its own block's maximum.)
- ``plain``: the per-head form as plain MatMul/Softmax over the whole prompt (what the last attempt built), only
  with --plain (it holds 4·H·S² bytes of scores: 8 GiB at 4k).

OpenVINO has no variant here: its CPU plugin keeps ScaledDotProductAttention as its fused node over a KV-cache state
(StatefulSDPAFusion); a per-head SDPA over tensors computed in the graph is decomposed into MatMul/Softmax (a
snippets Subgraph) holding the scores. ``--survey`` shows it, and each ONNX Runtime op's time and memory alone.

Each variant runs in a child process under harness.run_measured (process-tree peak RSS); the parent checks each
output against ``absorbed`` (max |diff| over the output range) and prints the table.

    nice -n 10 .venv/bin/python benchmarks/mla_prefill_kernels.py --tokens 4096 --workdir /tmp/prefill/kernels
    nice -n 10 .venv/bin/python benchmarks/mla_prefill_kernels.py --survey --tokens 2048
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

sys.modules["openvino_telemetry"] = None  # it forks per event; see tests/conftest.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a script: the harness is imported from the repo
from benchmarks import harness  # noqa: E402
from toolchain.runtime.prefill_chunks import PrefillChunking  # noqa: E402


@dataclass(frozen=True)
class Widths:
    heads: int = 128
    nope: int = 128
    rope: int = 64
    v: int = 128
    rank: int = 512

    @property
    def qk(self) -> int:
        return self.nope + self.rope

    @property
    def scale(self) -> float:
        return self.qk ** -0.5


V3 = Widths()
WEIGHTS_BYTES = int(2.42 * harness.GIB)  # the 2-layer shape-faithful V3 INT4 model's files: today's chunk budget
F32 = TensorProto.FLOAT
VARIANTS = ("absorbed", "flash", "gqa", "plain", "flash-unfused")


def inputs(w: Widths, tokens: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, std: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return {"q_nope": normal(1, w.heads, tokens, w.nope), "q_rot": normal(1, w.heads, tokens, w.rope),
            "latent": normal(1, tokens, w.rank), "k_rot": normal(1, tokens, w.rope),
            "kv_b": normal(w.rank, w.heads * (w.nope + w.v), std=w.rank ** -0.5)}


def causal_mask(rows: int, cols: int, offset: int) -> np.ndarray:
    """[1, 1, rows, cols] additive: query offset + i sees keys 0 .. offset + i."""
    q = np.arange(rows)[:, None] + offset
    return np.where(np.arange(cols)[None, :] <= q, 0.0, -np.inf).astype(np.float32)[None, None]


class Graph:
    """A few helpers over onnx.helper: nodes get fresh output names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count = 0

    def op(self, kind: str, *args: str, outputs: int = 1, domain: str = "", **attrs) -> str | list[str]:
        names = [f"t{self.count}_{i}" for i in range(outputs)]
        self.count += 1
        self.nodes.append(helper.make_node(kind, list(args), names, domain=domain, **attrs))
        return names[0] if outputs == 1 else names

    def const(self, value) -> str:
        array = np.asarray(value)
        name = f"c{len(self.inits)}"
        self.inits.append(onnx.numpy_helper.from_array(array, name))
        return name

    def model(self, ins: list[tuple[str, list]], out: str) -> bytes:
        graph = helper.make_graph(self.nodes, "g", [helper.make_tensor_value_info(n, F32, s) for n, s in ins],
                                  [helper.make_tensor_value_info(out, F32, None)], self.inits)
        opsets = [helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)]
        return helper.make_model(graph, opset_imports=opsets).SerializeToString()


def absorbed_graph(w: Widths, kv_b: np.ndarray) -> bytes:
    """One chunk of today's latent attention: queries [1, H, C, *], cache [1, T, *], mask [1, 1, C, T]."""
    g = Graph()
    kv = kv_b.reshape(w.rank, w.heads, w.nope + w.v)
    w_uk = g.const(np.ascontiguousarray(kv[:, :, :w.nope].transpose(1, 2, 0)))  # [H, nope, rank]
    w_uv = g.const(np.ascontiguousarray(kv[:, :, w.nope:].transpose(1, 0, 2)))  # [H, rank, v]
    latent = g.op("Unsqueeze", "latent", g.const([1]))  # [1, 1, T, rank]
    k_rot = g.op("Unsqueeze", "k_rot", g.const([1]))
    q_abs = g.op("MatMul", "q_nope", w_uk)  # [1, H, C, rank]
    scores = g.op("Add", g.op("MatMul", q_abs, g.op("Transpose", latent, perm=[0, 1, 3, 2])),
                  g.op("MatMul", "q_rot", g.op("Transpose", k_rot, perm=[0, 1, 3, 2])))
    probs = g.op("Softmax", g.op("Add", g.op("Mul", scores, g.const(np.float32(w.scale))), "mask"), axis=-1)
    out = g.op("MatMul", g.op("MatMul", probs, latent), w_uv)  # [1, H, C, v]
    return g.model([("q_nope", [1, w.heads, "C", w.nope]), ("q_rot", [1, w.heads, "C", w.rope]),
                    ("latent", [1, "T", w.rank]), ("k_rot", [1, "T", w.rope]), ("mask", [1, 1, "C", "T"])], out)


def decompressed(g: Graph, w: Widths, kv_b: np.ndarray, extra: bool) -> tuple[str, str]:
    """Per-head keys [1, S, H, nope + rope (+1)] and values [1, S, H, v (+1)] from the latent, extra zero columns
    with ``extra``."""
    kv = g.op("Reshape", g.op("MatMul", "latent", g.const(kv_b)), g.const([1, -1, w.heads, w.nope + w.v]))
    k_nope, v = g.op("Split", kv, g.const([w.nope, w.v]), axis=-1, outputs=2)
    rot = g.op("Expand", g.op("Unsqueeze", "k_rot", g.const([2])), g.const([1, 1, w.heads, 1]))
    parts = [k_nope, rot]
    if extra:
        zero = g.op("Mul", g.op("Slice", v, g.const([0]), g.const([1]), g.const([3])), g.const(np.float32(0)))
        parts.append(zero)
        v = g.op("Concat", v, zero, axis=-1)
    return g.op("Concat", *parts, axis=-1), v


def flash_graph(w: Widths, kv_b: np.ndarray, tokens: int, block: int) -> bytes:
    """The per-head form over the whole prompt, causal by query blocks: flash kernel for the keys before a block,
    masked MatMuls within it (module doc)."""
    g = Graph()
    keys, values = decompressed(g, w, kv_b, extra=True)  # [1, S, H, qk + 1], [1, S, H, v + 1]
    q = g.op("Transpose", g.op("Concat", "q_nope", "q_rot", axis=-1), perm=[0, 2, 1, 3])  # [1, S, H, 192]
    k_extra = g.const(np.concatenate([np.zeros(w.qk), [1 / w.scale]]).astype(np.float32)[None, None, None]
                      * np.ones((1, 1, w.heads, 1), np.float32))  # its score: the query's extra component
    v_extra = g.const(np.concatenate([np.zeros(w.v), [1.0]]).astype(np.float32)[None, None, None]
                      * np.ones((1, 1, w.heads, 1), np.float32))
    scale = g.const(np.float32(w.scale))
    outs = []
    for start in range(0, tokens, block):
        end = min(tokens, start + block)
        a, b, ax = g.const([start]), g.const([end]), g.const([1])
        qb = g.op("Slice", q, a, b, ax)  # [1, C, H, 192]
        kb = g.op("Slice", keys, a, b, ax)
        vb = g.op("Slice", values, a, b, ax)
        # the block's own keys, masked: [1, H, C, C]
        s_diag = g.op("Add", g.op("Mul", g.op("MatMul", g.op("Transpose", qb, perm=[0, 2, 1, 3]), g.op(
            "Transpose", g.op("Slice", kb, g.const([0]), g.const([w.qk]), g.const([3])), perm=[0, 2, 3, 1])), scale),
            g.const(causal_mask(end - start, end - start, 0)))
        m = g.op("ReduceMax", s_diag, g.const([-1]), keepdims=1)  # [1, H, C, 1]
        e = g.op("Exp", g.op("Sub", s_diag, m))
        z_diag = g.op("ReduceSum", e, g.const([-1]), keepdims=1)
        n_diag = g.op("MatMul", e, g.op("Transpose", g.op("Slice", vb, g.const([0]), g.const([w.v]),
                                                          g.const([3])), perm=[0, 2, 1, 3]))  # [1, H, C, v]
        # the keys before the block, and the extra key, through the flash kernel
        q_ext = g.op("Concat", qb, g.op("Transpose", m, perm=[0, 2, 1, 3]), axis=-1)
        k_pre = g.op("Concat", g.op("Slice", keys, g.const([0]), a, ax), k_extra, axis=1)
        v_pre = g.op("Concat", g.op("Slice", values, g.const([0]), a, ax), v_extra, axis=1)
        flat = g.const([1, 0, -1])
        o = g.op("MultiHeadAttention", g.op("Reshape", q_ext, flat), g.op("Reshape", k_pre, flat),
                 g.op("Reshape", v_pre, flat), domain="com.microsoft", num_heads=w.heads, scale=w.scale)
        o = g.op("Transpose", g.op("Reshape", o, g.const([1, 0, w.heads, w.v + 1])), perm=[0, 2, 1, 3])
        o_v, o_x = g.op("Split", o, g.const([w.v, 1]), axis=-1, outputs=2)  # [1, H, C, v], [1, H, C, 1]
        z_pre = g.op("Sub", g.op("Reciprocal", o_x), g.const(np.float32(1)))
        n_pre = g.op("Div", o_v, o_x)
        outs.append(g.op("Div", g.op("Add", n_pre, n_diag), g.op("Add", z_pre, z_diag)))
    out = g.op("Concat", *outs, axis=2)  # [1, H, S, v]
    return g.model(_prompt_inputs(w, tokens), out)


def gqa_graph(w: Widths, kv_b: np.ndarray, tokens: int) -> bytes:
    """The per-head form over the whole prompt on com.microsoft.GroupQueryAttention (causal in its kernel), V padded
    with zeros to the q/k head size the op requires, the padding sliced off its output."""
    g = Graph()
    keys, values = decompressed(g, w, kv_b, extra=False)  # [1, S, H, qk], [1, S, H, v]
    pad = g.op("Mul", g.op("Slice", keys, g.const([0]), g.const([w.qk - w.v]), g.const([3])), g.const(np.float32(0)))
    values = g.op("Concat", values, pad, axis=-1)  # [1, S, H, qk]
    q = g.op("Transpose", g.op("Concat", "q_nope", "q_rot", axis=-1), perm=[0, 2, 1, 3])
    flat = g.const([1, 0, -1])
    seqlens = g.const(np.array([tokens - 1], np.int32))  # the op's "total length - 1" per sequence
    total = g.const(np.array(tokens, np.int32))
    o = g.op("GroupQueryAttention", g.op("Reshape", q, flat), g.op("Reshape", keys, flat),
             g.op("Reshape", values, flat), "", "", seqlens, total, outputs=3, domain="com.microsoft",
             num_heads=w.heads, kv_num_heads=w.heads, scale=w.scale)[0]
    o = g.op("Slice", g.op("Reshape", o, g.const([1, 0, w.heads, w.qk])), g.const([0]), g.const([w.v]),
             g.const([3]))
    return g.model(_prompt_inputs(w, tokens), g.op("Transpose", o, perm=[0, 2, 1, 3]))


def _prompt_inputs(w: Widths, tokens: int) -> list[tuple[str, list]]:
    return [("q_nope", [1, w.heads, tokens, w.nope]), ("q_rot", [1, w.heads, tokens, w.rope]),
            ("latent", [1, tokens, w.rank]), ("k_rot", [1, tokens, w.rope])]


def plain_graph(w: Widths, kv_b: np.ndarray, tokens: int) -> bytes:
    g = Graph()
    keys, values = decompressed(g, w, kv_b, extra=False)
    q = g.op("Concat", "q_nope", "q_rot", axis=-1)
    s = g.op("MatMul", q, g.op("Transpose", keys, perm=[0, 2, 3, 1]))
    probs = g.op("Softmax", g.op("Add", g.op("Mul", s, g.const(np.float32(w.scale))),
                                 g.const(causal_mask(tokens, tokens, 0))), axis=-1)
    out = g.op("MatMul", probs, g.op("Transpose", values, perm=[0, 2, 1, 3]))
    return g.model(_prompt_inputs(w, tokens), out)


def session(model: bytes):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def absorbed_chunked(sess, x: dict[str, np.ndarray], spans: list[tuple[int, int]]) -> np.ndarray:
    """Today's prefill: each chunk's queries over the cache up to the chunk's end, [1, H, S, v]."""
    return np.concatenate([sess.run(None, {"q_nope": x["q_nope"][:, :, a:b], "q_rot": x["q_rot"][:, :, a:b],
                                           "latent": x["latent"][:, :b], "k_rot": x["k_rot"][:, :b],
                                           "mask": causal_mask(b - a, b, a)})[0] for a, b in spans], axis=2)


def child(variant: str, tokens: int, block: int, out: Path) -> None:
    x = inputs(V3, tokens)
    if variant == "absorbed":
        sess = session(absorbed_graph(V3, x["kv_b"]))
        spans = PrefillChunking.for_model({"num_attention_heads": V3.heads}, WEIGHTS_BYTES).spans(1, 0, tokens)
        started = time.perf_counter()
        result = absorbed_chunked(sess, x, spans)
        seconds = time.perf_counter() - started
        detail = f"{len(spans)} chunks (largest {max(b - a for a, b in spans)})"
    else:
        per_head = variant.startswith("flash")
        model = (flash_graph(V3, x["kv_b"], tokens, block) if per_head else gqa_graph(V3, x["kv_b"], tokens)
                 if variant == "gqa" else plain_graph(V3, x["kv_b"], tokens))
        ops = sorted({n.op_type for n in onnx.load_from_string(model).graph.node})
        sess = session(model)
        started = time.perf_counter()
        result = sess.run(None, {k: v for k, v in x.items() if k != "kv_b"})[0]
        seconds = time.perf_counter() - started
        detail = f"one forward, query blocks of {block}" if per_head else "one forward"
        detail += f"; ops: {', '.join(ops)}"
    np.save(out, result)
    print(json.dumps({"seconds": seconds, "detail": detail}))


KERNELS = ("ort-attention23-causal", "ort-gqa", "ort-gqa-unfused", "ort-mha-noncausal", "openvino-sdpa-causal",
           "openvino-sdpa-mask")


def kernel_child(kernel: str, tokens: int) -> None:
    """One attention op alone over random per-head q/k/v at V3 widths (q/k 192, v 128; 192 where the op wants
    equal sizes): its time and, for OpenVINO, the compiled model's layer types (is the SDPA kept?)."""
    rng = np.random.default_rng(0)
    w, v_dim = V3, V3.qk if kernel.startswith("ort-gqa") else V3.v

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    detail = ""
    if kernel.startswith("ort"):
        g = Graph()
        if kernel == "ort-attention23-causal":  # ONNX's Attention, 4-D [B, H, S, *]
            names, shapes = ["q", "k", "v"], [[1, w.heads, tokens, w.qk]] * 2 + [[1, w.heads, tokens, v_dim]]
            out = g.op("Attention", *names, is_causal=1, scale=w.scale)
            opset = 23
        else:  # contrib ops, [B, S, H * head]
            names = ["q", "k", "v"]
            shapes = [[1, tokens, w.heads * w.qk]] * 2 + [[1, tokens, w.heads * v_dim]]
            opset = 18
            if kernel.startswith("ort-gqa"):
                out = g.op("GroupQueryAttention", *names, "", "", g.const(np.array([tokens - 1], np.int32)),
                           g.const(np.array(tokens, np.int32)), outputs=3, domain="com.microsoft",
                           num_heads=w.heads, kv_num_heads=w.heads, scale=w.scale)[0]
            else:
                out = g.op("MultiHeadAttention", *names, domain="com.microsoft", num_heads=w.heads, scale=w.scale)
        graph = helper.make_graph(g.nodes, "g", [helper.make_tensor_value_info(n, F32, s)
                                                 for n, s in zip(names, shapes, strict=True)],
                                  [helper.make_tensor_value_info(out, F32, None)], g.inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                        helper.make_opsetid("com.microsoft", 1)])
        sess = session(model.SerializeToString())
        feeds = {n: normal(*s) for n, s in zip(names, shapes, strict=True)}
        started = time.perf_counter()
        sess.run(None, feeds)
    else:
        import openvino as ov
        from openvino import opset13 as ops
        from openvino.op.util import Variable, VariableInfo

        params = [ops.parameter([1, w.heads, -1, size], np.float32) for size in (w.qk, w.qk, v_dim)]
        if kernel == "openvino-sdpa-mask":
            params.append(ops.parameter([1, 1, -1, -1], np.float32))
        sdpa = ops.scaled_dot_product_attention(*params, scale=ops.constant(np.float32(w.scale)),
                                                causal=kernel == "openvino-sdpa-causal")
        info = VariableInfo()  # a variable, as in dstc's stateful IRs: the plugin's SDPA callback looks for one
        info.data_shape, info.data_type, info.variable_id = ov.PartialShape([1]), ov.Type.f32, "state"
        variable = Variable(info)
        state = ops.read_value(ops.constant(np.zeros(1, np.float32)), variable)
        model = ov.Model([sdpa.output(0), state.output(0)], [ops.assign(state, variable)], params)
        compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_NUM_THREADS": 2,
                                                          "INFERENCE_PRECISION_HINT": "f32"})
        layers = sorted({op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ops()})
        detail = "layer types: " + ", ".join(layers)
        feeds = [normal(1, w.heads, tokens, size) for size in (w.qk, w.qk, v_dim)]
        if kernel == "openvino-sdpa-mask":
            feeds.append(causal_mask(tokens, tokens, 0))
        request = compiled.create_infer_request()
        started = time.perf_counter()
        request.infer(feeds)
    print(json.dumps({"seconds": time.perf_counter() - started, "detail": detail}))


def survey(tokens: int) -> None:
    """Each kernel alone (kernel_child) in a child process: its time and the process tree's peak RSS, inputs in."""
    rows = []
    for kernel in KERNELS:
        env = {"ORT_GQA_DISABLE_FLASH_ATTENTION": "1"} if kernel == "ort-gqa-unfused" else None
        run = harness.run_measured([sys.executable, __file__, "--kernel", kernel, "--tokens", str(tokens)], env=env,
                                   timeout=3600)
        if run.returncode != 0:
            rows.append([kernel, "failed", "", run.last_line()])
            continue
        report = json.loads(run.last_line())
        rows.append([kernel, f"{report['seconds']:.1f}", f"{run.peak_bytes / harness.GIB:.2f}", report["detail"]])
    print(harness.markdown_table(["kernel", "seconds", "peak RSS GiB", "detail"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--block", type=int, default=512, help="the flash variant's query block")
    parser.add_argument("--workdir", type=Path, help="where the variants' outputs go (not with --survey)")
    parser.add_argument("--plain", action="store_true", help="also the per-head form on plain MatMuls")
    parser.add_argument("--control", action="store_true",
                        help="also the flash variant with ONNX Runtime's flash path switched off "
                             "(ORT_DISABLE_FLASH_ATTENTION=1: the same graph, the kernel holding its scores)")
    parser.add_argument("--child", choices=VARIANTS)
    parser.add_argument("--survey", action="store_true",
                        help="instead: each runtime's attention ops alone over per-head q/k/v (KERNELS)")
    parser.add_argument("--kernel", choices=KERNELS)
    args = parser.parse_args()
    if args.kernel:
        kernel_child(args.kernel, args.tokens)
        return
    if args.survey:
        with harness.one_at_a_time():
            survey(args.tokens)
        return
    if args.workdir is None:
        parser.error("--workdir is required")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.child:
        child(args.child, args.tokens, args.block, args.workdir / f"{args.child}.npy")
        return
    rows, reference = [], None
    with harness.one_at_a_time():
        for variant in ("absorbed", "flash", "gqa", *(("plain",) if args.plain else ()),
                        *(("flash-unfused",) if args.control else ())):
            cmd = [sys.executable, __file__, "--child", variant, "--tokens", str(args.tokens), "--block",
                   str(args.block), "--workdir", str(args.workdir)]
            env = {"ORT_DISABLE_FLASH_ATTENTION": "1"} if variant == "flash-unfused" else None
            run = harness.run_measured(cmd, env=env, timeout=3600)
            if run.returncode != 0:
                rows.append([variant, "failed", "", "", "", run.last_line()])
                continue
            report = json.loads(run.last_line())
            result = np.load(args.workdir / f"{variant}.npy")
            if reference is None:
                reference, base = result, report["seconds"]
            diff = float(np.abs(result - reference).max() / np.abs(reference).max())
            rows.append([variant, f"{report['seconds']:.1f}", f"{report['seconds'] / base:.2f}",
                         f"{run.peak_bytes / harness.GIB:.2f}", f"{diff:.1e}", report["detail"]])
    print(harness.markdown_table(["variant", "prefill s", "ratio", "peak RSS GiB", "max |diff| / range", "how"],
                                 rows))


if __name__ == "__main__":
    main()
