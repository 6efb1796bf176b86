"""The engine's backend on dstc's own runner, batched: ONNX Runtime artifacts (toolchain/runtime/batching.py), and
OpenVINO artifacts that openvino_genai cannot page, such as MLA's latent cache (toolchain/runtime/batching_openvino.py).

Requests that arrive together are prefilled as one left-padded batch and join the running batch; every engine
iteration is then one decode step of all running sequences. Tokens are chosen here (toolchain/runtime/sampling.py):
greedy at temperature 0, else sampling with a generator per request, seeded by its ``seed``.

What one request raises fails that request alone: its generator or its token choice, and its prefill (a batched
prefill that raises is tried again one request at a time; the running batch is untouched until a prefill returns).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from toolchain.errors import InputError
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batching import batched_decoder
from toolchain.runtime.batching_openvino import StatefulBatch
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.sampling import next_token
from toolchain.serve.engine import Request, failure

if TYPE_CHECKING:  # imported when the backend loads
    from toolchain.runtime.batching import BatchedDecoder
    from toolchain.runtime.decoder import Decoder


@dataclass
class _State:
    rng: np.random.Generator | None
    last: int = -1
    count: int = 0


class RunnerBackend:
    name = "dstc"

    def __init__(self, artifact: Artifact, *, threads: int | None, max_batch: int, max_context: int,
                 layout: str = "batch", f32: bool = False, runtime_cache: int | None = None) -> None:
        self.artifact = artifact
        self.threads = threads
        self.max_batch = max_batch
        self.max_context = max_context
        self.layout = layout
        self.f32 = f32  # OpenVINO: f32 compute and cache instead of the plugin's deployment defaults
        self.runtime_cache = runtime_cache  # OpenVINO: CPU_RUNTIME_CACHE_CAPACITY, None the plugin's
        self.decoder: Decoder | None = None
        self.batch: BatchedDecoder | None = None
        self._live: dict[int, Request] = {}

    def load(self) -> None:
        self.decoder = open_decoder(self.artifact, threads=self.threads, openvino_f32=self.f32,
                                    openvino_runtime_cache=self.runtime_cache)
        self.batch = self._batch()

    def _batch(self) -> BatchedDecoder:
        if self.decoder is None:
            raise RuntimeError("the runner backend is used before it is loaded")
        if self.decoder.backend != "openvino":
            return batched_decoder(self.decoder, self.artifact.pad_token_id, self.layout)
        if self.layout != "batch":
            raise InputError(f"KV-cache layout {self.layout!r} is ONNX Runtime's; an OpenVINO artifact is batched in "
                             "its infer request's variables (layout 'batch')")
        return StatefulBatch(self.decoder, self.artifact.pad_token_id)

    def _loaded(self) -> BatchedDecoder:
        if self.batch is None:
            raise RuntimeError("the runner backend is used before it is loaded")
        return self.batch

    @property
    def runtime_config(self) -> dict:
        return {**(self.decoder.runtime_config if self.decoder else {}), "kv_cache_layout": self.layout}

    def add(self, requests: list[Request]):
        results: list[tuple[Request, list[int], str | None]] = []
        joining = []
        for request in requests:
            try:
                rng = None if request.sampling.greedy else request.sampling.generator()
            except Exception as e:  # e.g. a seed numpy refuses
                results.append(self._failed(request, e))
                continue
            request.state = _State(rng)
            joining.append(request)
        logits = self._join(joining, results)
        joined = [r for r in joining if r.id in logits]
        for request in joined:
            self._live[request.id] = request
        return results + self._choose(joined, logits)

    def _join(self, requests: list[Request], results: list) -> dict[Hashable, np.ndarray]:
        """The prefill logits of ``requests``, as one batch; if that raises, one at a time, so that a request whose
        prefill fails (added to ``results``) does not take the others with it."""
        if not requests:
            return {}
        try:
            return self._loaded().join({r.id: r.prompt for r in requests})
        except Exception as e:
            if len(requests) == 1:
                results.append(self._failed(requests[0], e))
                return {}
        logits: dict[Hashable, np.ndarray] = {}
        for request in requests:
            logits.update(self._join([request], results))
        return logits

    @staticmethod
    def _failed(request: Request, e: Exception) -> tuple[Request, list[int], str]:
        request.error = failure(e)
        return request, [], "error"

    def step(self):
        live = list(self._live.values())
        if not live:
            return []
        logits = self._loaded().step({r.id: r.state.last for r in live})
        return self._choose(live, logits)

    def _choose(self, requests: list[Request], logits: dict[Hashable, np.ndarray]):
        results: list[tuple[Request, list[int], str | None]] = []
        leaving = []
        for request in requests:
            row, state = logits[request.id], request.state
            if not np.isfinite(row).all():
                request.error = "the model returned non-finite logits"
                results.append((request, [], "error"))
                leaving.append(request.id)
                continue
            try:
                token = next_token(row, request.sampling, state.rng)
            except Exception as e:  # e.g. probabilities the temperature made NaN
                results.append(self._failed(request, e))
                leaving.append(request.id)
                continue
            if token in request.stop_ids and not request.ignore_eos:
                results.append((request, [], "stop"))
                leaving.append(request.id)
                continue
            state.last = token
            state.count += 1
            if state.count >= request.max_tokens:
                results.append((request, [token], "length"))
                leaving.append(request.id)
            else:
                results.append((request, [token], None))
        if leaving:
            self._loaded().leave(leaving)
            for key in leaving:
                self._live.pop(key, None)
        return results

    def drop(self, requests: list[Request]) -> None:
        keys = [r.id for r in requests if r.id in self._live]
        self._loaded().leave(keys)
        for key in keys:
            del self._live[key]

    def reset(self) -> None:
        self._live = {}
        self.batch = self._batch()

    def kv_cache_usage(self) -> float:
        return self.batch.tokens_held() / (self.max_batch * self.max_context) if self.batch else 0.0

    def close(self) -> None:
        self._live = {}
