"""The OpenVINO backend of the engine: openvino_genai's ContinuousBatchingPipeline (paged attention over KV-cache
blocks, chunked prefill, prefix caching), driven one ``step()`` at a time by the engine's thread.

Requests are added with their token ids (the API layer applied the chat template with the artifact's Hugging Face
tokenizer, the same one ``dstc generate`` uses); the pipeline samples (greedy at temperature 0, else multinomial
with temperature, top-p and ``rng_seed``) and stops at the artifact's eos ids or max tokens. Each step's new tokens
are read from every request's handle; a cancelled handle frees its KV blocks in the pipeline's next step.

A request whose generation config or ``add_request`` raises (the pipeline checks the config there) fails alone;
the others are added and go on.

With ``--speculate prompt-lookup`` the pipeline is openvino_genai's prompt-lookup one, with ``--speculate
draft:ARTIFACT`` its draft-model one (an OpenVINO draft artifact it pages as well): its own drafts and batched
verification, greedy output unchanged. It does not say how many drafts it proposed: ``drafted`` reports each
request's accepted drafts of a step (the tokens it gave beyond one) with the proposed count unknown (None).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batching import PipelineSettings, openvino_generation_config, openvino_pipeline
from toolchain.serve.engine import Request, failure


class OpenVINOBackend:
    name = "openvino_genai"

    def __init__(self, artifact: Artifact, settings: PipelineSettings) -> None:
        self.artifact = artifact
        self.settings = settings
        self.pipeline: Any = None  # openvino_genai's, once loaded (an untyped library)
        self.properties: dict = {}
        self.scheduler: Any = None
        self._live: dict[int, Request] = {}
        self.drafted: list[tuple[int | None, int]] = []  # with prompt lookup: (None, accepted) per request and step

    def load(self) -> None:
        self.pipeline, self.properties, self.scheduler = openvino_pipeline(self.artifact, self.settings)

    @property
    def runtime_config(self) -> dict:
        return {"device": "CPU", "properties": dict(self.properties),
                "scheduler": self.scheduler.to_string() if self.scheduler is not None else None}

    def add(self, requests: list[Request]):
        import openvino as ov

        failed: list[tuple[Request, list[int], str | None]] = []
        for request in requests:
            try:
                config = openvino_generation_config(
                    max_new_tokens=request.max_tokens, stop_ids=request.stop_ids,
                    temperature=request.sampling.temperature, top_p=request.sampling.top_p,
                    seed=request.sampling.seed, ignore_eos=request.ignore_eos,
                    prompt_lookup=self.settings.prompt_lookup, draft_tokens=self.settings.draft_tokens)
                request.state = self.pipeline.add_request(
                    request.id, ov.Tensor(np.array([request.prompt], np.int64)), config)
            except Exception as e:  # a value the config or the pipeline refuses: this request only
                request.error = failure(e)
                failed.append((request, [], "error"))
                continue
            self._live[request.id] = request
        return failed

    def step(self):
        import openvino_genai as genai

        self.drafted = []
        if not self._live:
            return []
        self.pipeline.step()
        results: list[tuple[Request, list[int], str | None]] = []
        for request in list(self._live.values()):
            handle = request.state
            status = handle.get_status()
            tokens, reason = [], None
            while handle.can_read():
                for output in handle.read().values():
                    tokens += list(output.generated_ids)
                    reason = output.finish_reason
            speculating = self.settings.prompt_lookup or self.settings.draft_model
            if speculating and tokens and request.generated:  # a verify step, not the prefill's
                self.drafted.append((None, len(tokens) - 1))
            if status == genai.GenerationStatus.RUNNING:
                results.append((request, tokens, None))
                continue
            del self._live[request.id]
            if status == genai.GenerationStatus.FINISHED:
                stopped = reason == genai.GenerationFinishReason.STOP
                if stopped and not request.ignore_eos:
                    while tokens and tokens[-1] in request.stop_ids:
                        tokens.pop()
                results.append((request, tokens, "stop" if stopped else "length"))
            else:  # IGNORED (the pipeline could not schedule it), CANCEL, STOP
                request.error = f"the pipeline ended the request with status {status.name}"
                results.append((request, tokens, "error"))
        return results

    def drop(self, requests: list[Request]) -> None:
        for request in requests:
            if self._live.pop(request.id, None) is not None:
                request.state.cancel()
        if not self._live and self.pipeline.has_non_finished_requests():
            self.pipeline.step()  # frees the cancelled requests' KV blocks now, not when the next request comes

    def reset(self) -> None:
        self.drop(list(self._live.values()))

    def kv_cache_usage(self) -> float:
        # The pipeline measures its usage when it schedules a step, before that step's finished requests are
        # freed: with nothing running, nothing is held (prefix-cached blocks are reusable, not in use).
        if self.pipeline is None or not self._live:
            return 0.0
        return self.pipeline.get_metrics().cache_usage / 100.0

    def close(self) -> None:
        self.reset()
        if self.pipeline is not None and self.pipeline.has_non_finished_requests():
            self.pipeline.step()  # lets the pipeline free the cancelled requests' blocks
