"""A one-layer attention graph written as dstc's exporter writes it (blocks.sdpa over a Concat KV cache), and
feeds for it, for tests/passes/test_fuse_*_attention.py."""

from __future__ import annotations

import numpy as np
from passes_helpers import make_model, node, rand

MASK_MIN = float(np.finfo(np.float32).min)


def attention_model(heads=4, kv_heads=2, k_dim=8, v_dim=8, *, with_mask=True, merge_output=True, extra_ops=()):
    """q3/k3/v3 [B, S, n * d] -> heads -> Concat with past -> repeat_kv -> softmax(q K^T * scale + mask) V."""
    n_rep = heads // kv_heads
    nodes = []
    for x, n, d in (("q", heads, k_dim), ("k", kv_heads, k_dim), ("v", kv_heads, v_dim)):
        nodes += [node("Reshape", [f"{x}3", f"split_{x}"], [f"{x}_bsnd"]),
                  node("Transpose", [f"{x}_bsnd"], [f"{x}4"], perm=[0, 2, 1, 3])]
    nodes += [node("Concat", ["past_key", "k4"], ["present_key"], axis=2),
              node("Concat", ["past_value", "v4"], ["present_value"], axis=2)]
    kv = {"k": "present_key", "v": "present_value"}
    if n_rep > 1:
        for x, d in (("k", k_dim), ("v", v_dim)):
            nodes += [node("Unsqueeze", [kv[x], "axis2"], [f"{x}_u"]), node("Expand", [f"{x}_u", "reps"], [f"{x}_e"]),
                      node("Reshape", [f"{x}_e", f"rep_{x}"], [f"{x}_rep"])]
        kv = {"k": "k_rep", "v": "v_rep"}
    nodes += [node("Transpose", [kv["k"]], ["kt"], perm=[0, 1, 3, 2]), node("MatMul", ["q4", "kt"], ["qk"]),
              node("Mul", ["qk", "scale"], ["scores"])]
    if with_mask:
        nodes.append(node("Add", ["scores", "mask"], ["masked"]))
    nodes += [node("Softmax", ["masked" if with_mask else "scores"], ["probs"], axis=-1),
              node("MatMul", ["probs", kv["v"]], ["o4"])]
    if merge_output:
        nodes += [node("Transpose", ["o4"], ["o_bsnd"], perm=[0, 2, 1, 3]),
                  node("Reshape", ["o_bsnd", "merge"], ["out"])]
    else:
        nodes.append(node("Identity", ["o4"], ["out"]))
    nodes += list(extra_ops)
    inits = {"split_q": np.array([0, 0, heads, k_dim]), "split_k": np.array([0, 0, kv_heads, k_dim]),
             "split_v": np.array([0, 0, kv_heads, v_dim]), "axis2": np.array([2]),
             "reps": np.array([1, 1, n_rep, 1, 1]), "rep_k": np.array([0, heads, -1, k_dim]),
             "rep_v": np.array([0, heads, -1, v_dim]), "scale": np.float32(k_dim ** -0.5),
             "merge": np.array([0, 0, -1])}
    inputs = {"q3": ["B", "S", heads * k_dim], "k3": ["B", "S", kv_heads * k_dim], "v3": ["B", "S", kv_heads * v_dim],
              "past_key": ["B", kv_heads, "P", k_dim], "past_value": ["B", kv_heads, "P", v_dim]}
    if with_mask:
        inputs["mask"] = ["B", 1, "S", "T"]
    outputs = ["out", "present_key", "present_value", *[o for n in extra_ops for o in n.output]]
    model = make_model(nodes, inputs, outputs, inits)
    for name in [n for n, v in model.graph.initializers.items() if not v.uses()]:
        del model.graph.initializers[name]
    return model


def attention_feeds(model, batch=2, seq=3, past=4, padding=2, seed=0) -> dict[str, np.ndarray]:
    """Random q/k/v and cache; the mask causal over absolute positions with the second row left-padded by
    ``padding`` keys (no query row is fully masked as long as padding <= past)."""
    total = past + seq
    feeds = {}
    for i, value in enumerate(model.graph.inputs):
        dims = [{"B": batch, "S": seq, "P": past, "T": total}.get(str(d), d) for d in value.shape]
        feeds[value.name] = rand(*dims, seed=seed + i)
    if "mask" in feeds:
        keep = np.ones((batch, total), bool)
        keep[1, :padding] = False
        allowed = (np.arange(total) <= np.arange(past, total)[:, None])[None, None] & keep[:, None, None, :]
        feeds["mask"] = np.where(allowed, 0.0, MASK_MIN).astype(np.float32)
    return feeds
