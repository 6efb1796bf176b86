"""`dstc eval` at real size: peak RSS of the whole process tree and wall time of a first eval (the reference
computed layer by layer) and of later ones against the cached reference (the same artifact again, and another
artifact of the same checkpoint, e.g. the other backend's), with the figures each gave.

    .venv/bin/python benchmarks/eval_memory.py ART [ART2 ...] --dataset FILE [--window 2048 --windows 64]
        [--work DIR] [--json OUT]

The first eval runs with an empty reference cache under --work (the stage cache is not touched); every eval runs
as `dstc eval --no-latency` in a child process sampled every 50 ms (benchmarks/build_memory.py's sampler).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from build_memory import measure  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


def run_eval(artifact: Path, args, env: dict, out: Path, extra: list[str]) -> dict:
    command = [sys.executable, "-m", "toolchain", "eval", str(artifact), "--no-latency", "--json",
               "--dataset", str(args.dataset), "--window", str(args.window), "--windows", str(args.windows),
               "--texts", str(args.texts), "--greedy-prompts", str(args.greedy_prompts), "-o", str(out), *extra]
    row = measure(command, env)
    report = json.loads((out / "report.json").read_text()) if row["returncode"] == 0 else {}
    row["metrics"] = {k: v["value"] for k, v in report.get("metrics", {}).items()}
    row["reference_cache"] = report.get("reference", {}).get("cache")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--dataset", type=Path, required=True)
    parser.add_argument("--window", type=int, default=2048)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--texts", type=int, default=200)
    parser.add_argument("--greedy-prompts", type=int, default=32)
    parser.add_argument("--skip-uncached", action="store_true",
                        help="no third eval with --no-reference-cache (it runs the reference again)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/dstc-eval-memory"))
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    cache = args.work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True)
    # the stage cache stays where it is; only the reference cache starts empty
    env = {**os.environ, "DSTC_CACHE_DIR": str(cache)}
    rows = []
    plan = [(args.artifacts[0], "first (reference computed)", []),
            (args.artifacts[0], "same artifact, cached reference", [])]
    if not args.skip_uncached:
        plan.append((args.artifacts[0], "same artifact, --no-reference-cache", ["--no-reference-cache"]))
    plan += [(a, "other artifact, cached reference", []) for a in args.artifacts[1:]]
    for n, (artifact, what, extra) in enumerate(plan):
        row = run_eval(artifact, args, env, args.work / f"report-{n}", extra)
        row.update(artifact=str(artifact), case=what)
        rows.append(row)
        print(f"{what:40s} {artifact.name:30s} rc {row['returncode']} {row['wall_s']:8.1f} s "
              f"peak {row['tree_peak_bytes'] / GIB:6.2f} GiB (anon {row['tree_anon_peak_bytes'] / GIB:5.2f}) "
              f"kl_mean {row['metrics'].get('kl_mean')} top1 {row['metrics'].get('top1_agreement')}", flush=True)
    first, cached = rows[0], rows[1]
    if first["returncode"] == 0 and cached["returncode"] == 0:
        print(f"cached / first wall: {first['wall_s'] / cached['wall_s']:.2f}x faster")
        uncached = next((r for r in rows if "--no-reference-cache" in r["case"]), None)
        if uncached and uncached["returncode"] == 0:
            print(f"kl_mean cached - uncached: {abs(cached['metrics']['kl_mean'] - uncached['metrics']['kl_mean']):.3g}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
