"""DeepSeek-V4's FP4 experts and power-of-two (ue8m0) scales: decoding for the reader, encoding for the writers.

The format is DeepSeek-V4's (its ``inference/model.py`` and ``convert.py``; transformers 5.24's
``integrations/finegrained_fp8.py`` ``Fp8Dequantize._unpack_fp4`` reads it the same way): a routed expert's
[out, in] weight is stored as int8 [out, in / 2], two e2m1 values per byte, the value of column 2j in the low
nibble and of column 2j + 1 in the high one; its scales are ``float8_e8m0fnu`` [out, in / 32], one power of two per
32 values of a row. A scale is chosen as DeepSeek's ``fp4_act_quant`` kernel does, s = 2^ceil(log2(amax / 6)), so
that every value of its block divided by s lies within e2m1's range (+-6).
"""

from __future__ import annotations

from itertools import pairwise

import torch

BLOCK = (1, 32)  # one scale per 32 values along a row
E2M1_MAX = 6.0
# e2m1 codes 0-15: sign bit 3, two exponent bits, one mantissa bit
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
E8M0 = torch.float8_e8m0fnu
_MIN_AMAX = E2M1_MAX * 2.0**-126  # DeepSeek's floor: an all-zero block gets the smallest normal scale


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., 2n] of the e2m1 values packed two per byte in ``packed`` (int8 or uint8 [..., n])."""
    values = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    pairs = torch.stack([values.repeat(16), values.repeat_interleave(16)], dim=-1)  # byte -> (low, high nibble)
    codes = packed.contiguous().view(torch.uint8).flatten().to(torch.int32)
    return torch.index_select(pairs, 0, codes).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """int8 [..., n / 2]: ``values`` (float, [..., n], n even) rounded to the nearest e2m1 value (ties to the even
    code, as a cast rounds), two per byte."""
    magnitude = values.abs().to(torch.float32)
    # the code counts the midpoints between consecutive magnitudes that lie below; a value on midpoint i (between
    # codes i and i + 1) goes to the even code
    code = torch.zeros(values.shape, dtype=torch.uint8)
    for i, (low, high) in enumerate(pairwise(E2M1_VALUES[:8])):
        code += (magnitude >= (low + high) / 2 if i % 2 else magnitude > (low + high) / 2).to(torch.uint8)
    code |= ((values < 0) & (code > 0)).to(torch.uint8) << 3
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    return packed.view(torch.int8)


def power_of_two_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """float32 2^ceil(log2(amax / top)): the smallest power of two that brings ``amax`` within ``top``."""
    return torch.exp2(torch.ceil(torch.log2(amax.to(torch.float32) / top)))


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [out, in / 2] packed e2m1, float8_e8m0fnu [out, in / 32] scales) of a float [out, in] weight."""
    rows, cols = weight.shape
    if cols % BLOCK[1]:
        raise ValueError(f"an FP4 weight's rows must be whole blocks of {BLOCK[1]} values, not {cols}")
    blocks = weight.to(torch.float32).reshape(rows, cols // BLOCK[1], BLOCK[1])
    scale = power_of_two_scale(blocks.abs().amax(dim=-1).clamp(min=_MIN_AMAX), E2M1_MAX)
    packed = pack_e2m1((blocks / scale.unsqueeze(-1)).reshape(rows, cols))
    return packed, scale.to(E8M0)


def is_power_of_two(values: torch.Tensor) -> torch.Tensor:
    """Elementwise: a positive finite power of two (what a ue8m0 scale holds)."""
    mantissa, _ = torch.frexp(values.to(torch.float32))
    return torch.isfinite(values) & (values > 0) & (mantissa == 0.5)
