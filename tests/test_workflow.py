"""docs/github-actions-release-gate.yml works as written: its structure (timeouts, caches saved whatever the gates
said, the summary written after a failure, the comparison run after a failed gate, a pinned dstc with torch from
PyTorch's CPU index) and its shell steps, each `run:` block run in order as GitHub's runner would (bash, the
workflow's, job's and step's env, ``${{ }}`` substituted, `if:` honoured after a failed step) in a directory laid out
as a user's repository (recipes, baselines), on the two DeepSeek-V3 recipes the comparison needs. The `uses:` steps
are played by the test (caches, uploads and downloads as directories); installing dstc is replaced by this
checkout's dstc (tests/test_wheel.py installs it from a wheel). One baseline is made better than what the build
reaches, so that its gate fails (exit 1) and the steps after it must still run."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from toolchain.hashing import self_digest

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / "docs" / "github-actions-release-gate.yml"
RECIPES = ("deepseek-v3-tiny-openvino-int4", "deepseek-v3-tiny-onnxruntime-int4")
FAILING = "deepseek-v3-tiny-onnxruntime-int4"  # gated against a baseline it cannot reach
RUN_JOBS = ("build-and-gate", "compare-backends")  # real-model-gate needs a self-hosted runner with a real model
INSTALL = "Install dstc"


@pytest.fixture(scope="module")
def workflow() -> dict:
    return yaml.safe_load(WORKFLOW.read_text())


def _steps(workflow: dict):
    for job_name, job in workflow["jobs"].items():
        for step in job["steps"]:
            yield job_name, step


def test_every_job_and_install_has_a_time_limit(workflow):
    for name, job in workflow["jobs"].items():
        assert isinstance(job.get("timeout-minutes"), int), name
    installs = [step for _, step in _steps(workflow) if step.get("name") == INSTALL]
    assert len(installs) == len(workflow["jobs"])
    assert all(isinstance(step.get("timeout-minutes"), int) for step in installs)


def test_dstc_is_pinned_with_the_build_extra_and_torch_from_the_cpu_index(workflow):
    assert re.fullmatch(r"\d+\.\d+\.\d+", workflow["env"]["DSTC_VERSION"])
    assert workflow["env"]["TORCH_INDEX_URL"] == "https://download.pytorch.org/whl/cpu"
    for _, step in _steps(workflow):
        if step.get("name") == INSTALL:
            assert '"dstc[build]==$DSTC_VERSION"' in step["run"]
            assert '--extra-index-url "$TORCH_INDEX_URL"' in step["run"]
    text = WORKFLOW.read_text()
    assert "install.sh" not in text and "optimum-intel" not in re.sub(r"#.*", "", text)


def test_pip_is_cached_and_the_dstc_caches_are_saved_whatever_the_gates_said(workflow):
    for job_name, job in workflow["jobs"].items():
        uses = [step.get("uses", "") for step in job["steps"]]
        assert not any(u.startswith("actions/cache@") for u in uses), "actions/cache saves on success only"
        setup = next(step for step in job["steps"] if step.get("uses", "").startswith("actions/setup-python@"))
        assert setup["with"]["cache"] == "pip", job_name
        assert uses.index(setup["uses"]) > uses.index("actions/checkout@v4"), "the cache key's file is checked out"
        restores = {step["id"]: step for step in job["steps"]
                    if step.get("uses", "").startswith("actions/cache/restore@")}
        saves = [step for step in job["steps"] if step.get("uses", "").startswith("actions/cache/save@")]
        assert len(saves) == len(restores)
        for save in saves:
            assert save["if"].startswith("always()"), save
            (restore_id,) = re.findall(r"steps\.(\w+)\.outputs\.cache-primary-key", save["with"]["key"])
            assert save["with"]["path"] == restores[restore_id]["with"]["path"]
    paths = {s["with"]["path"] for _, s in _steps(workflow) if s.get("uses", "").startswith("actions/cache/save@")}
    assert paths == {".dstc-cache/references", ".dstc-cache/stages"}


def test_summaries_uploads_and_the_comparison_run_after_a_failure(workflow):
    compare = workflow["jobs"]["compare-backends"]
    assert compare["needs"] == "build-and-gate" and compare["if"] == "always()"
    for job_name, step in _steps(workflow):
        writes_summary = "GITHUB_STEP_SUMMARY" in step.get("run", "")
        if writes_summary or step.get("uses", "").startswith("actions/upload-artifact@"):
            assert step.get("if") == "always()", (job_name, step)
    for name, job in workflow["jobs"].items():
        assert any("GITHUB_STEP_SUMMARY" in step.get("run", "") for step in job["steps"]), name


# -- running it -----------------------------------------------------------------------------------------------------


class Runner:
    """GitHub's runner, as far as this workflow uses it."""

    def __init__(self, workflow: dict, root: Path, repo: Path) -> None:
        self.workflow, self.root, self.repo = workflow, root, repo
        self.caches: dict[str, Path] = {}
        self.uploads = root / "uploads"
        self.bin = root / "bin"
        self.bin.mkdir()
        shim = self.bin / "dstc"  # this checkout's dstc in place of the pinned install
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m toolchain "$@"\n')
        shim.chmod(0o755)

    def run_job(self, name: str, matrix: dict, workspace: Path) -> dict:
        """Runs one job (one matrix entry) in ``workspace`` (a fresh checkout); its steps' exit codes by name, and
        the job's summary."""
        job = self.workflow["jobs"][name]
        shutil.copytree(self.repo, workspace)
        context = {"matrix": matrix, "github": {"workspace": str(workspace)}, "steps": {}, "env": {}}
        env = {**os.environ, "PATH": f"{self.bin}:{os.environ['PATH']}",
               "PYTHONPATH": str(ROOT), "GITHUB_WORKSPACE": str(workspace)}
        for key, value in {**self.workflow.get("env", {}), **job.get("env", {})}.items():
            env[key] = context["env"][key] = self.expand(str(value), context, workspace)
        summary = workspace.parent / f"{workspace.name}-summary.md"
        summary.touch()
        env["GITHUB_STEP_SUMMARY"] = str(summary)
        failed = False
        codes: dict[str, int | None] = {}
        for index, step in enumerate(job["steps"]):
            label = step.get("name") or step.get("uses") or str(index)
            if failed and "always()" not in step.get("if", ""):
                codes[label] = None  # skipped
                continue
            if "uses" in step:
                code = self.use(step, context, workspace)
            elif step.get("name") == INSTALL:
                code = 0  # replaced by the shim
            else:
                code = self.shell(step, context, env, workspace)
            codes[label] = code
            failed = failed or code != 0
        return {"codes": codes, "summary": summary.read_text()}

    def shell(self, step: dict, context: dict, env: dict, workspace: Path) -> int:
        script = self.expand(step["run"], context, workspace)
        step_env = {**env, **{k: self.expand(str(v), context, workspace) for k, v in step.get("env", {}).items()}}
        # GitHub's bash: `bash -e {0}` by default, `bash --noprofile --norc -eo pipefail {0}` with shell: bash
        flags = ["--noprofile", "--norc", "-eo", "pipefail"] if step.get("shell") == "bash" else ["-e"]
        assert step.get("shell", "bash") == "bash"
        script_file = workspace.parent / f"{workspace.name}-step.sh"
        script_file.write_text(script)
        done = subprocess.run(["bash", *flags, str(script_file)], cwd=workspace, env=step_env, text=True,
                              capture_output=True, timeout=600, stdin=subprocess.DEVNULL)
        step["_log"] = done.stdout + done.stderr
        return done.returncode

    def use(self, step: dict, context: dict, workspace: Path) -> int:
        action = step["uses"].split("@")[0]
        given = {k: self.expand(str(v), context, workspace) for k, v in step.get("with", {}).items()}
        if action in ("actions/checkout", "actions/setup-python"):
            return 0
        if action == "actions/cache/restore":
            hit = given["key"] in self.caches
            prefixes = [p for p in map(str.strip, given.get("restore-keys", "").splitlines()) if p]
            found = given["key"] if hit else next((k for p in prefixes for k in self.caches if k.startswith(p)), None)
            if found:
                shutil.copytree(self.caches[found], workspace / given["path"], dirs_exist_ok=True)
            context["steps"][step["id"]] = {"outputs": {"cache-hit": str(hit).lower(),
                                                        "cache-primary-key": given["key"]}}
            return 0
        if action == "actions/cache/save":
            assert given["key"], "a cache saved without a key"
            stored = self.root / "caches" / hashlib.sha256(given["key"].encode()).hexdigest()
            if (workspace / given["path"]).is_dir():
                shutil.copytree(workspace / given["path"], stored)
                self.caches[given["key"]] = stored
            return 0
        if action == "actions/upload-artifact":
            target = self.uploads / given["name"]
            for line in filter(None, map(str.strip, given["path"].splitlines())):
                for found in workspace.glob(line.rstrip("/")):
                    destination = target / found.relative_to(workspace)
                    if found.is_dir():
                        shutil.copytree(found, destination)
                    else:
                        destination.parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy(found, destination)
            return 0
        if action == "actions/download-artifact":
            shutil.copytree(self.uploads, workspace / given["path"], dirs_exist_ok=True)
            return 0
        raise AssertionError(f"the test does not know the action {step['uses']}")

    def expand(self, text: str, context: dict, workspace: Path) -> str:
        def value(match: re.Match) -> str:
            expression = match.group(1).strip()
            hashed = re.fullmatch(r"hashFiles\('([^']+)'\)", expression)
            if hashed:
                digest = hashlib.sha256()
                for path in sorted(workspace.glob(hashed.group(1))):
                    if path.is_file():
                        digest.update(path.read_bytes())
                return digest.hexdigest()
            found = context
            for part in expression.split("."):
                assert isinstance(found, dict) and part in found, f"unknown expression: {expression}"
                found = found[part]
            return str(found)

        return re.sub(r"\$\{\{(.+?)\}\}", value, text)


