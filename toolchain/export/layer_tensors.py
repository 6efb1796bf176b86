"""A decoder layer's tensors read from a checkpoint (toolchain/checkpoint/reader.py) into a torch module of
transformers' (the MTP layers' references: mtp_reference.py, deepseek_v4_mtp_reference.py), in float32 as the
exporter's graph holds them.
"""

from __future__ import annotations

import torch


def read_tensor(reader, name: str, like: torch.Tensor) -> torch.Tensor:
    """A tensor of the layer from the checkpoint; transformers' fused experts from the hub's per-expert names."""
    prefix, _, leaf = name.rpartition(".")
    if leaf in ("gate_up_proj", "down_proj") and prefix.endswith(".experts") and like.dim() == 3:
        parts = []
        for e in range(like.shape[0]):
            if leaf == "gate_up_proj":
                parts.append(torch.cat([exact(reader, f"{prefix}.{e}.gate_proj.weight"),
                                        exact(reader, f"{prefix}.{e}.up_proj.weight")]))
            else:
                parts.append(exact(reader, f"{prefix}.{e}.down_proj.weight"))
        return torch.stack(parts)
    return exact(reader, name).to(like.dtype)


def exact(reader, name: str) -> torch.Tensor:
    """The tensor in float32 as the exporter's graph holds it: read in the dtype that holds its values exactly (an
    FP8 weight dequantized to bf16, as DeepSeek's fp8_cast_bf16 and the main model's reference do)."""
    t = reader.tensor(name, reader.natural_dtype(name))
    return t.to(torch.float32) if t.is_floating_point() else t
