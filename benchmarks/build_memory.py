"""Peak memory and wall time of an INT4 build at real widths, dstc beside optimum-cli, measured in one run.

For each width (shape-faithful random checkpoints from ``dstc models shape-faithful``: R1-Distill-Qwen-1.5B and 7B,
DeepSeek-V3 with few experts, and ``v3-real-1moe``: DeepSeek-V3's real widths with all 256 experts in the hub's FP8
layout, whose 4 layers are 3 dense and 1 MoE) and each layer count, every contender builds the same checkpoint
from scratch (fresh stage cache) under a sampler that sums the resident set of the whole process tree every 50 ms
(a build's children — smoke inference, converters — count too); ``/usr/bin/time``'s figure (the largest single
process) is recorded beside it, and so are each dstc stage's peak, wall time and output size and the most disk
the run held at once (checkpoint, stage cache and artifact). Then, per width and contender, peak = a + b * layers
is fitted by least squares and projected to the real layer counts (7B: 28, V2-Lite: 27, V3: 61) and to what fits
in 16 / 32 / 64 GB.

    .venv/bin/python benchmarks/build_memory.py --widths qwen-1.5b --layers 2,4,8 --json out.json
    .venv/bin/python benchmarks/build_memory.py --widths v3-real-1moe --layers 4 --contenders dstc-openvino \
        --no-checks --no-passes --no-smoke --prune

``--prune`` deletes what no later stage reads while the build runs (a stage's output once the next one has
finished; the checkpoint's safetensors once the export has, when no later stage opens them): at V3's real widths
the checkpoint (17 GB FP8), the bf16 export (30 GB) and the INT4 output (9 GB) do not fit on the disk together.

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
import time
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import optimum_intel_env  # noqa: E402
from benchmarks import harness  # noqa: E402
from toolchain.hardware import describe_cpu  # noqa: E402

DSTC = [sys.executable, "-m", "toolchain"]
WIDTHS = {  # name -> (reference model, extra shape-faithful options)
    "qwen-1.5b": ("deepseek-r1-distill-qwen-1.5b", []),
    "qwen-7b": ("deepseek-r1-distill-qwen-7b", []),
    "v3-8-experts": ("deepseek-v3", ["--experts", "8"]),
    "v3-real-1moe": ("deepseek-v3", ["--fp8"]),
}
REAL_LAYERS = {"qwen-7b": ("R1-Distill-Qwen-7B", 28), "v3-8-experts": ("DeepSeek-V3 (experts scaled)", 61),
               "qwen-1.5b": ("R1-Distill-Qwen-1.5B", 28), "v3-real-1moe": ("DeepSeek-V3", 61)}
GiB = 1 << 30
STAGES = ("export", "passes", "compress", "compile")


def tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (blocks allocated: what the disk holds)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


class StageWatch:
    """Follows a dstc build's stage cache: when each stage finishes (its stage.json appears), its output's size;
    with ``prune``, deletes what no later stage reads (module docstring)."""

    def __init__(self, cache: Path, stages: list[str], checkpoint: Path, prune: bool, checkpoint_read_later: bool):
        self.cache, self.stages, self.checkpoint = cache / "stages", stages, checkpoint
        self.prune, self.checkpoint_read_later = prune, checkpoint_read_later
        self.finished: dict[str, dict] = {}

    def poll(self, now: float) -> None:
        for stage in self.stages:
            if stage in self.finished:
                continue
            done = [d for d in self.cache.glob(f"{stage}-*") if (d / "stage.json").is_file()]
            if not done:
                continue
            self.finished[stage] = {"finished_s": now, "output_bytes": tree_bytes(done[0])}
            if not self.prune:
                continue
            index = self.stages.index(stage)
            if index:
                for d in self.cache.glob(f"{self.stages[index - 1]}-*"):
                    shutil.rmtree(d, ignore_errors=True)
            if stage == "export" and not self.checkpoint_read_later:
                for shard in self.checkpoint.glob("*.safetensors"):
                    shard.unlink()


def measure(command: list[str], env: dict, watch: StageWatch | None = None, disk: Path | None = None) -> dict:
    """Run ``command`` under /usr/bin/time -v (the largest single process), its process tree's summed RSS sampled
    by the harness (given ``watch``, which stage each sample belongs to; given ``disk``, the bytes under that
    directory once a second)."""
    samples: list[tuple[float, int, int]] = []
    disk_peak, last_disk = [0], [-1.0]

    def on_sample(now: float, rss: int, anon: int) -> None:
        samples.append((now, rss, anon))
        if watch is not None:
            watch.poll(now)
        if disk is not None and now - last_disk[0] >= 1.0:
            disk_peak[0], last_disk[0] = max(disk_peak[0], tree_bytes(disk)), now

    run = harness.run_measured(["/usr/bin/time", "-v", *command], env=env, cwd=REPO, on_sample=on_sample)
    largest = re.search(r"Maximum resident set size \(kbytes\): (\d+)", run.output)
    row = {"returncode": run.returncode, "wall_s": round(run.wall_s, 1), "tree_peak_bytes": run.peak_bytes,
           "tree_anon_peak_bytes": run.anon_peak_bytes,
           "largest_process_bytes": int(largest.group(1)) * 1024 if largest else None,
           "tail": (run.output.strip().splitlines() or [""])[-3:] if run.returncode else []}
    if disk is not None:
        row["disk_peak_bytes"] = disk_peak[0]
    if watch is not None:
        row["stages"], begin = {}, 0.0
        for stage in watch.stages:  # the samples up to each stage's end are that stage's
            end = watch.finished.get(stage, {}).get("finished_s", run.wall_s)
            row["stages"][stage] = {"peak_bytes": max((r for t, r, _ in samples if begin <= t <= end), default=0),
                                    "anon_peak_bytes": max((a for t, _, a in samples if begin <= t <= end), default=0),
                                    **{k: v for k, v in watch.finished.get(stage, {}).items()},
                                    "seconds": round(end - begin, 1)}
            begin = end
    return row


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def make_checkpoint(width: str, layers: int, work: Path) -> tuple[Path, float]:
    """The shape-faithful checkpoint and the seconds it took to write (0 when it was there already)."""
    reference, extra = WIDTHS[width]
    path = work / f"{width}-{layers}"
    started = time.perf_counter()
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):  # --prune deletes the shards
        subprocess.run([*DSTC, "models", "shape-faithful", reference, "-o", str(path), "--layers", str(layers),
                        *extra], cwd=REPO, check=True, capture_output=True)
    return path, round(time.perf_counter() - started, 1)


def dstc_build(checkpoint: Path, backend: str, out: Path, work: Path, checks: bool, passes: bool = True,
               weights: str = "auto", prune: bool = False, smoke: bool = True) -> dict:
    """The INT4 recipe for one backend; ``checks`` False leaves out the export's parity and the compile stage's
    verification (what optimum-cli does not do either); ``smoke`` False the compile stage's smoke inference (the
    artifact run at deployment defaults: the runtime's memory, not the build's); ``passes`` False the passes
    stage; ``weights``: the export's weight storage."""
    recipe = work / f"recipe-{backend}.yaml"
    stages = ["export", *(["passes"] if passes else []), "compress", "compile"]
    recipe.write_text(yaml.safe_dump({"name": "build-memory", "model": str(checkpoint),
                                      **({"passes": {"target": backend}} if passes else {}),
                                      "compress": {"scheme": "int4-grouped"},
                                      "export": {"weights": weights, **({} if checks else {"parity": []})},
                                      "compile": {"backend": backend, "verify": checks, "smoke": smoke}}))
    env = {**os.environ, "DSTC_CACHE_DIR": str(work / "cache")}
    shutil.rmtree(work / "cache", ignore_errors=True)
    # the passes stage and the compile stage's verification open the checkpoint (its size decides their checks)
    watch = StageWatch(work / "cache", stages, checkpoint, prune, checkpoint_read_later=passes or checks)
    row = measure([*DSTC, "build", str(recipe), "-o", str(out), "--no-cache"], env, watch, disk=work)
    manifest = out / "manifest.json"
    if manifest.is_file():
        export_report = json.loads(manifest.read_text())["provenance"]["stage_reports"]["export/export.json"]
        row["export_weights"] = export_report["graph"].get("weights", "float32")
        row["artifact_bytes"] = tree_bytes(out)
    return row


