"""Batch invariance of `dstc serve` (issue #39, item 5): does a greedy request get the same text beside others as
alone, per artifact kind, with and without ``--deterministic``, and what does ``--deterministic`` cost?

For each artifact and mode, a `dstc serve` child on a free port of 127.0.0.1; the same N greedy requests (held-out
texts and problems of the embedded corpus, prompts of different lengths; ``max_tokens`` each, ``ignore_eos``) are
sent one at a time (alone), then all together, each started ``--stagger`` seconds after the previous one, so that
they join a running batch at different steps. Printed per artifact and mode: the engine, the share of requests
whose concurrent text differs from their text alone, the concurrent run's generated tokens per second (its decode
cost) and, with ``--deterministic``, its ratio to the plain server's, and whether the texts alone match the plain
server's alone (they must: a request alone runs the same kernels either way).

    .venv/bin/python benchmarks/batch_invariance.py ARTIFACT... [--requests 24] [--max-tokens 48]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.harness import markdown_table
from toolchain.models.corpus import task_examples, text_samples

ROOT = Path(__file__).resolve().parent.parent


def prompts(count: int) -> list[str]:
    """Held-out texts of the embedded corpus, every other one a problem after one to three solved ones: prompts of
    different lengths, whose continuations (new sentences and problems) hold near-tied greedy choices."""
    ex, texts = task_examples("heldout", count + 4), text_samples("heldout", count)
    return [texts[i] if i % 2 else "".join(p + a + "\n" for p, a in ex[i:i + 1 + i % 3]) + ex[i + 3][0]
            for i in range(count)]


class Server:
    """``python -m toolchain serve ARTIFACT --port 0 ...``, ready when made; its log kept."""

    def __init__(self, artifact: Path, *args: str, timeout: float = 300.0) -> None:
        self.name = artifact.name
        self.log: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "toolchain", "serve", str(artifact), "--port", "0",
                                         "--no-access-log", *args], cwd=ROOT, stdin=subprocess.DEVNULL,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.base = ""
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError("the server exited:\n" + "".join(self.log))
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not become ready:\n" + "".join(self.log))
            if self.base:
                try:
                    health = httpx.get(self.base + "/health", timeout=2)
                    if health.status_code == 200:
                        self.engine = health.json()["engine"]
                        return
                except httpx.TransportError:
                    pass
            time.sleep(0.1)

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.log.append(line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if match and not self.base:
                self.base = f"http://127.0.0.1:{match.group(1)}"

    def complete(self, prompt: str, max_tokens: int) -> tuple[str, int]:
        body = {"model": self.name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True}
        response = httpx.post(self.base + "/v1/completions", json=body, timeout=600)
        response.raise_for_status()
        data = response.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def measure(server: Server, texts: list[str], max_tokens: int, stagger: float) -> dict:
    alone = [server.complete(text, max_tokens)[0] for text in texts]
    together: list[tuple[str, int] | None] = [None] * len(texts)

    def send(i: int) -> None:
        together[i] = server.complete(texts[i], max_tokens)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(texts))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
        time.sleep(stagger)
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    assert all(t is not None for t in together)
    done = [t for t in together if t is not None]
    return {"alone": alone, "differ": sum(a != t[0] for a, t in zip(alone, done, strict=True)),
            "tok_s": sum(t[1] for t in done) / seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--stagger", type=float, default=0.05, help="seconds between the concurrent requests' starts")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    texts = prompts(args.requests)
    rows = []
    for artifact in args.artifacts:
        plain: dict = {}
        for mode in ("plain", "--deterministic"):
            server = Server(artifact, "--threads", str(args.threads), *([mode] if mode != "plain" else []))
            try:
                result = measure(server, texts, args.max_tokens, args.stagger)
                decided = next((line.strip() for line in server.log if "--deterministic" in line), "")
            finally:
                server.stop()
            if mode == "plain":
                plain = result
            cost = f"{result['tok_s'] / plain['tok_s']:.2f}x" if mode != "plain" else ""
            changed = sum(a != b for a, b in zip(result["alone"], plain["alone"], strict=True))
            same_alone = "" if mode == "plain" else "yes" if not changed else f"no ({changed})"
            rows.append([artifact.name, server.engine, mode, f"{result['differ']} / {len(texts)}",
                         f"{result['tok_s']:.0f}", cost, same_alone])
            print(f"{artifact.name} {mode}: {result['differ']} of {len(texts)} differ, {result['tok_s']:.0f} tok/s "
                  f"{cost} {decided}", flush=True)
    print()
    print(markdown_table(["artifact", "engine", "mode", "differ (concurrent vs alone)", "concurrent tok/s",
                          "vs plain", "alone = plain's alone"], rows))


if __name__ == "__main__":
    main()
