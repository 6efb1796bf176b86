"""A rotary embedding written as dstc's exporter writes it (blocks.rope_tables / apply_rope), and feeds for it,
for tests/passes/test_fuse_rotary_embedding.py and tests/passes/test_rotate_half_split.py."""

from __future__ import annotations

import numpy as np
from passes_helpers import make_model, node, rand

B, H, S, D = 2, 3, 5, 8
POSITIONS = np.array([[0, 1, 2, 3, 4], [0, 0, 0, 1, 2]], np.int64)  # the second row left-padded by two


def tables(scaling=None, tables_from_inputs=False):
    if tables_from_inputs:
        return [], {"cos4": [B, 1, S, D], "sin4": [B, 1, S, D]}, {}
    nodes = [node("Cast", ["position_ids"], ["pf"], to=1), node("Unsqueeze", ["pf", "minus_one"], ["pu"]),
             node("Mul", ["pu", "inv_freq"], ["freqs"]), node("Concat", ["freqs", "freqs"], ["emb"], axis=-1),
             node("Cos", ["emb"], ["c"]), node("Sin", ["emb"], ["s"])]
    if scaling is not None:
        nodes += [node("Mul", ["c", "scaling"], ["cs"]), node("Mul", ["s", "scaling"], ["ss"])]
    c, s = ("cs", "ss") if scaling is not None else ("c", "s")
    nodes += [node("Unsqueeze", [c, "one"], ["cos4"]), node("Unsqueeze", [s, "one"], ["sin4"])]
    inits = {"minus_one": np.array([-1]), "one": np.array([1]),
             "inv_freq": (1.0 / 10000 ** (np.arange(0, D, 2) / D)).astype(np.float32)}
    if scaling is not None:
        inits["scaling"] = np.float32(scaling)
    return nodes, {}, inits


def rotation(x, y, *, halves="split", neg_first=True):
    """y = x * cos4 + rotate_half(x) * sin4."""
    if halves == "split":
        nodes = [node("Split", [x], [f"{x}1", f"{x}2"], axis=-1, num_outputs=2)]
    elif halves == "split_sizes":
        nodes = [node("Split", [x, "halves"], [f"{x}1", f"{x}2"], axis=3)]
    else:
        nodes = [node("Slice", [x, "zero", "half", "last"], [f"{x}1"]),
                 node("Slice", [x, "half", "end", "last"], [f"{x}2"])]
    rotated = [f"{x}_neg", f"{x}1"] if neg_first else [f"{x}1", f"{x}_neg"]
    return nodes + [node("Neg", [f"{x}2"], [f"{x}_neg"]), node("Concat", rotated, [f"{x}_rot"], axis=-1),
                    node("Mul", [x, "cos4"], [f"{x}_c"]), node("Mul", [f"{x}_rot", "sin4"], [f"{x}_s"]),
                    node("Add", [f"{x}_c", f"{x}_s"], [y])]


def rope_model(*, rotations=("q",), scaling=None, tables_from_inputs=False, **rotation_kwargs):
    nodes, extra_inputs, inits = tables(scaling, tables_from_inputs)
    for x in rotations:
        nodes += rotation(x, f"{x}_out", **rotation_kwargs)
    inits.update({"halves": np.array([D // 2, D // 2]), "zero": np.array([0]), "half": np.array([D // 2]),
                  "end": np.array([np.iinfo(np.int64).max]), "last": np.array([-1])})
    inputs = {x: [B, H, S, D] for x in rotations}
    inputs.update({"position_ids": ([B, S], np.int64), **extra_inputs})
    model = make_model(nodes, inputs, [f"{x}_out" for x in rotations], inits)
    for name in [n for n in model.graph.initializers if not model.graph.initializers[n].uses()]:
        del model.graph.initializers[name]
    return model


def feeds(model):
    values = {"position_ids": POSITIONS}
    for i, value in enumerate(model.graph.inputs):
        if value.name != "position_ids":
            values[value.name] = rand(*[d for d in value.shape], seed=i)
    return values
