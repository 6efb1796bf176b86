"""What the serving tests share: the artifacts they serve (built from the session's stage cache) and a server in a
child process."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest
import yaml

from toolchain.build import build
from toolchain.runtime.artifact import open_artifact

ROOT = Path(__file__).resolve().parent.parent
MODEL = "deepseek-v3-tiny"
# the artifacts served: OpenVINO's two engines, and ONNX Runtime
BACKENDS = ("openvino", "openvino-latent", "onnxruntime")
ENGINES = {"openvino": "openvino_genai", "openvino-latent": "dstc", "onnxruntime": "dstc"}


def build_artifacts(root: Path, stage_cache: Path, backends: tuple[str, ...] = BACKENDS) -> dict:
    """{backend: Artifact}: the embedded DeepSeek-V3 model, INT4 on OpenVINO (a compression.json to export) with the
    per-head KV cache, which openvino_genai's continuous batching pages; the same with the latent cache (what the
    shipped recipe builds), which dstc's runner batches on OpenVINO; and fp32 on ONNX Runtime with the latent cache.
    Built from the stages the session has cached, if any."""
    int4 = {"scheme": "int4-grouped", "group_size": 128}
    recipes = {
        "openvino": {"export": {"parity": [], "mla_cache": "per-head"}, "compress": int4,
                     "compile": {"backend": "openvino", "verify": False}},
        "openvino-latent": {"export": {"parity": []}, "compress": int4,
                            "compile": {"backend": "openvino", "verify": False}},
        "onnxruntime": {"export": {"parity": []}, "compile": {"backend": "onnxruntime", "verify": False}},
    }
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(stage_cache))
        for backend in backends:
            stages = recipes[backend]
            recipe = root / f"{MODEL}-{backend}.yaml"
            recipe.write_text(yaml.safe_dump({"name": f"{MODEL}-{backend}", "model": MODEL, **stages}))
            manifest = build(recipe, root / f"{MODEL}-{backend}")
            assert manifest["provenance"]["stage_reports"]["export/export.json"]["graph"]["kv_cache"] == \
                ("per-head" if backend == "openvino" else "latent")
            out[backend] = open_artifact(root / f"{MODEL}-{backend}")
    return out


def _die_with_parent() -> None:
    """In the server's child before exec: SIGTERM when the test process dies (a killed or timed-out run leaves no
    server behind; the server stops its engine process)."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Server:
    """``python -m toolchain serve`` on a free port, ready (GET /health 200) when returned. ``artifact``: a built
    artifact (its ``path``) or a path; ``program``, ``env`` and ``cwd``: another dstc (an installed wheel's), in
    another environment and directory."""

    def __init__(self, artifact, *args: str, timeout: float = 90.0, api_key: str | None = None,
                 program: Sequence[str] = (sys.executable, "-m", "toolchain"), env: dict | None = None,
                 cwd: Path = ROOT) -> None:
        path = Path(getattr(artifact, "path", artifact))
        self.name = path.name
        self.api_key = api_key
        self.auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.process = subprocess.Popen(
            [*program, "serve", str(path), "--port", "0", "--threads", "2", *args],
            cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent)
        self.log: list[str] = []
        self._port = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + timeout
        if not self._port.wait(timeout):
            self.stop()
            pytest.fail("the server printed no address:\n" + "".join(self.log))
        while True:
            assert self.process.poll() is None, "the server exited:\n" + "".join(self.log)
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not become ready:\n" + "".join(self.log)
            time.sleep(0.05)

    def _read(self) -> None:
        for line in self.process.stderr:
            self.log.append(line)
            match = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
            if match and not self._port.is_set():
                self.base = f"http://127.0.0.1:{match.group(1)}"
                self._port.set()

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=self.api_key or "unused", max_retries=0, timeout=60,
                             **kw)

    def post(self, path: str, body, **kw) -> httpx.Response:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **self.auth, **kw.pop("headers", {})}
        return httpx.post(self.base + path, content=content, headers=headers, timeout=30, **kw)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, parsed with prometheus_client's parser."""
        from prometheus_client.parser import text_string_to_metric_families

        samples = {}
        for family in text_string_to_metric_families(httpx.get(self.base + "/metrics", timeout=10).text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples

    def wait_for(self, predicate, timeout: float = 5.0) -> dict[str, float]:
        deadline = time.monotonic() + timeout
        while True:
            metrics = self.metrics()
            if predicate(metrics):
                return metrics
            assert time.monotonic() < deadline, f"not reached within {timeout} s: {metrics}"
            time.sleep(0.02)

    @property
    def address(self) -> tuple[str, int]:
        return "127.0.0.1", int(self.base.rsplit(":", 1)[1])

    def rss_bytes(self) -> int:
        """The server process's resident set (its engine runs in a process of its own)."""
        status = Path(f"/proc/{self.process.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", status, re.M).group(1)) * 1024

    def logged(self, *texts: str, timeout: float = 10.0) -> list[str]:
        """The server's log lines holding every one of ``texts``, waiting up to ``timeout`` for the first."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [line for line in list(self.log) if all(t in line for t in texts)]
            if lines or time.monotonic() > deadline:
                return lines
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


