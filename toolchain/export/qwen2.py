"""Qwen2 (DeepSeek-R1-Distill-Qwen): Llama's layer with q/k/v biases, which `blocks.linear` carries over."""

from __future__ import annotations

from toolchain.errors import UnsupportedModelError
from toolchain.export.llama import LlamaArchitecture


class Qwen2Architecture(LlamaArchitecture):
    model_types = ("qwen2",)
    genai_model_type = "qwen2"

    def check(self, config) -> None:
        super().check(config)
        if "sliding_attention" in (config.layer_types or []):
            raise UnsupportedModelError("qwen2: sliding-window attention layers are not supported")