# The user's recipes under the workflow's names: the shipped ones, evaluated on a small sample (the eval of the
# shipped settings takes minutes), without the export's PyTorch parity check and GPTQ
SMALL_EVAL = {"texts": 16, "problems": 8, "greedy_prompts": 2, "greedy_tokens": 4, "prompt_lengths": [16],
              "batches": [1], "new_tokens": 4, "warmup": 0, "repetitions": 2}


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> dict:
    """A user's repository: the two recipes, their data, and baselines from an earlier build of them (whose stage
    cache a previous run of the workflow saved); one baseline out of reach."""
    root = tmp_path_factory.mktemp("user")
    repo = root / "repo"
    (repo / "baselines").mkdir(parents=True)
    shutil.copytree(ROOT / "recipes" / "data", repo / "recipes" / "data")
    (repo / ".github" / "workflows").mkdir(parents=True)
    shutil.copy(WORKFLOW, repo / ".github" / "workflows" / "release-gate.yml")
    earlier = root / "earlier-cache"
    for recipe in RECIPES:
        data = yaml.safe_load((ROOT / "recipes" / f"{recipe}.yaml").read_text())
        data.update(eval=SMALL_EVAL, export={**data.get("export", {}), "parity": []})
        data["compress"].pop("gptq", None)  # round-to-nearest: GPTQ's calibration takes minutes on a loaded machine
        (repo / "recipes" / f"{recipe}.yaml").write_text(yaml.safe_dump(data))
        built = subprocess.run([sys.executable, "-m", "toolchain", "build", repo / "recipes" / f"{recipe}.yaml",
                                "-o", root / recipe], env={**os.environ, "DSTC_CACHE_DIR": str(earlier)},
                               cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert built.returncode == 0, built.stderr[-5000:]
        baseline = json.loads((root / recipe / "report.json").read_text())
        if recipe == FAILING:  # a perplexity this build cannot reach: its gate fails, the steps after it run
            baseline["metrics"]["perplexity"]["value"] /= 2
            baseline["digest"] = self_digest(baseline)
        (repo / "baselines" / f"{recipe}.json").write_text(json.dumps(baseline, indent=2))
    return {"repo": repo, "stages": earlier / "stages"}


@pytest.fixture(scope="module")
def ran(workflow, repo, tmp_path_factory) -> dict:
    """The build-and-gate job of both recipes, then the compare-backends job."""
    matrix = workflow["jobs"]["build-and-gate"]["strategy"]["matrix"]["recipe"]
    assert set(RECIPES) <= set(matrix)
    root = tmp_path_factory.mktemp("runner")
    runner = Runner(workflow, root, repo["repo"])
    version = workflow["env"]["DSTC_VERSION"]
    for recipe in RECIPES:  # the stage cache of an earlier commit's run, found by restore-keys
        runner.caches[f"dstc-stages-{version}-{recipe}-earlier"] = repo["stages"]
    builds = {recipe: runner.run_job("build-and-gate", {"recipe": recipe}, root / f"job-{recipe}")
              for recipe in RECIPES}
    return {"runner": runner, "root": root, "builds": builds}


def _logs(workflow: dict) -> str:
    return "\n".join(step.get("_log", "")[-3000:] for job in RUN_JOBS for step in workflow["jobs"][job]["steps"])


@pytest.mark.timeout(1500)  # four builds of the tiny model (two cold), each with a small evaluation
def test_the_build_and_gate_job_runs_as_written_and_writes_its_summary_after_a_failed_gate(workflow, ran):
    builds, runner, root = ran["builds"], ran["runner"], ran["root"]
    passing = builds[RECIPES[0]]
    assert set(passing["codes"].values()) == {0}, (passing["codes"], _logs(workflow))
    failing = builds[FAILING]
    assert failing["codes"]["Build"] == 0, _logs(workflow)
    assert failing["codes"]["Gate against the baseline"] == 1, _logs(workflow)  # the gate's own code, through tee
    after = list(failing["codes"])[list(failing["codes"]).index("Gate against the baseline") + 1:]
    assert all(failing["codes"][name] == 0 for name in after), failing["codes"]  # summary, caches, upload
    saved = [key for key in runner.caches if not key.endswith("-earlier")]
    assert len(saved) == 4, saved  # references and stages of both recipes, the failed one's too
    for recipe, job in builds.items():
        summary = job["summary"]
        assert summary.startswith(f"## {recipe}\n### Gates against baselines/{recipe}.json\n```\n")
        report_md = (root / f"job-{recipe}" / "artifacts" / recipe / "report.md").read_text()
        assert report_md.strip() and report_md in summary
        assert (runner.uploads / recipe / "artifacts" / recipe / "manifest.json").is_file()
    assert re.search(r"max_perplexity_increase\s+\S+\s+0\.02\s+pass", passing["summary"])
    assert re.search(r"max_perplexity_increase\s+\S+\s+0\.02\s+FAIL", failing["summary"])


@pytest.mark.slow
def test_the_compare_job_runs_after_a_failed_gate(workflow, ran):
    """Slow: `dstc compare` as the workflow writes it evaluates both artifacts at its defaults (minutes)."""
    runner, root = ran["runner"], ran["root"]
    compare = runner.run_job("compare-backends", {}, root / "job-compare")
    assert set(compare["codes"].values()) == {0}, (compare["codes"], _logs(workflow))
    assert compare["summary"].startswith("## ONNX Runtime vs OpenVINO")
    assert "no comparison" not in compare["summary"]
    assert (runner.uploads / "compare" / "compare.html").is_file()
