"""What `dstc eval` measures and how much: a recipe's `eval:` section and the CLI's options share this model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EvalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    texts: int = Field(200, ge=1)  # held-out texts: perplexity, KL, top-1, routing agreement
    problems: int = Field(200, ge=1)  # held-out arithmetic problems: exact match (embedded models only)
    greedy_prompts: int = Field(32, ge=1)  # held-out text prefixes continued greedily by both sides
    greedy_tokens: int = Field(16, ge=1)
    batch: int = Field(8, ge=1)  # prompts per left-padded batch when generating for accuracy
    latency: bool = True
    prompt_lengths: list[int] = Field(default_factory=lambda: [32, 128, 512])
    batches: list[int] = Field(default_factory=lambda: [1, 4])
    new_tokens: int = Field(32, ge=2)
    warmup: int = Field(2, ge=0)
    repetitions: int = Field(5, ge=1)
    threads: int | None = Field(None, ge=1)  # None: every core
    openvino_f32: bool = False  # OpenVINO at f32 compute and KV cache instead of the plugin's deployment defaults
    seed: int = 0
