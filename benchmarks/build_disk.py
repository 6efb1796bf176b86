"""The most disk a streamed INT4 build holds at once, against the checkpoint and the artifact it ends with.

One `dstc build` of an INT4 recipe (no passes stage, no parity or verification: what a streamed build of a real
checkpoint runs) on a given checkpoint, under a sampler that once a second adds up the bytes allocated under the
checkpoint's directory, the stage cache (a fresh ``DSTC_CACHE_DIR`` under ``--work``) and the output's parent (the
artifact is assembled beside it), and sums the resident set of the build's whole process tree every 50 ms
(benchmarks/harness.py). The target of issue #25: peak <= 1.25 x (checkpoint + artifact).

    .venv/bin/python benchmarks/build_disk.py --checkpoint DIR --work SCRATCH [--no-keep-stages] [--json out.json]
    .venv/bin/python benchmarks/build_disk.py ... --source OTHER_CHECKOUT   # another commit's dstc, for before/after

``--source`` runs the dstc of another checkout (started in its directory) with this one's environment.
The stage cache and the artifact are deleted after the measurement unless ``--keep``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks import harness  # noqa: E402
from benchmarks.build_memory import tree_bytes  # noqa: E402

DSTC = [sys.executable, "-m", "toolchain"]


def recipe(checkpoint: Path, backend: str) -> dict:
    """The shipped INT4 recipes' compression (asymmetric, group 128, embeddings and lm_head INT8) without passes,
    parity, verification or smoke run."""
    return {"name": "build-disk", "model": str(checkpoint), "export": {"parity": []},
            "compress": {"scheme": "int4-grouped", "group_size": 128, "sym": False, "backup": "int8"},
            "compile": {"backend": backend, "verify": False, "smoke": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True, help="Scratch: the stage cache, the artifact, logs.")
    parser.add_argument("--backend", default="onnxruntime", choices=["onnxruntime", "openvino"])
    parser.add_argument("--no-keep-stages", action="store_true", help="dstc build --no-keep-stages")
    parser.add_argument("--source", type=Path, default=None, help="Run the dstc of this checkout instead.")
    parser.add_argument("--label", default="build")
    parser.add_argument("--keep", action="store_true", help="Keep the stage cache and the artifact.")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    work = args.work.resolve()
    cache, out = work / f"{args.label}-cache", work / f"{args.label}-out" / "artifact"
    for path in (cache, out.parent):
        shutil.rmtree(path, ignore_errors=True)
    out.parent.mkdir(parents=True)
    recipe_path = work / f"{args.label}-recipe.yaml"
    recipe_path.write_text(yaml.safe_dump(recipe(args.checkpoint.resolve(), args.backend)))
    env = {"DSTC_CACHE_DIR": str(cache)}
    checkpoint_bytes = tree_bytes(args.checkpoint)
    samples: list[dict] = []
    last = [-1.0]

    def on_sample(now: float, rss: int, anon: int) -> None:
        if now - last[0] >= 1.0:
            last[0] = now
            samples.append({"s": round(now, 1), "checkpoint": tree_bytes(args.checkpoint), "cache": tree_bytes(cache),
                            "output": tree_bytes(out.parent), "rss": rss})

    command = [*DSTC, "build", str(recipe_path), "-o", str(out), *(["--no-keep-stages"] if args.no_keep_stages
                                                                     else [])]
    log = work / f"{args.label}.log"
    started = time.time()
    # `python -m` puts its working directory first on sys.path: the checkout run is the one it starts in
    run = harness.run_measured(command, env=env, cwd=args.source or REPO, log=log, on_sample=on_sample)
    if run.returncode:
        sys.exit(f"build failed (exit {run.returncode}): {log.read_text()[-2000:]}")
    artifact_bytes = tree_bytes(out)
    peak = max(samples, key=lambda s: s["checkpoint"] + s["cache"] + s["output"])
    peak_bytes = peak["checkpoint"] + peak["cache"] + peak["output"]
    manifest = json.loads((out / "manifest.json").read_text())
    row = {"label": args.label, "checkpoint": str(args.checkpoint), "backend": args.backend,
           "no_keep_stages": args.no_keep_stages, "source": str(args.source or REPO), "started": started,
           "wall_s": run.wall_s, "tree_peak_rss_bytes": run.peak_bytes, "tree_anon_peak_bytes": run.anon_peak_bytes,
           "checkpoint_bytes": checkpoint_bytes, "artifact_bytes": artifact_bytes, "disk_peak_bytes": peak_bytes,
           "disk_peak_at": peak, "cache_peak_bytes": max(s["cache"] for s in samples),
           "ratio": peak_bytes / (checkpoint_bytes + artifact_bytes), "files": manifest["files"],
           "samples": samples}
    print(f"{args.label}: {run.wall_s:.0f} s, checkpoint {checkpoint_bytes / 1e9:.2f} GB, artifact "
          f"{artifact_bytes / 1e9:.2f} GB, disk peak {peak_bytes / 1e9:.2f} GB at {peak['s']:.0f} s (cache "
          f"{peak['cache'] / 1e9:.2f}, output {peak['output'] / 1e9:.2f}) = {row['ratio']:.3f} x (checkpoint + "
          f"artifact) (target <= 1.25), peak RSS {run.peak_bytes / 2**30:.2f} GiB (anonymous "
          f"{run.anon_peak_bytes / 2**30:.2f})")
    if args.json:
        args.json.write_text(json.dumps(row, indent=1))
    if not args.keep:
        for path in (cache, out.parent):
            shutil.rmtree(path, ignore_errors=True)


if __name__ == "__main__":
    main()
