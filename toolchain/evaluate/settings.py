"""What `dstc eval` measures and how much: a recipe's `eval:` section and the CLI's options share this model."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Settings that change only the artifact's side of an evaluation (latency, the artifact's runtime): the
# reference's outputs, and so its cache entry, do not depend on them.
ARTIFACT_ONLY = ("latency", "prompt_lengths", "batches", "new_tokens", "warmup", "repetitions", "threads",
                 "openvino_f32", "reference_cache")
# Settings of the standard tasks alone: the reference's task scores have an entry of their own.
TASK_SETTINGS = ("tasks", "task_data", "task_limit", "num_fewshot")


WHOLE_VOCABULARY, TOP_K = 1024, 128


class EvalSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    texts: int = Field(200, ge=1)  # held-out texts: perplexity, KL, top-1, routing agreement
    problems: int = Field(200, ge=1)  # held-out arithmetic problems (or the data file's prompt/answer records)
    greedy_prompts: int = Field(32, ge=0)  # held-out text prefixes continued greedily by both sides
    greedy_tokens: int = Field(16, ge=1)
    batch: int = Field(8, ge=1)  # prompts per left-padded batch when generating for accuracy
    # the user's data (toolchain/evaluate/dataset.py): a JSONL or text file instead of the embedded corpus
    dataset: str | None = None
    window: int = Field(2048, ge=2)  # tokens per perplexity window of a data file
    stride: int | None = Field(None, ge=1)  # tokens between windows (default: the window, no overlap)
    windows: int = Field(64, ge=1)  # at most this many windows
    answer_tokens: int = Field(32, ge=1)  # greedy tokens for an answer of a prompt/answer record
    # next-token distributions are compared on the reference's top-k tokens and the rest as one outcome (what the
    # reference cache keeps per position); None: the whole distribution of a vocabulary up to WHOLE_VOCABULARY
    # tokens (the embedded models'), else the top TOP_K
    kl_top_k: int | None = Field(None, ge=1)
    # standard tasks through lm-evaluation-harness (toolchain/evaluate/harness.py), their data read from task_data
    tasks: list[str] = Field(default_factory=list)
    task_data: str | None = None  # task_data/<task>/<split>.jsonl in the schema of the task's dataset
    task_limit: int | None = Field(None, ge=1)  # the first examples of each task only
    num_fewshot: int | None = Field(None, ge=0)  # default: each task's own
    reference_cache: bool = True  # reuse the reference's outputs from the cache (toolchain/evaluate/reference_cache.py)
    latency: bool = True
    prompt_lengths: list[int] = Field(default_factory=lambda: [32, 128, 512])
    batches: list[int] = Field(default_factory=lambda: [1, 4])
    new_tokens: int = Field(32, ge=2)
    warmup: int = Field(2, ge=0)
    repetitions: int = Field(5, ge=1)
    threads: int | None = Field(None, ge=1)  # None: every core
    openvino_f32: bool = False  # OpenVINO at f32 compute and KV cache instead of the plugin's deployment defaults
    seed: int = 0

    def top_k(self, vocab: int) -> int:
        if self.kl_top_k is None:
            return vocab if vocab <= WHOLE_VOCABULARY else TOP_K
        return min(self.kl_top_k, vocab)

    @model_validator(mode="after")
    def _consistent(self) -> EvalSettings:
        if self.stride is not None and self.stride > self.window:
            raise ValueError(f"stride {self.stride} is longer than the window ({self.window} tokens)")
        if self.tasks and not self.task_data:
            raise ValueError("tasks need task_data: a directory of the tasks' data files (dstc never downloads)")
        return self
