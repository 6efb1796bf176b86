"""DeepSeek-V3's FP8 hub layout: which tensors it stores how, its quantizer and a streamed shard writer, with which
toolchain/models/shape_faithful.py writes checkpoints in it for tests and for memory benchmarks at real width.

The layout is deepseek-ai/DeepSeek-V3's (its README_WEIGHTS.md and inference/model.py, where every ``Linear``
of an attention or MLP block is created in float8 with a ``scale`` of ceil-divided 128 x 128 blocks, while the
embedding, the head, the norms and the router's ``Gate`` are not; vLLM's ``deepseek_mtp.py`` for the MTP layer):

- e4m3 (``torch.float8_e4m3fn``) with a float32 ``<name>_scale_inv`` of ceil(rows/128) x ceil(cols/128) blocks:
  every projection weight of a layer's ``self_attn`` and ``mlp`` (q_a/q_b or q, kv_a_proj_with_mqa, kv_b, o; the
  dense MLP's, the shared and the routed experts' gate/up/down);
- bfloat16: ``model.embed_tokens``, ``lm_head``, every norm and the router ``mlp.gate.weight``; float32: the
  router's ``e_score_correction_bias``;
- with ``mtp_layers``, layers from index ``num_hidden_layers`` on: a decoder layer (FP8 as above) with the MTP
  module's own bfloat16 tensors ``embed_tokens``, ``enorm``, ``hnorm``, ``eh_proj`` [H, 2H] (an unquantized
  ``nn.Linear`` in vLLM) and ``shared_head.norm`` / ``shared_head.head``; config.json's
  ``num_nextn_predict_layers`` counts them;
- config.json's ``quantization_config`` as the hub's, shards ``model-0000N-of-0000M.safetensors`` (the hub's own
  V3 shards are named ``-of-000163``) and ``model.safetensors.index.json``.

Quantization follows DeepSeek's ``act_quant_kernel`` (inference/kernel.py; the weight quantizer itself is not
published): s = max(amax(block), 1e-4) / 448, q = e4m3(x / s). Zero-padding an edge block to 128 x 128 for its
scale, as README_WEIGHTS.md describes, leaves its amax unchanged.

Shards are streamed: each file's header is computed from the shapes first, then its tensors are written one at a
time, so memory holds one source tensor (in float32 while it is quantized) and its output.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from toolchain.checkpoint.fp4 import power_of_two_scale
from toolchain.checkpoint.reader import FP8

BLOCK = (128, 128)
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
MIN_AMAX = 1e-4  # DeepSeek's clamp: an all-zero block gets a finite scale
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": list(BLOCK)}
# V3.2's indexer: wq_b and wk in e4m3, weights_proj unquantized (transformers keeps it out of FP8 too)
_QUANTIZED = re.compile(r"model\.layers\.\d+\.(self_attn|mlp)\.((?!indexer\.weights_proj).*_proj(_with_mqa)?"
                        r"|indexer\.(wq_b|wk))\.weight")
# float32 in the hub's files: the router's bias, and V3.2's indexer LayerNorm (a float32 module in DeepSeek's code)
_FLOAT32 = re.compile(r".*(\.e_score_correction_bias|\.indexer\.k_norm\.(weight|bias))")
_SAFETENSORS_DTYPE = {FP8: "F8_E4M3", torch.bfloat16: "BF16", torch.float32: "F32", torch.int8: "I8",
                      torch.float8_e8m0fnu: "F8_E8M0", torch.int64: "I64"}


def quantized_in_hub_layout(name: str, shape: tuple[int, ...]) -> bool:
    """Whether the hub's FP8 layout stores the tensor ``name`` in e4m3 with block scales (module docstring)."""
    return bool(_QUANTIZED.fullmatch(name)) and len(shape) == 2


def float32_in_hub_layout(name: str) -> bool:
    """Whether the hub's FP8 layout stores the unquantized tensor ``name`` in float32 (others are bf16)."""
    return bool(_FLOAT32.fullmatch(name))


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] = BLOCK,
                 scale_fmt: str = "float") -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 weight, float32 scales of its ceil-divided blocks), one block row at a time. ``scale_fmt`` "ue8m0"
    (DeepSeek-V3.1 and later): each scale rounded up to a power of two, as DeepSeek's ``act_quant`` kernel does with
    ``scale_fmt`` set."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    q = torch.empty((rows, cols), dtype=FP8)
    scales = torch.empty((math.ceil(rows / block_rows), math.ceil(cols / block_cols)), dtype=torch.float32)
    for i, start in enumerate(range(0, rows, block_rows)):
        band = weight[start:start + block_rows].to(torch.float32)
        padded = torch.nn.functional.pad(band.abs(), (0, -cols % block_cols))
        amax = padded.view(band.shape[0], -1, block_cols).amax(dim=(0, 2))
        amax = amax.clamp(min=MIN_AMAX)
        scales[i] = power_of_two_scale(amax, FP8_MAX) if scale_fmt == "ue8m0" else amax / FP8_MAX
        per_column = scales[i].repeat_interleave(block_cols)[:cols]
        q[start:start + block_rows] = (band / per_column).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scales


@dataclass
class Group:
    """Tensors written together (an FP8 weight and its scales): (name, dtype, shape) each, and what makes them."""

    specs: list[tuple[str, torch.dtype, tuple[int, ...]]]
    make: Callable[[], list[torch.Tensor]]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in self.specs)


def plan_shards(groups: list[Group], shard_bytes: int) -> list[list[Group]]:
    """Groups in order into shards of at most ``shard_bytes`` (a larger group gets a shard of its own)."""
    shards: list[list[Group]] = [[]]
    size = 0
    for group in groups:
        if shards[-1] and size + group.nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(group)
        size += group.nbytes
    return shards


def write_shard(path: Path, groups: list[Group]) -> None:
    """A safetensors file written tensor by tensor: the header (8-byte length, JSON padded to 8 bytes) from the
    planned shapes, then each group's data as it is made."""
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for group in groups:
        for name, dtype, shape in group.specs:
            size = math.prod(shape) * dtype.itemsize
            header[name] = {"dtype": _SAFETENSORS_DTYPE[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for group in groups:
            for (name, dtype, shape), tensor in zip(group.specs, group.make(), strict=True):
                assert tensor.dtype == dtype and tuple(tensor.shape) == shape, name
                _write_tensor(f, tensor)


def _write_tensor(f: BinaryIO, tensor: torch.Tensor) -> None:
    f.write(tensor.contiguous().view(torch.uint8).numpy().data)
