"""Load on `dstc serve`, against the same batching driven directly, so that the server's overhead is a ratio.

``load``: for each artifact, a `dstc serve` child on a free localhost port (prefix caching off, so that repeated
prompts are not served from the cache), then N concurrent streaming clients (1, 4, 16) in a closed loop: each sends
a request, reads its stream to the end, sends the next, until it has sent ``--requests-per-client`` or the level's
``--time-limit`` has passed. Every request is the same token ids and generates exactly ``--max-tokens`` tokens
(``ignore_eos``). Then the same workload, N requests in flight, on the batching without the server:
openvino_genai's ContinuousBatchingPipeline (OpenVINO artifacts it can page) or dstc's batched runner (ONNX Runtime
artifacts, and OpenVINO ones with MLA's latent cache), in this process. Printed per backend, level and side:
requests, tokens, throughput (generated tokens per second of wall time), TTFT P50/P99 and ITL P50/P99, and the
server's ratios to the bare batching.

``layouts``: the ONNX Runtime KV-cache layouts of toolchain/runtime/batching.py, "batch" (one cache per layer for
the running batch, rebuilt when sequences join) and "gather" (a cache per sequence, gathered every step): decode
step, join and leave times for batches of 1, 4, 16 at contexts of 64 and 512 tokens.

    .venv/bin/python benchmarks/serve_load.py load artifacts/deepseek-v3-tiny-openvino-int4 \\
        artifacts/deepseek-v3-tiny-onnxruntime-int4
    .venv/bin/python benchmarks/serve_load.py layouts artifacts/deepseek-v3-tiny-onnxruntime-int4
    .venv/bin/python benchmarks/serve_load.py speculate ARTIFACT... --methods none,prompt-lookup,mtp
    .venv/bin/python benchmarks/serve_load.py speculate ARTIFACT --methods none,prompt-lookup,draft:DRAFT_ARTIFACT

``speculate``: `dstc serve` without and with ``--speculate`` (each method a server of its own, all started at once;
the load workload above at each level, the methods in turn for ``--repeats`` rounds, the median round reported),
and from each server's /metrics over the level the verify steps and drafts: the mean tokens a verify step gives a
request (1 + accepted drafts per step) and the acceptance per draft position. Measured on the embedded
deepseek-v3-tiny (docs/serve.md "Serving", speculative decoding): lossless and 0.13-0.9x the plain server's tokens/s, the
tiny model's steps being bound by compute and per-run overhead rather than by reading weights.

An OpenVINO artifact built with ``export: {mla_cache: per-head}`` runs on openvino_genai's pipeline; the shipped
recipes' latent one on dstc's runner (its cache in the stateful IR's variables).

Measured on the 2-core Xeon (AMX) this project runs on, embedded DeepSeek-V3 INT4 with the per-head KV cache (the
default then), --threads 2 ("layouts", one run; median ms per decode step, batch / gather): B=1: 64 tokens
0.92 / 0.78, 512 tokens 1.09 / 1.17; B=4: 0.97 / 1.20, 1.54 / 4.09; B=16: 1.63 / 2.24, 3.10 / 11.48. A join costs
the batch layout one copy of the running cache (B=16 at 512 tokens: 21.4 ms against gather's 15.3 ms, the prefill
itself being most of both); a leave costs neither a copy. The server uses "batch".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from toolchain.runtime.artifact import open_artifact  # noqa: E402


@dataclass
class Run:
    backend: str
    side: str  # "server" | "bare"
    clients: int
    wall_s: float = 0.0
    requests: int = 0
    tokens: int = 0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    def pct(self, series: str, q: float) -> float:
        values = getattr(self, series)
        return float(np.percentile(values, q)) * 1e3 if values else float("nan")

    def row(self) -> dict:
        return {"backend": self.backend, "side": self.side, "clients": self.clients, "requests": self.requests,
                "tokens": self.tokens, "errors": self.errors, "wall_s": round(self.wall_s, 3),
                "throughput_tok_s": round(self.throughput, 1),
                "ttft_p50_ms": round(self.pct("ttft", 50), 2), "ttft_p99_ms": round(self.pct("ttft", 99), 2),
                "itl_p50_ms": round(self.pct("itl", 50), 3), "itl_p99_ms": round(self.pct("itl", 99), 3)}


def workload_prompt(artifact, tokens: int) -> list[int]:
    """Token ids of held-out arithmetic problems and answers, cut to ``tokens``."""
    from toolchain.models.corpus import task_examples

    tokenizer = artifact.tokenizer()
    text = "".join(p + a + "\n" for p, a in task_examples("heldout", 200))
    ids = tokenizer(text)["input_ids"]
    if len(ids) < tokens:
        raise SystemExit(f"the corpus gives only {len(ids)} prompt tokens")
    return ids[:tokens]


# -- the server ------------------------------------------------------------------------------------------------------


class ServerProcess:
    """``dstc serve`` on a free port, ready (/health 200) within ``timeout``; ``extra``: more of its options."""

    def __init__(self, artifact, threads: int, max_batch: int, *extra: str, timeout: float = 120) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "toolchain", "serve", str(artifact.path), "--port", "0", "--threads", str(threads),
             "--max-batch", str(max_batch), "--max-queue", "256", "--no-prefix-caching", *extra],
            cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = self.process.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        if not match:
            self.stop()
            raise SystemExit(f"dstc serve did not start: {line}{self.process.stderr.read()}")
        self.base = f"http://127.0.0.1:{match.group(1)}"
        threading.Thread(target=lambda: [None for _ in self.process.stderr], daemon=True).start()
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        self.stop()
        raise SystemExit(f"dstc serve did not become ready in {timeout:g} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()


async def _client(http, url: str, body: dict, run: Run, per_client: int, deadline: float) -> None:
    for _ in range(per_client):
        if time.perf_counter() > deadline:
            return
        sent = time.perf_counter()
        last, count = None, 0
        try:
            async with http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    run.errors += 1
                    await response.aread()
                    continue
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    # continuous usage stats: a chunk per step that generated tokens, with the count so far
                    new = (chunk.get("usage") or {}).get("completion_tokens", count) - count
                    if new <= 0:
                        continue
                    count += new
                    now = time.perf_counter()
                    if last is None:  # the first token; others in the same chunk came with it
                        run.ttft.append(now - sent)
                        run.itl.extend([0.0] * (new - 1))
                    else:
                        run.itl.extend([(now - last) / new] * new)
                    last = now
        except Exception:
            run.errors += 1
            continue
        run.requests += 1
        run.tokens += count


def server_level(base: str, model: str, prompt: list[int], clients: int, per_client: int, max_tokens: int,
                 time_limit: float, backend: str) -> Run:
    import httpx

    run = Run(backend, "server", clients)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}, "ignore_eos": True}

    async def main() -> None:
        limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            deadline = time.perf_counter() + time_limit
            started = time.perf_counter()
            await asyncio.gather(*(_client(http, base + "/v1/completions", body, run, per_client, deadline)
                                   for _ in range(clients)))
            run.wall_s = time.perf_counter() - started

    asyncio.run(main())
    return run


# -- the bare batching -----------------------------------------------------------------------------------------------


def bare_openvino(pipeline, prompt: list[int], clients: int, per_client: int, max_tokens: int, time_limit: float,
                  stop_ids, label: str) -> Run:
    import openvino as ov
    import openvino_genai as genai

    from toolchain.runtime.batching import openvino_generation_config

    run = Run(label, "bare", clients)
    config = openvino_generation_config(max_new_tokens=max_tokens, stop_ids=stop_ids, temperature=0, top_p=1,
                                        seed=None, ignore_eos=True)
    tensor = ov.Tensor(np.array([prompt], np.int64))
    total = clients * per_client
    ids = iter(range(10**9))
    live: dict[int, list] = {}  # id -> [handle, added, last, count]
    started = time.perf_counter()
    deadline = started + time_limit
    sent = 0
    while sent < total or live:
        while len(live) < clients and sent < total and time.perf_counter() < deadline:
            key = next(ids)
            live[key] = [pipeline.add_request(key, tensor, config), time.perf_counter(), None, 0]
            sent += 1
        if not live:
            break
        pipeline.step()
        now = time.perf_counter()
        for key, entry in list(live.items()):
            handle = entry[0]
            new = 0
            while handle.can_read():
                for output in handle.read().values():
                    new += len(output.generated_ids)
            for _ in range(new):
                if entry[2] is None:
                    run.ttft.append(now - entry[1])
                else:
                    run.itl.append(now - entry[2])
                entry[2] = now
            entry[3] += new
            if handle.get_status() != genai.GenerationStatus.RUNNING:
                run.requests += 1
                run.tokens += entry[3]
                del live[key]
    run.wall_s = time.perf_counter() - started
    return run


def bare_runner(batch, prompt: list[int], clients: int, per_client: int, max_tokens: int,
                time_limit: float, label: str) -> Run:
    run = Run(label, "bare", clients)
    total = clients * per_client
    ids = iter(range(10**9))
    live: dict[int, list] = {}  # id -> [added, last time, last token, count]
    started = time.perf_counter()
    deadline = started + time_limit
    sent = 0

    def take(logits: dict) -> None:
        now = time.perf_counter()
        done = []
        for key, row in logits.items():
            entry = live[key]
            if entry[1] is None:
                run.ttft.append(now - entry[0])
            else:
                run.itl.append(now - entry[1])
            entry[1], entry[2] = now, int(row.argmax())
            entry[3] += 1
            if entry[3] >= max_tokens:
                done.append(key)
        batch.leave(done)
        for key in done:
            run.requests += 1
            run.tokens += live.pop(key)[3]

    while sent < total or live:
        joining = {}
        while len(live) + len(joining) < clients and sent < total and time.perf_counter() < deadline:
            key = next(ids)
            joining[key] = prompt
            live[key] = [time.perf_counter(), None, None, 0]
            sent += 1
        if joining:
            take(batch.join(joining))
        if not live:
            break
        take(batch.step({key: live[key][2] for key in batch.keys}))
    run.wall_s = time.perf_counter() - started
    return run


# -- commands --------------------------------------------------------------------------------------------------------


def load(args) -> None:
    rows = []
    for path in args.artifacts:
        artifact = open_artifact(path)
        prompt = workload_prompt(artifact, args.prompt_tokens)
        levels = [int(c) for c in args.clients.split(",")]
        max_batch = max(levels)
        print(f"== {artifact.path.name} ({artifact.backend}): prompt {len(prompt)} tokens, {args.max_tokens} new "
              f"tokens per request, {args.requests_per_client} requests per client", flush=True)
        from toolchain.serve.engine_options import GENAI, serving_engine

        genai = serving_engine(artifact) == GENAI
        label = f"{artifact.backend} ({'openvino_genai' if genai else 'dstc runner'})"  # the engine the server uses
        server = ServerProcess(artifact, args.threads, max_batch)
        try:
            name = artifact.path.resolve().name
            server_level(server.base, name, prompt, 1, 2, args.max_tokens, 30, label)  # warm-up
            for clients in levels:
                run = server_level(server.base, name, prompt, clients, args.requests_per_client, args.max_tokens,
                                   args.time_limit, label)
                rows.append(run.row())
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
        if genai:
            from toolchain.runtime.batching import PipelineSettings, openvino_pipeline

            pipeline, _, _ = openvino_pipeline(artifact, PipelineSettings(
                threads=args.threads, max_batch=max_batch, max_context=min(artifact.context_length or 4096, 4096),
                prefix_caching=False))
            bare = lambda c, n, t: bare_openvino(pipeline, prompt, c, n, args.max_tokens, t,  # noqa: E731
                                                 artifact.eos_token_ids, label)
        else:  # dstc's runner, as the server batches these artifacts (toolchain/serve/engine_runner.py)
            from toolchain.runtime.batching import batched_decoder
            from toolchain.runtime.batching_openvino import StatefulBatch
            from toolchain.runtime.decoder import open_decoder

            decoder = open_decoder(artifact, threads=args.threads)
            batch = StatefulBatch(decoder, artifact.pad_token_id) if decoder.backend == "openvino" else \
                batched_decoder(decoder, artifact.pad_token_id)
            bare = lambda c, n, t: bare_runner(batch, prompt, c, n, args.max_tokens, t, label)  # noqa: E731
        bare(1, 2, 30)  # warm-up
        for clients in levels:
            rows.append(bare(clients, args.requests_per_client, args.time_limit).row())
            print(json.dumps(rows[-1]), flush=True)
    print()
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def table(rows: list[dict]) -> str:
    head = ("backend", "side", "clients", "requests", "tokens", "tok/s", "TTFT P50 ms", "TTFT P99 ms", "ITL P50 ms",
            "ITL P99 ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(v) for v in (
            r["backend"], r["side"], r["clients"], r["requests"], r["tokens"], r["throughput_tok_s"], r["ttft_p50_ms"],
            r["ttft_p99_ms"], r["itl_p50_ms"], r["itl_p99_ms"])) + " |")
    lines += ["", "| backend | clients | throughput server/bare | TTFT P50 server/bare | ITL P50 server/bare |",
              "|---|---|---|---|---|"]
    bare = {(r["backend"], r["clients"]): r for r in rows if r["side"] == "bare"}
    for r in rows:
        b = bare.get((r["backend"], r["clients"]))
        if r["side"] == "server" and b:
            lines.append(f"| {r['backend']} | {r['clients']} | {r['throughput_tok_s'] / b['throughput_tok_s']:.2f} | "
                         f"{r['ttft_p50_ms'] / b['ttft_p50_ms']:.2f} | {r['itl_p50_ms'] / b['itl_p50_ms']:.2f} |")
    return "\n".join(lines)


def _speculative_counters(base: str) -> tuple[float, list[float], list[float]]:
    """(verify steps, proposed and accepted drafts per position) from the server's /metrics so far."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    steps, proposed, accepted = 0.0, {}, {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == "dstc_speculative_verify_steps_total":
                steps = sample.value
            elif sample.name in ("dstc_speculative_proposed_total", "dstc_speculative_accepted_total"):
                into = proposed if "proposed" in sample.name else accepted
                into[int(sample.labels["position"])] = sample.value
    positions = range(max([*proposed, *accepted], default=-1) + 1)  # openvino_genai's server counts no proposed
    return steps, [proposed.get(i, 0.0) for i in positions], [accepted.get(i, 0.0) for i in positions]


