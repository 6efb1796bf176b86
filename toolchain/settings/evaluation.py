"""What `dstc eval` measures and how much: a recipe's `eval:` section and the CLI's options share this model."""

from __future__ import annotations

from pydantic import Field, PositiveInt, model_validator

from toolchain.settings.speculation import SpeculationSettings

# Settings that change only the artifact's side of an evaluation (latency, the artifact's runtime): the
# reference's outputs, and so its cache entry, do not depend on them.
ARTIFACT_ONLY = ("latency", "prompt_lengths", "batches", "new_tokens", "warmup", "repetitions", "threads",
                 "openvino_f32", "reference_cache", "speculate", "draft_tokens")
# Settings of the standard tasks alone: the reference's task scores have an entry of their own.
TASK_SETTINGS = ("tasks", "task_data", "task_limit", "num_fewshot")


WHOLE_VOCABULARY, TOP_K = 1024, 128
DEFAULT_WINDOW = 2048  # perplexity window of --dataset, unless the model's context is shorter


class EvalSettings(SpeculationSettings):
    speculate: str | None = Field(
        None, json_schema_extra={"metavar": "prompt-lookup|mtp|draft:ARTIFACT"},
        description="Decode each batch-1 latency case again with speculative decoding (n-gram lookup, the "
                    "artifact's MTP layer, or a smaller artifact of the same tokenizer as draft model): its speed-up, "
                    "acceptance per draft position and greedy match go into the report.")
    texts: int = Field(200, ge=1, description="Held-out texts for perplexity, KL, top-1 and routing agreement.")
    problems: int = Field(200, ge=1, description="Held-out arithmetic problems for exact match (embedded models), "
                                                 "or at most this many prompt/answer records of --dataset.")
    greedy_prompts: int = Field(32, ge=0, description="Prefixes continued greedily by both sides; 0 skips the "
                                                      "greedy match.")
    greedy_tokens: int = Field(16, ge=1, description="Tokens each greedy continuation runs for.")
    batch: int = Field(8, ge=1, description="Prompts per left-padded batch when generating for accuracy.")
    dataset: str | None = Field(
        None, description="The data to measure accuracy on instead of the embedded corpus: JSONL (text; prompt + "
                          "answer; or chat messages) or plain text. Its sha256 goes into report.json.")
    window: int | None = Field(None, ge=2, description=f"Tokens per perplexity window of --dataset (default: the "
                                                       f"model's context, at most {DEFAULT_WINDOW}).")
    stride: int | None = Field(None, ge=1, description="Tokens between windows of --dataset (default: the window; "
                                                       "less overlaps them, each token still scored once).")
    windows: int = Field(64, ge=1, description="At most this many windows of --dataset.")
    answer_tokens: int = Field(32, ge=1, description="Greedy tokens for the answer of a prompt/answer record.")
    kl_top_k: int | None = Field(
        None, ge=1, description=f"Compare next-token distributions on the reference's top K tokens and the rest as "
                                f"one outcome (what the reference cache keeps per position) (default: the whole "
                                f"distribution up to {WHOLE_VOCABULARY} tokens of vocabulary, else {TOP_K}).")
    tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness tasks to score the artifact and the reference on "
                                          "(e.g. gsm8k,arc_easy); their data from --task-data.")
    task_data: str | None = Field(
        None, description="Directory of the tasks' data: TASK/SPLIT.jsonl (or .parquet) in the schema of the task's "
                          "dataset. dstc never downloads.")
    task_limit: int | None = Field(None, ge=1, description="Score the first N examples of each task only.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per task (default: each task's own).")
    reference_cache: bool = Field(
        True, description="Reuse the reference's outputs from the reference cache (DSTC_CACHE_DIR/references) and "
                          "store new ones; --no-reference-cache computes them again.")
    latency: bool = Field(True, description="Measure latency too; --no-latency measures accuracy only.")
    prompt_lengths: list[PositiveInt] = Field(default_factory=lambda: [32, 128, 512],
                                              description="Latency prompt lengths.")
    batches: list[PositiveInt] = Field(default_factory=lambda: [1, 4], description="Latency batch sizes.")
    new_tokens: int = Field(32, ge=2, description="Tokens generated per latency run (stop tokens ignored).")
    warmup: int = Field(2, ge=0, description="Unmeasured runs before each latency case.")
    repetitions: int = Field(5, ge=1, description="Measured runs per latency case.")
    threads: int | None = Field(None, ge=1, description="Runtime threads (default: every core).")
    openvino_f32: bool = Field(
        False, description="Run OpenVINO at f32 compute and KV cache instead of the CPU plugin's deployment defaults "
                           "(bf16 and a u8 KV cache where the CPU has bf16), to see the weights' own error.")
    seed: int = Field(0, description="Seed of the held-out sample of the embedded corpus.")

    def top_k(self, vocab: int) -> int:
        if self.kl_top_k is None:
            return vocab if vocab <= WHOLE_VOCABULARY else TOP_K
        return min(self.kl_top_k, vocab)

    @model_validator(mode="after")
    def _consistent(self) -> EvalSettings:
        if self.stride is not None and self.window is not None and self.stride > self.window:
            raise ValueError(f"stride {self.stride} is longer than the window ({self.window} tokens)")
        if self.tasks and not self.task_data:
            raise ValueError("tasks need task_data: a directory of the tasks' data files (dstc never downloads)")
        return self
