"""The engine's backend on dstc's own runner, batched: ONNX Runtime artifacts (toolchain/runtime/batching.py), and
OpenVINO artifacts that openvino_genai cannot page, such as MLA's latent cache (toolchain/runtime/batching_openvino.py).

Requests that arrive together are prefilled as one left-padded batch and join the running batch; every engine
iteration is then one decode step of all running sequences. Tokens are chosen here (toolchain/runtime/sampling.py):
greedy at temperature 0, else sampling with a generator per request, seeded by its ``seed``.

What one request raises fails that request alone: its generator or its token choice, and its prefill (a batched
prefill that raises is tried again one request at a time; the running batch is untouched until a prefill returns).

With speculation (dstc serve --speculate): each step drafts up to --draft-tokens tokens
for every running request (toolchain/runtime/batched_drafts.py; a request its drafter has none for is fed its last
token alone), one forward of the model verifies them all (``verify`` of PersistentBatch or StatefulBatch, holes
in the cache for what is rejected: toolchain/runtime/batch_holes.py), and each request keeps its accepted
prefix and the model's next token, as toolchain/runtime/speculative.py does for one sequence: greedy while the
drafts are the argmax, speculative sampling at a temperature (the drafts are deterministic: one-hot). ``drafted``
holds each request's (drafts proposed, accepted) of the last step, for the metrics.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np

from toolchain.errors import InputError
from toolchain.runtime.artifact import Artifact
from toolchain.runtime.batch_holes import Holes, holds_holes
from toolchain.runtime.batch_rows import RowByRow
from toolchain.runtime.batched_drafts import batch_drafter
from toolchain.runtime.batching import PersistentBatch, batched_decoder
from toolchain.runtime.batching_openvino import StatefulBatch, own_request_batch
from toolchain.runtime.decoder import open_decoder
from toolchain.runtime.sampling import distribution, next_token
from toolchain.runtime.speculative import verify_greedy, verify_sampled
from toolchain.serve.engine import Request, failure
from toolchain.serve.engine_options import EngineOptions

if TYPE_CHECKING:  # imported when the backend loads
    from toolchain.runtime.batched_drafts import BatchDrafter
    from toolchain.runtime.batching import BatchedDecoder
    from toolchain.runtime.decoder import Decoder


@dataclass
class _State:
    rng: np.random.Generator | None
    last: int = -1
    count: int = 0
    tokens: list[int] | None = None  # with speculation: the prompt and the tokens chosen so far
    hidden: np.ndarray | None = None  # with MTP drafts: the main model's hidden states its drafter reads next


class RunnerBackend:
    name = "dstc"

    def __init__(self, artifact: Artifact, options: EngineOptions) -> None:
        self.artifact = artifact
        self.threads = options.threads
        self.max_batch = options.max_batch
        self.max_context = options.max_context
        self.layout = options.layout
        self.f32 = options.f32  # OpenVINO: f32 compute and cache instead of the plugin's deployment defaults
        self.runtime_cache = options.runtime_cache  # OpenVINO: CPU_RUNTIME_CACHE_CAPACITY, None the plugin's
        self.speculation = options.speculation if options.speculation.speculate else None
        # dstc serve --deterministic on an artifact that is not batch-invariant: each request in a batch of its own
        self.rows_alone = options.rows_alone
        self.decoder: Decoder | None = None
        self.batch: BatchedDecoder | None = None
        self.drafter: BatchDrafter | None = None
        self.drafted: list[tuple[int, int]] = []  # (drafts proposed, accepted) of each request in the last step
        self._live: dict[int, Request] = {}

    def load(self) -> None:
        if self.speculation is not None:
            self.drafter = batch_drafter(self.speculation, self.artifact, threads=self.threads, openvino_f32=self.f32)
        self.decoder = open_decoder(self.artifact, threads=self.threads, openvino_f32=self.f32,
                                    openvino_runtime_cache=self.runtime_cache,
                                    extra_outputs=self.drafter.main_outputs if self.drafter else ())
        self.batch = self._batch()

    def _batch(self) -> BatchedDecoder:
        if self.decoder is None:
            raise RuntimeError("the runner backend is used before it is loaded")
        if self.decoder.backend != "openvino":
            if self.speculation is not None and self.layout != "batch":
                raise InputError(f"--speculate verifies drafts in the 'batch' KV-cache layout, not {self.layout!r}")
            decoder = self.decoder
            if self.rows_alone:
                return RowByRow(lambda: batched_decoder(decoder, self.artifact.pad_token_id, self.layout),
                                self.artifact.pad_token_id)
            batch = batched_decoder(decoder, self.artifact.pad_token_id, self.layout)
        elif self.layout != "batch":
            raise InputError(f"KV-cache layout {self.layout!r} is ONNX Runtime's; an OpenVINO artifact is batched in "
                             "its infer request's variables (layout 'batch')")
        elif self.rows_alone:
            return RowByRow(partial(own_request_batch, self.decoder, self.artifact.pad_token_id),
                            self.artifact.pad_token_id)
        else:
            batch = StatefulBatch(self.decoder, self.artifact.pad_token_id)
        if isinstance(batch, Holes):  # where speculation leaves holes
            batch.compact_each_step = not holds_holes(self.artifact.metadata)
        return batch

    def _loaded(self) -> BatchedDecoder:
        if self.batch is None:
            raise RuntimeError("the runner backend is used before it is loaded")
        return self.batch

    def _verifier(self) -> PersistentBatch | StatefulBatch:
        """The running batch, which speculation runs only on (``_batch`` refuses the gathered layout)."""
        batch = self._loaded()
        assert isinstance(batch, PersistentBatch | StatefulBatch)
        return batch

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
            logits = self._loaded().join({r.id: r.prompt for r in requests})
        except Exception as e:
            if len(requests) == 1:
                results.append(self._failed(requests[0], e))
                return {}
        else:
            if self.drafter is not None and self.drafter.main_outputs:  # what the drafter reads of the prompt
                hidden = self._verifier().row_extras(*self.drafter.main_outputs)
                for request in requests:
                    request.state.hidden = hidden[request.id]
            return logits
        logits = {}
        for request in requests:
            logits.update(self._join([request], results))
        return logits

    @staticmethod
    def _failed(request: Request, e: Exception) -> tuple[Request, list[int], str]:
        request.error = failure(e)
        return request, [], "error"

    def step(self):
        live = list(self._live.values())
        self.drafted = []
        if not live:
            return []
        if self.drafter is not None:
            return self._speculative_step(live)
        logits = self._loaded().step({r.id: r.state.last for r in live})
        return self._choose(live, logits)

    def _speculative_step(self, live: list[Request]):
        """Drafts for every request, one verify forward, each request's accepted drafts and next token."""
        assert self.drafter is not None and self.speculation is not None
        batch = self._verifier()
        # never more drafts than the request's budget has room for beside the next token: a request's cache holds
        # no more positions than plain decoding's
        room = {r.id: min(self.speculation.draft_tokens, r.max_tokens - r.state.count - 1) for r in live}
        proposed = self.drafter.propose({r.id: r.state.tokens for r in live}, {r.id: r.state.hidden for r in live},
                                        max(room.values()))
        drafts = {r.id: [int(t) for t in proposed.get(r.id, [])[:room[r.id]]] for r in live}
        logits = batch.verify({r.id: [r.state.last, *drafts[r.id]] for r in live})
        hidden = batch.row_extras(*self.drafter.main_outputs) if self.drafter.main_outputs else {}
        kept: dict[Hashable, int] = {}
        chosen: dict[int, list[int]] = {}
        failed: dict[int, Exception] = {}
        for request in live:
            rows, own = logits[request.id], drafts[request.id]
            try:
                if not np.isfinite(rows).all():
                    raise FloatingPointError("the model returned non-finite logits")
                if request.sampling.greedy:
                    accepted, following = verify_greedy(own, rows)
                else:
                    target = np.stack([distribution(row, request.sampling) for row in rows])
                    accepted, following = verify_sampled(own, None, target, request.state.rng)
            except Exception as e:  # e.g. probabilities the temperature made NaN
                failed[request.id] = e
                kept[request.id] = 1
                continue
            kept[request.id] = 1 + accepted
            chosen[request.id] = [*own[:accepted], following]
            self.drafted.append((len(own), accepted))
            if request.id in hidden:
                request.state.hidden = hidden[request.id][:1 + accepted]
        batch.keep(kept)
        results: list[tuple[Request, list[int], str | None]] = []
        leaving = []
        for request in live:
            if request.id in failed:
                results.append(self._failed(request, failed[request.id]))
                leaving.append(request.id)
                continue
            tokens, finish = chosen[request.id], None
            if not request.ignore_eos:
                stop = next((i for i, token in enumerate(tokens) if token in request.stop_ids), None)
                if stop is not None:
                    tokens, finish = tokens[:stop], "stop"
            state = request.state
            state.count += len(tokens)
            state.tokens += tokens
            if tokens:
                state.last = tokens[-1]
            if finish is None and state.count >= request.max_tokens:
                finish = "length"
            results.append((request, tokens, finish))
            if finish is not None:
                leaving.append(request.id)
        self._leave(leaving)
        return results

    def _leave(self, keys: list[int]) -> None:
        if keys:
            self._loaded().leave(keys)
            if self.drafter is not None:
                self.drafter.leave(keys)
            for key in keys:
                self._live.pop(key, None)

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
            if self.drafter is not None:
                state.tokens = [*request.prompt, token]
            if state.count >= request.max_tokens:
                results.append((request, [token], "length"))
                leaving.append(request.id)
            else:
                results.append((request, [token], None))
        self._leave(leaving)
        return results

    def drop(self, requests: list[Request]) -> None:
        self._leave([r.id for r in requests if r.id in self._live])

    def reset(self) -> None:
        self._live = {}
        self.batch = self._batch()
        if self.drafter is not None:
            self.drafter.reset()

    def kv_cache_usage(self) -> float:
        return self.batch.tokens_held() / (self.max_batch * self.max_context) if self.batch else 0.0

    def close(self) -> None:
        self._live = {}
