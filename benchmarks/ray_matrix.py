"""A recipe matrix built on a Ray cluster of two 1-CPU workers against one of a single 1-CPU worker (issue #25's
target: <= 0.6x the wall time), and the artifacts compared file for file between the clusters and with local builds.

The eight embedded INT4 recipes of the original four models (`recipes/{deepseek-v2-lite,deepseek-v3,
r1-distill-qwen,r1-distill-llama}-tiny-{onnxruntime,openvino}-int4.yaml`) are copied without their eval and gates
(a build's accuracy report is not what is timed). For each round and cluster size, in alternating order: `ray
start --head --num-cpus 0` (a head that runs no builds) and N `ray start --address ... --num-cpus 1` workers on
this machine, a fresh stage cache, `dstc build RECIPES... -o OUT --ray 127.0.0.1:PORT` timed from start to exit,
`ray stop`. Each round's artifacts are compared by their manifests' file hashes with the first round's, and
``--local`` recipes (names) are built without Ray once and compared too. Ray's workers run at nice 0 here
(its default is 15), as the local builds do. Holds the benchmark
lock (benchmarks/harness.py's one_at_a_time): one benchmark at a time on the shared machine.

    .venv/bin/python benchmarks/ray_matrix.py --work /tmp/ray-matrix --rounds 3 --json ray_matrix.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.harness import one_at_a_time  # noqa: E402

MODELS = ("deepseek-v2-lite-tiny", "deepseek-v3-tiny", "r1-distill-qwen-tiny", "r1-distill-llama-tiny")
BIN = Path(sys.executable).parent
PORT = 6391


def recipes(work: Path) -> list[Path]:
    paths = []
    for model in MODELS:
        for backend in ("onnxruntime", "openvino"):
            data = yaml.safe_load((REPO / "recipes" / f"{model}-{backend}-int4.yaml").read_text())
            data.pop("eval", None)
            data.pop("gates", None)
            path = work / "recipes" / f"{data['name']}.yaml"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(yaml.safe_dump(data))
            paths.append(path)
    return paths


def ray(*args: str, env: dict) -> None:
    subprocess.run([str(BIN / "ray"), *args], env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)


def manifests(out: Path) -> dict[str, dict]:
    return {d.name: json.loads((d / "manifest.json").read_text())["files"] for d in sorted(out.iterdir())
            if (d / "manifest.json").is_file()}


def build(paths: list[Path], out: Path, cache: Path, env: dict, log: Path, ray_address: str | None) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    command = [str(BIN / "dstc"), "build", *map(str, paths), "-o", str(out),
               *(["--ray", ray_address] if ray_address else [])]
    started = time.perf_counter()
    with log.open("w") as sink:
        code = subprocess.run(command, env={**env, "DSTC_CACHE_DIR": str(cache)}, stdout=sink,
                              stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    if code:
        sys.exit(f"build failed (exit {code}), see {log}")
    return seconds


def on_cluster(workers: int, paths: list[Path], work: Path, env: dict, label: str) -> float:
    ray("stop", "--force", env=env)
    ray("start", "--head", "--port", str(PORT), "--num-cpus", "0", "--include-dashboard", "false", env=env)
    try:
        for _ in range(workers):
            ray("start", "--address", f"127.0.0.1:{PORT}", "--num-cpus", "1", env=env)
        return build(paths, work / label, work / "cache", env, work / f"{label}.log", f"127.0.0.1:{PORT}")
    finally:
        ray("stop", "--force", env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local", default="r1-distill-qwen-tiny-onnxruntime-int4,deepseek-v3-tiny-openvino-int4",
                        help="Recipes (names) also built without Ray, compared with the clusters' artifacts.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    paths = recipes(work)
    # Ray runs its workers at nice 15; at 0 the machine's other (niced) work does not take their CPU mid-run
    env = {**os.environ, "RAY_AUTH_MODE": "token", "PYTHONPATH": str(REPO), "RAY_worker_niceness": "0"}
    runs: list[dict] = []
    reference: dict | None = None
    with one_at_a_time():
        for round_ in range(args.rounds):
            order = (1, 2) if round_ % 2 == 0 else (2, 1)
            for workers in order:
                label = f"round{round_}-workers{workers}"
                seconds = on_cluster(workers, paths, work, env, label)
                files = manifests(work / label)
                reference = reference or files
                runs.append({"round": round_, "workers": workers, "seconds": round(seconds, 1),
                             "artifacts": len(files), "identical": files == reference})
                print(json.dumps(runs[-1]), flush=True)
                shutil.rmtree(work / label)
        local = {}
        for name in filter(None, args.local.split(",")):
            path = work / "recipes" / f"{name}.yaml"
            build([path], work / "local" / name, work / "cache", env, work / f"local-{name}.log", None)
            files = json.loads((work / "local" / name / "manifest.json").read_text())["files"]
            local[name] = files == (reference or {}).get(name)
    seconds = {(r["round"], r["workers"]): r["seconds"] for r in runs}
    one = [s for (_, workers), s in seconds.items() if workers == 1]
    two = [s for (_, workers), s in seconds.items() if workers == 2]
    summary = {"runs": runs, "median_one_worker_s": statistics.median(one),
               "median_two_workers_s": statistics.median(two),
               "ratio_of_medians": round(statistics.median(two) / statistics.median(one), 3),
               "ratio_per_round": [round(seconds[i, 2] / seconds[i, 1], 3) for i in range(args.rounds)],
               "all_identical": all(r["identical"] for r in runs), "local_identical": local,
               "load_average": os.getloadavg()}
    print(json.dumps(summary, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
