"""`dstc serve --replicas N`: throughput of 1 replica against N at 16 concurrent streaming clients, and a replica
killed under load.

``load``: for each replica count (``--replicas 1,2``; 0: the single-engine server without Ray, for Ray's own
cost), a `dstc serve ARTIFACT --replicas R --threads T` child (a local Ray started by the server, prefix caching
off), warmed up, then ``--clients`` concurrent streaming clients in a closed loop for ``--time-limit`` seconds
(serve_load.py's workload: the same held-out prompt, exactly ``--max-tokens`` new tokens each, ``ignore_eos``).
Printed per count: requests, tokens, tokens/s, TTFT and ITL P50/P99, the whole process tree's peak RSS (the
server, Ray's processes, the replicas and their engine processes; sampled every 0.2 s), and the ratio of each
count's tokens/s to the first's.

``kill``: a 2-replica server under the same load; after ``--kill-after`` seconds one replica's process gets SIGKILL.
Printed: the requests that failed (and that they were all in flight at the kill), those in flight at the kill that
completed, the time from the kill to the answer of a one-token request sent right after it (the endpoint's
answer) and to the completion of the first load request sent after it, and the time until /health shows both
replicas ready again (the replacement's new pid).

    .venv/bin/python benchmarks/serve_replicas.py load ARTIFACT --replicas 1,2 --threads 1
    .venv/bin/python benchmarks/serve_replicas.py kill ARTIFACT --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from harness import tree_memory  # noqa: E402
from serve_load import ServerProcess, server_level, workload_prompt  # noqa: E402

from toolchain.runtime.artifact import open_artifact  # noqa: E402

READY_TIMEOUT_S = 600  # a local Ray, Ray Serve and N model loads on 2 cores


class PeakRss:
    """The largest resident set of a process tree, sampled in a thread until stopped."""

    def __init__(self, pid: int, every_s: float = 0.2) -> None:
        self.pid, self.every_s, self.peak, self.anon = pid, every_s, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.is_set():
            rss, anon = tree_memory(self.pid)
            self.peak, self.anon = max(self.peak, rss), max(self.anon, anon)
            self._stop.wait(self.every_s)

    def stop(self) -> tuple[int, int]:
        self._stop.set()
        self._thread.join()
        return self.peak, self.anon


def _server(artifact, replicas: int, threads: int, clients: int) -> ServerProcess:
    """0 replicas: the single-engine server, without Ray (the reference for Ray's own cost)."""
    # PYTHONPATH: the local Ray's workers import this checkout's dstc, as the server does
    os.environ["PYTHONPATH"] = os.pathsep.join([str(HERE.parent), *filter(None, [os.environ.get("PYTHONPATH")])])
    extra = ("--replicas", str(replicas)) if replicas else ()
    return ServerProcess(artifact, threads, clients, *extra, timeout=READY_TIMEOUT_S)


def load(args) -> None:
    artifact = open_artifact(args.artifact)
    prompt = workload_prompt(artifact, args.prompt_tokens)
    name = artifact.path.resolve().name
    rows = []
    for replicas in [int(r) for r in args.replicas.split(",")]:
        started = time.perf_counter()
        server = _server(artifact, replicas, args.threads, args.clients)
        ready_s = time.perf_counter() - started
        memory = PeakRss(server.process.pid)
        try:
            label = f"{replicas} replica{'s' if replicas > 1 else ''} x {args.threads} thread" if replicas else \
                f"single engine (no Ray) x {args.threads} thread"
            server_level(server.base, name, prompt, 2 * max(replicas, 1), 1, args.max_tokens, 60, label)  # warm-up
            run = server_level(server.base, name, prompt, args.clients, 10 ** 6, args.max_tokens, args.time_limit,
                               label)
        finally:
            peak, anon = memory.stop()
            server.stop()
        row = {**run.row(), "replicas": replicas, "threads": args.threads, "ready_s": round(ready_s, 1),
               "peak_rss_gib": round(peak / 2 ** 30, 2), "peak_anon_gib": round(anon / 2 ** 30, 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print("| replicas x threads | requests | tokens | tok/s | vs first | TTFT P50/P99 ms | ITL P50/P99 ms | errors | "
          "tree peak RSS GiB (anon) | ready s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['replicas']} x {r['threads']} | {r['requests']} | {r['tokens']} | {r['throughput_tok_s']} | "
              f"{r['throughput_tok_s'] / rows[0]['throughput_tok_s']:.2f} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
              f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | {r['errors']} | {r['peak_rss_gib']} ({r['peak_anon_gib']}) | "
              f"{r['ready_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")


def kill(args) -> None:
    artifact = open_artifact(args.artifact)
    prompt = workload_prompt(artifact, args.prompt_tokens)
    name = artifact.path.resolve().name
    server = _server(artifact, 2, args.threads, args.clients)
    memory = PeakRss(server.process.pid)
    outcomes: list[tuple[float, float, int]] = []  # (sent, ended, status)
    try:
        server_level(server.base, name, prompt, 4, 1, args.max_tokens, 60, "warm-up")
        victim = httpx.get(server.base + "/health", timeout=10).json()["replicas"][1]
        stop = time.monotonic() + args.time_limit
        body = {"model": name, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True}

        def client() -> None:
            with httpx.Client(base_url=server.base, timeout=300) as http:
                while time.monotonic() < stop:
                    sent = time.monotonic()
                    status = http.post("/v1/completions", json=body).status_code
                    outcomes.append((sent, time.monotonic(), status))

        clients = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in clients:
            thread.start()
        time.sleep(args.kill_after)
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        # the endpoint's answer: a one-token request sent at once, again every 0.2 s until one succeeds
        answered_s = None
        with httpx.Client(base_url=server.base, timeout=60) as http:
            while answered_s is None and time.monotonic() - killed < 60:
                probe = http.post("/v1/completions", json={**body, "max_tokens": 1})
                if probe.status_code == 200:
                    answered_s = time.monotonic() - killed
                else:
                    time.sleep(0.2)
        replaced_s = None
        while replaced_s is None and time.monotonic() - killed < 300:
            health = httpx.get(server.base + "/health", timeout=10).json()
            pids = {r["pid"] for r in health.get("replicas", []) if r["state"] == "ready"}
            if len(pids) == 2 and victim["pid"] not in pids:
                replaced_s = time.monotonic() - killed
            time.sleep(0.2)
        for thread in clients:
            thread.join()
    finally:
        peak, _ = memory.stop()
        server.stop()
    failed = [o for o in outcomes if o[2] != 200]
    across = [o for o in outcomes if o[0] < killed < o[1]]
    after = [o for o in outcomes if o[0] > killed and o[2] == 200]
    row = {"requests": len(outcomes), "failed": len(failed), "failed_statuses": sorted({o[2] for o in failed}),
           "failed_all_in_flight_at_kill": all(o[0] < killed < o[1] for o in failed),
           "in_flight_at_kill": len(across), "completed_across_kill": sum(o[2] == 200 for o in across),
           "one_token_answer_after_kill_s": round(answered_s, 2) if answered_s is not None else None,
           "first_load_request_sent_after_kill_done_s": round(min(o[1] for o in after) - killed, 2) if after else None,
           "replaced_after_s": round(replaced_s, 1) if replaced_s is not None else None,
           "tree_peak_rss_gib": round(peak / 2 ** 30, 2)}
    print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for command in ("load", "kill"):
        p = sub.add_parser(command)
        p.add_argument("artifact", type=Path)
        p.add_argument("--threads", type=int, default=1, help="Runtime threads of each replica.")
        p.add_argument("--clients", type=int, default=16)
        p.add_argument("--prompt-tokens", type=int, default=128)
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--time-limit", type=float, default=60.0, help="Seconds of load.")
        p.add_argument("--json", type=Path)
    sub.choices["load"].add_argument("--replicas", default="1,2",
                                     help="Replica counts, comma-separated (0: the single-engine server, no Ray).")
    sub.choices["kill"].add_argument("--kill-after", type=float, default=10.0)
    args = parser.parse_args()
    (load if args.command == "load" else kill)(args)


if __name__ == "__main__":
    main()