def speculate(args) -> None:
    rows = []
    methods = args.methods.split(",")
    for path in args.artifacts:
        artifact = open_artifact(path)
        prompt = workload_prompt(artifact, args.prompt_tokens)
        levels = [int(c) for c in args.clients.split(",")]
        name = artifact.path.resolve().name
        print(f"== {name}: prompt {len(prompt)} tokens, {args.max_tokens} new tokens per request, "
              f"{args.requests_per_client} requests per client, {args.draft_tokens} draft tokens, "
              f"{args.repeats} rounds", flush=True)
        # every method's server at once, idle but for the one measured: each level runs the methods in turn,
        # round after round, so that a change of the machine's load falls on all of them alike
        servers = {}
        try:
            for method in methods:
                extra = () if method == "none" else ("--speculate", method, "--draft-tokens", str(args.draft_tokens))
                servers[method] = ServerProcess(artifact, args.threads, max(levels), *extra)
                server_level(servers[method].base, name, prompt, 1, 2, args.max_tokens, 30, method)  # warm-up
            for clients in levels:
                runs: dict[str, list] = {method: [] for method in methods}
                for _ in range(args.repeats):
                    for method, server in servers.items():
                        before = _speculative_counters(server.base)
                        run = server_level(server.base, name, prompt, clients, args.requests_per_client,
                                           args.max_tokens, args.time_limit, method)
                        runs[method].append((run, before, _speculative_counters(server.base)))
                for method in methods:
                    rows.append(_speculate_row(name, _label(method), runs[method]))
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            for server in servers.values():
                server.stop()
    print()
    head = ("artifact", "speculation", "clients", "tok/s (median)", "vs none", "ITL P50 ms", "tokens / verify step",
            "acceptance per position")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    plain = {(r["artifact"], r["clients"]): r["throughput_tok_s"] for r in rows if r["method"] == "none"}
    for r in rows:
        base = plain.get((r["artifact"], r["clients"]))
        lines.append("| " + " | ".join(str(v) for v in (
            r["artifact"], r["method"], r["clients"], r["throughput_tok_s"],
            f"{r['throughput_tok_s'] / base:.2f}" if base else "", r["itl_p50_ms"],
            r["tokens_per_verify_step"] or "", " ".join(str(a) for a in r["acceptance_per_position"]))) + " |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def _label(method: str) -> str:
    """A method as the table names it: a draft artifact by its directory's name."""
    return f"draft:{Path(method[len('draft:'):]).name}" if method.startswith("draft:") else method


def _speculate_row(name: str, method: str, runs: list) -> dict:
    """One method at one level over its rounds: the median round's throughput and ITL, and the drafts counted over
    all rounds."""
    steps, proposed, accepted = 0.0, [], []
    for _, before, after in runs:
        steps += after[0] - before[0]
        for totals, now, then in ((proposed, after[1], before[1]), (accepted, after[2], before[2])):
            totals += [0.0] * max(0, len(now) - len(totals))
            for i, value in enumerate(now):
                totals[i] += value - (then[i] if i < len(then) else 0.0)
    median = sorted((run for run, _, _ in runs), key=lambda run: run.throughput)[len(runs) // 2]
    return {"artifact": name, "method": method, **median.row(),
            "throughput_rounds": [round(run.throughput, 1) for run, _, _ in runs],
            "tokens_per_verify_step": round(1 + sum(accepted) / steps, 3) if steps else None,
            "acceptance_per_position": [round(a / p, 3) if p else None for a, p in zip(accepted, proposed)]}


def layouts(args) -> None:
    from toolchain.runtime.batching import LAYOUTS, batched_decoder
    from toolchain.runtime.decoder import open_decoder

    artifact = open_artifact(args.artifact)
    decoder = open_decoder(artifact, threads=args.threads)
    vocab = int(artifact.config["vocab_size"])
    rng = np.random.default_rng(0)
    for batch_size in [int(b) for b in args.batches.split(",")]:
        for context in [int(c) for c in args.contexts.split(",")]:
            for layout in LAYOUTS:
                batch = batched_decoder(decoder, artifact.pad_token_id, layout)
                batch.join({-1: list(rng.integers(3, vocab, context))})  # warm-up of this shape
                batch.leave([-1])
                joins = []
                for key in range(batch_size):  # staggered lengths, one join each
                    length = max(1, context - 4 * key)
                    t0 = time.perf_counter()
                    batch.join({key: list(rng.integers(3, vocab, length))})
                    joins.append(time.perf_counter() - t0)
                steps = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    batch.step({k: 5 for k in batch.keys})
                    steps.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                batch.leave([0])
                leave = time.perf_counter() - t0
                print(f"B={batch_size:<3d} context={context:<5d} {layout:<7s} step {np.median(steps) * 1e3:7.2f} ms  "
                      f"join {np.median(joins) * 1e3:7.2f} ms  leave {leave * 1e3:6.2f} ms", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("load", help="the server against the bare batching, per backend")
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per level and side, at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=load)
    p = sub.add_parser("speculate", help="the server without and with --speculate, per artifact")
    p.add_argument("artifacts", nargs="+", type=Path)
    p.add_argument("--methods", default="none,prompt-lookup,mtp",
                   help="none and --speculate values (draft:ARTIFACT: an absolute path, the servers run in the repo)")
    p.add_argument("--draft-tokens", type=int, default=4)
    p.add_argument("--repeats", type=int, default=3, help="rounds of every method per level")
    p.add_argument("--clients", default="1,4,16")
    p.add_argument("--requests-per-client", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=60.0, help="seconds per level, at most")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.set_defaults(func=speculate)
    p = sub.add_parser("layouts", help="ONNX Runtime KV-cache layouts: step, join, leave")
    p.add_argument("artifact", type=Path)
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--contexts", default="64,512")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.set_defaults(func=layouts)
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
