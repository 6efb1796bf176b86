"""What an engine process is given to build its backend: decided once, in the server's process, from the artifact
and ``ServeSettings``, and sent to the engine process (and to each replica) as data: ``EngineOptions``.

Which engine runs an artifact is decided here alone (``serving_engine``): openvino_genai's ContinuousBatchingPipeline
for an OpenVINO artifact whose KV cache it can page, dstc's runner for every other (ONNX Runtime artifacts, and
OpenVINO ones such as MLA's latent cache: toolchain/runtime/batching_openvino.py).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from toolchain.errors import InputError
from toolchain.interface.files import MODEL_XML
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batching import PipelineSettings
from toolchain.runtime.batching_openvino import pageable
from toolchain.serve.settings import ServeSettings
from toolchain.settings.speculation import PROMPT_LOOKUP, SpeculationSettings

EngineKind = Literal["openvino_genai", "dstc"]
GENAI: EngineKind = "openvino_genai"  # the backend's ``name`` (engine_openvino.py)
RUNNER: EngineKind = "dstc"  # dstc's runner (engine_runner.py)


def serving_engine(artifact: Artifact) -> EngineKind:
    """The engine that serves ``artifact``: openvino_genai's pipeline where it can page the KV cache, else dstc's
    runner."""
    return GENAI if artifact.backend == "openvino" and pageable(artifact.path / MODEL_XML) else RUNNER


class EngineOptions(BaseModel):
    """One engine's backend, as data: the engine, the artifact and how it is run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    artifact: str = Field(description="The artifact's directory.")
    engine: EngineKind = Field(description="Which backend runs it (serving_engine).")
    threads: int | None = Field(None, ge=1, description="Runtime threads; None: the runtime's choice.")
    max_batch: int = Field(ge=1, description="Requests decoded together.")
    max_context: int = Field(ge=2, description="Prompt + generated tokens per request.")
    rows_alone: bool = Field(False, description="--deterministic on an artifact that is not batch-invariant: each "
                                                "request alone (batch_rows.py), or one at a time (openvino_genai).")
    speculation: SpeculationSettings = Field(default_factory=SpeculationSettings)
    layout: Literal["batch", "gather"] = Field("batch", description="ONNX Runtime: the running batch's KV cache.")
    f32: bool = Field(False, description="OpenVINO: f32 compute and KV cache instead of the plugin's defaults.")
    runtime_cache: int | None = Field(None, ge=0, description="OpenVINO: CPU_RUNTIME_CACHE_CAPACITY; None the "
                                                              "plugin's (or dstc's choice, kernel_caches.py).")
    prefix_caching: bool = Field(True, description="openvino_genai: reuse the KV cache of repeated prompt prefixes.")

    def pipeline_settings(self) -> PipelineSettings:
        """openvino_genai's pipeline settings: its own prompt lookup or draft-model speculation; with ``rows_alone``,
        one request at a time, each prefilled whole."""
        s = self.speculation
        draft = s.draft_artifact
        return PipelineSettings(threads=self.threads, max_batch=1 if self.rows_alone else self.max_batch,
                                max_context=self.max_context, f32=self.f32, runtime_cache=self.runtime_cache,
                                prefix_caching=self.prefix_caching and not self.rows_alone,
                                prompt_lookup=s.draft_tokens if s.speculate == PROMPT_LOOKUP else 0,
                                draft_model=draft, draft_tokens=s.draft_tokens if draft else 0)


def engine_options(artifact: Artifact, settings: ServeSettings, engine: EngineKind, *, context: int,
                   rows_alone: bool) -> EngineOptions:
    """The options of ``engine`` over ``artifact``; InputError for a setting that backend does not take."""
    s = settings
    if artifact.backend != "openvino":
        if s.openvino_runtime_cache is not None:
            raise InputError(f"--openvino-runtime-cache is the OpenVINO CPU plugin's; {artifact.path} is an "
                             f"{artifact.backend} artifact")
        if s.speculate is not None and s.kv_layout != "batch":
            raise InputError(f"--speculate verifies drafts in the 'batch' KV-cache layout, not {s.kv_layout!r}")
    openvino = artifact.backend == "openvino"
    return EngineOptions(
        artifact=str(artifact.path), engine=engine, threads=s.threads, max_batch=s.max_batch, max_context=context,
        rows_alone=rows_alone, speculation=SpeculationSettings(speculate=s.speculate, draft_tokens=s.draft_tokens),
        layout="batch" if openvino else s.kv_layout, f32=s.openvino_f32 and openvino,
        runtime_cache=s.openvino_runtime_cache, prefix_caching=s.prefix_caching)