def optimum_build(checkpoint: Path, out: Path, work: Path) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return measure([str(optimum_intel_env.OPTIMUM_CLI), "export", "openvino", "--model",
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
    parser.add_argument("--no-passes", action="store_true", help="dstc recipes without the passes stage")
    parser.add_argument("--no-smoke", action="store_true",
                        help="dstc without the compile stage's smoke inference (running the artifact: the runtime's "
                             "memory, ~2x the artifact's weights)")
    parser.add_argument("--weights", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="the export's weight storage (recipe export.weights)")
    parser.add_argument("--prune", action="store_true",
                        help="delete what no later stage reads while a dstc build runs (disk, not memory)")
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
            for contender in contenders:
                if contender == "optimum" and not width.startswith("qwen"):
                    continue  # optimum-intel 2.1 refuses DeepSeek-V2/V3 (shared/peer-baselines.md)
                checkpoint, made_s = make_checkpoint(width, layers, work)
                sizes.setdefault(width, {})[layers] = checkpoint_bytes(checkpoint)
                out = work / "out"
                shutil.rmtree(out, ignore_errors=True)
                if contender == "optimum":
                    row = optimum_build(checkpoint, out, work)
                else:
                    row = dstc_build(checkpoint, contender.split("-", 1)[1], out, work, not args.no_checks,
                                     passes=not args.no_passes, weights=args.weights, prune=args.prune,
                                     smoke=not args.no_smoke)
                row.update(width=width, layers=layers, contender=contender, checkpoint_bytes=sizes[width][layers],
                           checkpoint_s=made_s)
                results.append(row)
                print(f"{width:>13} {layers:>2} layers {contender:<17} rc {row['returncode']}  "
                      f"{row['wall_s']:>7.1f} s  tree {row['tree_peak_bytes'] / GiB:6.2f} GiB (anonymous "
                      f"{row['tree_anon_peak_bytes'] / GiB:.2f})  largest "
                      f"{(row['largest_process_bytes'] or 0) / GiB:6.2f} GiB", flush=True)
                if "stages" in row:
                    print(f"{'':>13} checkpoint {sizes[width][layers] / 1e9:.1f} GB ({made_s:.0f} s), weights "
                          f"{row.get('export_weights')}, artifact {row.get('artifact_bytes', 0) / 1e9:.1f} GB, disk "
                          f"peak {row['disk_peak_bytes'] / 1e9:.1f} GB" + (" (pruned)" if args.prune else ""))
                    for stage, s in row["stages"].items():
                        print(f"{'':>13} {stage:<9} {s['seconds']:>7.1f} s  peak {s['peak_bytes'] / GiB:6.2f} GiB "
                              f"(anonymous {s['anon_peak_bytes'] / GiB:5.2f})  "
                              f"output {s.get('output_bytes', 0) / 1e9:6.1f} GB")
                shutil.rmtree(out, ignore_errors=True)
                shutil.rmtree(work / "cache", ignore_errors=True)
            shutil.rmtree(checkpoint, ignore_errors=True)

    print("\nFits: peak RSS (whole process tree) = a + b * layers; the same for its anonymous part (what the kernel "
          "cannot reclaim: RSS less the clean pages of memory-mapped files, harness.tree_memory)")
    fits = []
    for width, by_layers in sizes.items():
        counts = sorted(by_layers)
        layer_bytes = (by_layers[counts[-1]] - by_layers[counts[0]]) / (counts[-1] - counts[0]) if len(counts) > 1 \
            else None
        edge_bytes = by_layers[counts[0]] - counts[0] * layer_bytes if layer_bytes else None
        for contender in contenders:
            for key, kind in (("tree_peak_bytes", "rss"), ("tree_anon_peak_bytes", "anonymous")):
                points = [(r["layers"], r[key]) for r in results
                          if r["width"] == width and r["contender"] == contender and r["returncode"] == 0]
                line = fit(points)
                if line is None or layer_bytes is None:
                    continue
                a, b = line
                row = {"width": width, "contender": contender, "memory": kind, "a_bytes": a, "b_bytes": b,
                       "layer_bf16_bytes": layer_bytes, "edges_bf16_bytes": edge_bytes,
                       "slope_target_met": b <= 1.5 * layer_bytes, "intercept_target_met": a <= 2 * edge_bytes + GiB}
                name, real = REAL_LAYERS[width]
                row["projection"] = {name: a + b * real}
                row["layers_that_fit"] = {f"{gb} GB": int((gb * 1e9 - a) // b) if b > 0 else None
                                          for gb in (16, 32, 64)}
                fits.append(row)
                print(f"{width:>13} {contender:<17} {kind:<9} a {a / GiB:5.2f} GiB (target <= "
                      f"{(2 * edge_bytes + GiB) / GiB:.2f}) b {b / 2**20:7.1f} MiB/layer ({b / layer_bytes:.2f}x a "
                      f"layer's bf16, target <= 1.5x)  {name} ({real} layers): {(a + b * real) / GiB:.1f} GiB  fits "
                      f"in 16/32/64 GB: {row['layers_that_fit']['16 GB']}/{row['layers_that_fit']['32 GB']}/"
                      f"{row['layers_that_fit']['64 GB']} layers")
    head = {(r["contender"]): r for r in results if r["width"] == "qwen-1.5b" and r["layers"] == 4}
    if "optimum" in head:
        print("\nR1-Distill-Qwen-1.5B x 4 layers vs optimum-cli (same run):")
        for contender, r in head.items():
            o = head["optimum"]
            print(f"  {contender:<17} {r['wall_s']:7.1f} s ({r['wall_s'] / o['wall_s']:.2f}x)  "
                  f"{r['tree_peak_bytes'] / GiB:.2f} GiB ({r['tree_peak_bytes'] / o['tree_peak_bytes']:.2f}x)")
    if args.json:
        args.json.write_text(json.dumps({"cpu": describe_cpu(), "checks": not args.no_checks,
                                         "smoke": not args.no_smoke, "results": results,
                                         "fits": fits}, indent=1))


if __name__ == "__main__":
    main()
