"""model_type -> graph builder. One module per architecture holds everything specific to it."""

from __future__ import annotations

from toolchain.errors import UnsupportedModelError
from toolchain.export.decoder import Architecture
from toolchain.export.deepseek_v2 import DeepseekV2Architecture
from toolchain.export.deepseek_v3 import DeepseekV3Architecture
from toolchain.export.deepseek_v4 import DeepseekV4Architecture
from toolchain.export.deepseek_v32 import DeepseekV32Architecture
from toolchain.export.llama import LlamaArchitecture
from toolchain.export.qwen2 import Qwen2Architecture
from toolchain.export.qwen3_moe import Qwen3MoeArchitecture

ARCHITECTURES: dict[str, Architecture] = {
    t: arch
    for arch in (LlamaArchitecture(), Qwen2Architecture(), DeepseekV2Architecture(), DeepseekV3Architecture(),
                 DeepseekV32Architecture(), DeepseekV4Architecture(), Qwen3MoeArchitecture())
    for t in arch.model_types
}


def architecture_for(model_type: str | None) -> Architecture:
    try:
        return ARCHITECTURES[model_type]  # type: ignore[index]  # None (no model_type): a KeyError as well
    except KeyError:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported (supported: {', '.join(sorted(ARCHITECTURES))})"
        ) from None
