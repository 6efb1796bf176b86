"""Peak memory and wall time of an INT4 build at real widths, dstc beside optimum-cli, measured in one run.

For each width (shape-faithful random checkpoints from ``dstc models shape-faithful``: R1-Distill-Qwen-1.5B and 7B,
DeepSeek-V3 with few experts) and each layer count, every contender builds the same checkpoint from scratch
(fresh stage cache) under a sampler that sums the resident set of the whole process tree every 50 ms (a build's
children — smoke inference, converters — count too); ``/usr/bin/time``'s figure (the largest single process) is
recorded beside it. Then, per width and contender, peak = a + b * layers is fitted by least squares and projected
to the real layer counts (7B: 28, V2-Lite: 27, V3: 61) and to what fits in 16 / 32 / 64 GB.

    .venv/bin/python benchmarks/build_memory.py --widths qwen-1.5b --layers 2,4,8 --json out.json

The targets of issue #11 are checked and printed: slope b <= 1.5 x one layer's bf16 bytes, intercept a <= 2 x the
bf16 bytes of the embeddings and lm_head + 1 GiB, and at 1.5B x 4 layers dstc's peak RSS and wall time <= optimum's.
Outputs are deleted after each measurement (disk holds one checkpoint and one build at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import yaml

REPO = Path(__file__).resolve().parent.parent
DSTC = [sys.executable, "-m", "toolchain"]
WIDTHS = {  # name -> (reference model, extra shape-faithful options)
    "qwen-1.5b": ("deepseek-r1-distill-qwen-1.5b", []),
    "qwen-7b": ("deepseek-r1-distill-qwen-7b", []),
    "v3-8-experts": ("deepseek-v3", ["--experts", "8"]),
}
REAL_LAYERS = {"qwen-7b": ("R1-Distill-Qwen-7B", 28), "v3-8-experts": ("DeepSeek-V3 (experts scaled)", 61),
               "qwen-1.5b": ("R1-Distill-Qwen-1.5B", 28)}
GiB = 1 << 30


def tree_rss(pid: int) -> int:
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for proc in procs:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def measure(command: list[str], env: dict) -> dict:
    """Run ``command`` under /usr/bin/time -v, sampling its process tree's summed RSS."""
    started = time.perf_counter()
    proc = subprocess.Popen(["/usr/bin/time", "-v", *command], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample() -> None:
        while proc.poll() is None:
            peak[0] = max(peak[0], tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    wall = time.perf_counter() - started
    largest = re.search(r"Maximum resident set size \(kbytes\): (\d+)", err)
    return {"returncode": proc.returncode, "wall_s": round(wall, 1), "tree_peak_bytes": peak[0],
            "largest_process_bytes": int(largest.group(1)) * 1024 if largest else None,
            "tail": (err.strip().splitlines() or [""])[-3:] if proc.returncode else []}


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def make_checkpoint(width: str, layers: int, work: Path) -> Path:
    reference, extra = WIDTHS[width]
    path = work / f"{width}-{layers}"
    if not (path / "config.json").is_file():
        subprocess.run([*DSTC, "models", "shape-faithful", reference, "-o", str(path), "--layers", str(layers),
                        *extra], cwd=REPO, check=True, capture_output=True)
    return path


def dstc_build(checkpoint: Path, backend: str, out: Path, work: Path, checks: bool) -> dict:
    """The INT4 recipe for one backend; ``checks`` False leaves out the export's parity and the compile stage's
    verification (what optimum-cli does not do either; the smoke inference stays)."""
    recipe = work / f"recipe-{backend}.yaml"
    recipe.write_text(yaml.safe_dump({"name": "build-memory", "model": str(checkpoint), "passes": {"target": backend},
                                      "compress": {"scheme": "int4-grouped"},
                                      "export": {} if checks else {"parity": []},
                                      "compile": {"backend": backend, "verify": checks}}))
    env = {**os.environ, "DSTC_CACHE_DIR": str(work / "cache")}
    shutil.rmtree(work / "cache", ignore_errors=True)
    return measure([*DSTC, "build", str(recipe), "-o", str(out), "--no-cache"], env)


def optimum_build(checkpoint: Path, out: Path, work: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return measure([str(Path(sys.executable).parent / "optimum-cli"), "export", "openvino", "--model",
                    str(checkpoint), "--weight-format", "int4", "--task", "text-generation-with-past", str(out)], env)


def fit(points: list[tuple[int, int]]) -> tuple[float, float] | None:
    """(a, b) of peak = a + b * layers, least squares; None with fewer than two layer counts."""
    if len({layers for layers, _ in points}) < 2:
        return None
    x, y = np.array([p[0] for p in points], float), np.array([p[1] for p in points], float)
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", default="qwen-1.5b,qwen-7b,v3-8-experts")
    parser.add_argument("--layers", default="2,4,8")
    parser.add_argument("--contenders", default="dstc-openvino,dstc-onnxruntime,optimum")
    parser.add_argument("--work", type=Path, default=None, help="Scratch directory (default: a new temp dir).")
    parser.add_argument("--no-checks", action="store_true",
                        help="dstc without its parity check and compile verification, like for like with optimum")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="dstc-build-memory-"))
    work.mkdir(parents=True, exist_ok=True)
    layer_counts = [int(n) for n in args.layers.split(",")]
    contenders = args.contenders.split(",")
    results = []
    sizes: dict[str, dict[int, int]] = {}
    for width in args.widths.split(","):
        for layers in layer_counts:
            checkpoint = make_checkpoint(width, layers, work)
            sizes.setdefault(width, {})[layers] = checkpoint_bytes(checkpoint)
            for contender in contenders:
                if contender == "optimum" and not width.startswith("qwen"):
                    continue  # optimum-intel 2.1 refuses DeepSeek-V2/V3 (shared/peer-baselines.md)
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                if contender == "optimum":
                    row = optimum_build(checkpoint, out, work)
                else:
                    row = dstc_build(checkpoint, contender.split("-", 1)[1], out, work, not args.no_checks)
                row.update(width=width, layers=layers, contender=contender)
                results.append(row)
                print(f"{width:>13} {layers:>2} layers {contender:<17} rc {row['returncode']}  {row['wall_s']:>7.1f} s  "
                      f"tree {row['tree_peak_bytes'] / GiB:6.2f} GiB  largest "
                      f"{(row['largest_process_bytes'] or 0) / GiB:6.2f} GiB", flush=True)
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(work / "cache", ignore_errors=True)
            shutil.rmtree(checkpoint, ignore_errors=True)

    print("\nFits: peak RSS (whole process tree) = a + b * layers")
    fits = []
    for width, by_layers in sizes.items():
        counts = sorted(by_layers)
        layer_bytes = (by_layers[counts[-1]] - by_layers[counts[0]]) / (counts[-1] - counts[0]) if len(counts) > 1 \
            else None
        edge_bytes = by_layers[counts[0]] - counts[0] * layer_bytes if layer_bytes else None
        for contender in contenders:
            points = [(r["layers"], r["tree_peak_bytes"]) for r in results
                      if r["width"] == width and r["contender"] == contender and r["returncode"] == 0]
            line = fit(points)
            if line is None or layer_bytes is None:
                continue
            a, b = line
            row = {"width": width, "contender": contender, "a_bytes": a, "b_bytes": b, "layer_bf16_bytes": layer_bytes,
                   "edges_bf16_bytes": edge_bytes, "slope_target_met": b <= 1.5 * layer_bytes,
                   "intercept_target_met": a <= 2 * edge_bytes + GiB}
            name, real = REAL_LAYERS[width]
            row["projection"] = {name: a + b * real}
            row["layers_that_fit"] = {f"{gb} GB": int((gb * 1e9 - a) // b) if b > 0 else None for gb in (16, 32, 64)}
            fits.append(row)
            print(f"{width:>13} {contender:<17} a {a / GiB:5.2f} GiB (target <= {(2 * edge_bytes + GiB) / GiB:.2f}) "
                  f"b {b / 2**20:7.1f} MiB/layer ({b / layer_bytes:.2f}x a layer's bf16, target <= 1.5x)  "
                  f"{name} ({real} layers): {(a + b * real) / GiB:.1f} GiB  fits in 16/32/64 GB: "
                  f"{row['layers_that_fit']['16 GB']}/{row['layers_that_fit']['32 GB']}/"
                  f"{row['layers_that_fit']['64 GB']} layers")
    head = {(r["contender"]): r for r in results if r["width"] == "qwen-1.5b" and r["layers"] == 4}
    if "optimum" in head:
        print("\nR1-Distill-Qwen-1.5B x 4 layers vs optimum-cli (same run):")
        for contender, r in head.items():
            o = head["optimum"]
            print(f"  {contender:<17} {r['wall_s']:7.1f} s ({r['wall_s'] / o['wall_s']:.2f}x)  "
                  f"{r['tree_peak_bytes'] / GiB:.2f} GiB ({r['tree_peak_bytes'] / o['tree_peak_bytes']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": _cpu(), "checks": not args.no_checks, "results": results,
                                         "fits": fits}, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
