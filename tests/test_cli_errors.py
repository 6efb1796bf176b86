"""The command-line cases of issue #22: hostile or unlucky input to every command but `serve` gets one line and the
documented exit code, or the right result; nothing is lost and no traceback is printed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import run_cli as _run
from cli_helpers import assert_one_line_error, run_cli

from toolchain.atomic import MARKER
from toolchain.report.schema import load_report

REPO = Path(__file__).resolve().parent.parent
BACKENDS = ("onnxruntime", "openvino")


def build_tiny(root: Path, backend: str) -> Path:
    """r1-distill-qwen-tiny in INT4 for ``backend``, quickly (no parity, no verification), into ``root``."""
    import yaml

    from toolchain.build import build

    recipe = root / f"{backend}.yaml"
    recipe.write_text(yaml.safe_dump({"name": f"tiny-{backend}", "model": "r1-distill-qwen-tiny",
                                      "export": {"parity": []}, "compress": {"scheme": "int4-grouped"},
                                      "compile": {"backend": backend, "verify": False}}))
    build(recipe, root / backend)
    return root / backend


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, stage_cache):
    """{backend: artifact}; the stage cache is the session's, so that another module builds them again from it."""
    root = tmp_path_factory.mktemp("artifacts")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(stage_cache))
        yield {backend: build_tiny(root, backend) for backend in BACKENDS}

# -- 11. processes hammering one output ------------------------------------------------------------------------------

# A writer of the output: ``writes`` replacements of it, each outcome printed as one JSON line. A busy machine pauses
# a process anywhere: here every look at a file's metadata or a directory's entries waits up to 1 ms, and the rename
# that moves the old output aside is followed by 2 ms, the instant when the output does not exist, which another
# writer's checks must take in their stride.
_HAMMER = """
import json, os, random, sys, time
from pathlib import Path

import toolchain.atomic as atomic
from toolchain.errors import InputError

target, writes, wait, name = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "wait", sys.argv[4]
rename, stat, listdir = Path.rename, os.stat, os.listdir


def slow_rename(self, to):
    moved = rename(self, to)
    if ".old-" in str(to):
        time.sleep(0.002)
    return moved


def slow(call):
    def paused(*args, **kwargs):
        time.sleep(random.random() / 1000)
        return call(*args, **kwargs)
    return paused


Path.rename, os.stat, os.listdir = slow_rename, slow(stat), slow(listdir)
for i in range(writes):
    try:
        with atomic.atomic_output_dir(target, wait=wait) as tmp:
            (tmp / "data").write_text(f"{name} {i}")
        outcome = "written"
    except InputError as e:
        outcome = "busy" if "is being written by another dstc process" in str(e) else f"InputError: {e}"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    print(json.dumps(outcome), flush=True)
"""


def _hammer(tmp_path: Path, *, writers: int, writes: int, wait: bool) -> list[str]:
    target = tmp_path / "out"
    children = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(_HAMMER), str(target), str(writes),
                                  "wait" if wait else "fail", f"w{n}"], cwd=REPO, stdout=subprocess.PIPE, text=True)
                for n in range(writers)]
    outcomes = []
    for child in children:
        out, _ = child.communicate(timeout=240)
        assert child.returncode == 0
        outcomes += [json.loads(line) for line in out.splitlines()]
    assert len(outcomes) == writers * writes
    # the output is whole and dstc's, and nothing else is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert sorted(p.name for p in target.iterdir()) == sorted(["data", MARKER])
    return outcomes


def test_writers_of_one_output_that_wait_all_succeed(tmp_path):
    outcomes = _hammer(tmp_path, writers=3, writes=150, wait=True)
    assert [o for o in outcomes if o != "written"] == []


def test_writers_of_one_output_that_do_not_wait_either_write_or_are_told_it_is_busy(tmp_path):
    outcomes = _hammer(tmp_path, writers=3, writes=300, wait=False)
    assert [o for o in outcomes if o not in ("written", "busy")] == []
    assert outcomes.count("written") >= 3


# -- 9. an unwritable stage cache is named as such, not as the output ----------------------------------------------


def _read_only(directory: Path) -> list[str] | None:
    """A command prefix that runs the rest with ``directory`` mounted read-only in a private mount namespace (gone
    with the process: nothing to undo), or None where this process may not make one."""
    prefix = ["unshare", "--mount", "sh", "-c", f'mount --bind -o ro "{directory}" "{directory}" && exec "$@"', "-"]
    try:
        probe = subprocess.run([*prefix, "touch", str(directory / "probe")], capture_output=True, text=True,
                               timeout=30)
    except FileNotFoundError:
        return None
    return prefix if "Read-only file system" in probe.stderr else None


def _dstc(*args, env: dict | None = None, prefix: list[str] | None = None) -> tuple[int, str]:
    """``dstc ARGS`` in a child process: (exit code, stderr)."""
    proc = subprocess.run([*(prefix or []), sys.executable, "-m", "toolchain", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return proc.returncode, proc.stderr


@pytest.mark.parametrize("cache", ["read-only mount", "/proc", "a file"])
def test_an_unwritable_stage_cache_is_named_with_the_way_out(tmp_path, cache):
    prefix = None
    if cache == "read-only mount":
        root = tmp_path / "ro-cache"
        root.mkdir()
        prefix = _read_only(root)
        if prefix is None:
            pytest.skip("no private read-only mount here (unshare and mount need CAP_SYS_ADMIN)")
        fragment = f"cannot write the stage cache {root}: {root / 'stages'} is on a read-only file system"
    elif cache == "/proc":
        root = Path("/proc/dstc-cache")
        fragment = f"cannot write the stage cache {root}: {root / 'stages'} is not a regular directory (proc file"
    else:
        root = tmp_path / "cache-file"
        root.write_text("not a directory")
        fragment = f"cannot write the stage cache {root}: {root / 'stages'} is not a directory"
    out = tmp_path / "out"
    commands = [["export", "r1-distill-qwen-tiny", "-o", out, "--parity", "none"]]
    if cache == "read-only mount":  # where `dstc build` named its (writable) output instead
        commands.append(["build", REPO / "recipes/deepseek-v3-tiny-onnxruntime-int4.yaml", "-o", out])
    for args in commands:
        code, err = _dstc(*args, env={"DSTC_CACHE_DIR": str(root)}, prefix=prefix)
        assert_one_line_error(code, err, fragment)
        assert err.rstrip().endswith("set DSTC_CACHE_DIR to a writable directory")
        assert str(out) not in err
        assert not out.exists()


# -- 13. an output where no file can be created: the reason is the directory, not a missing file -------------------


def test_compare_html_and_eval_out_in_proc_name_the_real_problem(monkeypatch, capsys, tmp_path):
    artifact = tmp_path / "missing-artifact"  # the output is checked first, before the artifacts are read
    code, err = run_cli(monkeypatch, capsys, "compare", artifact, artifact, "--html", "/proc/x")
    assert_one_line_error(code, err, "cannot write /proc/x: /proc is not a regular directory (proc file system): "
                                     "no file can be created in it")
    assert "No such file or directory" not in err
    code, err = run_cli(monkeypatch, capsys, "eval", artifact, "-o", "/proc/dstc/report")
    assert_one_line_error(code, err, "cannot write to /proc/dstc/report: /proc is not a regular directory")


# -- 8. a gate limit that is not a finite number is bad input (exit 2), not a failed gate (exit 1) -----------------

BASELINE = REPO / "baselines/deepseek-v3-tiny-onnxruntime-int4.json"
GATE_OPTIONS = ["--max-perplexity-increase", "--min-top1-agreement", "--max-exact-match-drop", "--max-kl-mean",
                "--max-latency-ratio"]


@pytest.mark.parametrize("value", ["nan", "NaN", "inf", "-inf", "1e999"])
@pytest.mark.parametrize("option", GATE_OPTIONS)
def test_a_gate_limit_that_is_not_finite_is_exit_2(monkeypatch, capsys, option, value):
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", BASELINE, option, value)
    assert_one_line_error(code, err, f"Invalid value for '{option}'")
    assert "finite" in err or "is not in the range" in err


@pytest.mark.parametrize("value", [".nan", ".inf"])
def test_a_recipe_gate_that_is_not_finite_is_exit_2_before_the_build(monkeypatch, capsys, tmp_path, value):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: r1-distill-qwen-tiny\ncompile: {{backend: onnxruntime}}\n"
                      f"gates: {{max_kl_mean: {value}}}\n")
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "gates.max_kl_mean: Input should be")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


def test_finite_gate_limits_still_gate(monkeypatch, capsys):
    # the baseline against itself: the ratio's interval runs from low/high to high/low of its own medians'
    # intervals, so a limit above its widest spread passes, and one below it cannot tell (exit 2)
    metrics = load_report(BASELINE).metrics
    spread = max(metrics[k].interval.high / metrics[k].interval.low for k in ("ttft_p50_ms", "itl_p50_ms"))
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", BASELINE, "--max-kl-mean", "1e-3",
                        "--max-latency-ratio", f"{spread * 1.01:.6g}")
    assert code == 0, err
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", BASELINE, "--max-latency-ratio",
                        f"{spread * 0.99:.6g}")
    assert_one_line_error(code, err, "cannot tell")
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--max-kl-mean", "0")
    assert code == 1, err


# -- 12. a baseline of another model is refused unless that is said to be meant ------------------------------------

OTHER_BASELINE = REPO / "baselines/r1-distill-qwen-tiny-onnxruntime-int4.json"


def test_gate_refuses_a_baseline_of_another_model(monkeypatch, capsys):
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", OTHER_BASELINE,
                        "--max-perplexity-increase", "0.5")
    assert_one_line_error(code, err, "the baseline is a report of r1-distill-qwen-tiny and the report gated is of "
                                     "deepseek-v3-tiny")
    assert "--allow-other-model" in err
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", OTHER_BASELINE,
                        "--max-perplexity-increase", "0.5", "--allow-other-model")
    assert code == 0, err
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, "--baseline", BASELINE, "--max-perplexity-increase",
                        "0.5")
    assert code == 0, err


# -- one name per option: dstc gate's options are the recipe's gates: keys; the former short names still work --------

@pytest.mark.parametrize(("former", "current"), [("--max-kl", "--max-kl-mean"), ("--min-top1", "--min-top1-agreement"),
                                                 ("--max-ppl-increase", "--max-perplexity-increase"),
                                                 ("--max-em-drop", "--max-exact-match-drop")])
def test_a_gate_option_by_its_former_name_still_gates_and_names_the_current_one(monkeypatch, capsys, former, current):
    fails = {"--max-kl": "0", "--min-top1": "1", "--max-ppl-increase": "-1e-9", "--max-em-drop": "0"}
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, former, "1e9" if former != "--min-top1" else "0")
    assert code == 0, err
    assert f"dstc: warning: {former} is now {current}" in err
    if former in ("--max-kl", "--min-top1"):  # the baseline's KL > 0 and top-1 < 1: the same limit fails
        code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, former, fails[former])
        assert code == 1, err
    code, err = run_cli(monkeypatch, capsys, "gate", BASELINE, former, "1", current, "1")
    assert_one_line_error(code, err, f"{current} given twice")
    help_text = _run(monkeypatch, capsys, "gate", "--help")[1]
    assert current in help_text and f"{former} " not in help_text


def test_generate_takes_new_tokens_as_eval_and_export_do_and_its_former_name_with_a_warning(monkeypatch, capsys,
                                                                                             artifacts):
    from toolchain.cli import cli

    for command in ("generate", "eval", "export"):
        options = {o for p in cli.commands[command].params if not getattr(p, "hidden", False) for o in p.opts}
        assert "--new-tokens" in options and "--max-new-tokens" not in options, command
    code, out, err = _run(monkeypatch, capsys, "generate", artifacts["onnxruntime"], "321+654=", "--raw",
                          "--max-new-tokens", "2", "--json")
    assert code == 0, err
    assert "dstc: warning: --max-new-tokens is now --new-tokens" in err
    assert len(json.loads(out)["tokens"]) == 2
    code, err = run_cli(monkeypatch, capsys, "generate", artifacts["onnxruntime"], "1+2=", "--max-new-tokens", "2",
                        "--new-tokens", "3")
    assert_one_line_error(code, err, "--new-tokens given twice")


def test_a_recipe_gated_against_another_models_baseline_is_refused_before_the_build(monkeypatch, capsys, tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"name: r\nmodel: r1-distill-qwen-tiny\ncompile: {{backend: onnxruntime}}\n"
                      f"gates: {{baseline: {BASELINE}, max_perplexity_increase: 0.5}}\n")
    code, err = run_cli(monkeypatch, capsys, "build", recipe, "-o", tmp_path / "out")
    assert_one_line_error(code, err, "the baseline is a report of deepseek-v3-tiny and the report gated is of "
                                     "r1-distill-qwen-tiny")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]


# -- 14. one parameter count everywhere -----------------------------------------------------------------------------


def _documented_parameters() -> dict[str, int]:
    rows = {}
    for line in (REPO / "docs" / "models.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 4 and cells[0].endswith("-tiny") and cells[1].replace(",", "").isdigit():
            rows[cells[0]] = int(cells[1].replace(",", ""))
    return rows


def test_models_list_training_json_readme_and_export_give_one_parameter_count(monkeypatch, capsys, tmp_path):
    import math
    import struct

    from toolchain.models.registry import EMBEDDED, embedded_path

    code, out, err = _run(monkeypatch, capsys, "models", "list", "--json")
    assert code == 0, err
    listed = {row["name"]: row["parameters"] for row in json.loads(out) if row["kind"] == "embedded"}
    trained = {name: json.loads((embedded_path(name) / "training.json").read_text())["parameters"]
               for name in EMBEDDED}
    assert listed == trained == _documented_parameters()
    assert listed["deepseek-v3-tiny"] == 1_241_248
    # the checkpoint holds 32 values more: the routers' e_score_correction_bias buffers (16 experts, 2 MoE layers);
    # and its MTP layer (layer 3, counted apart in training.json, with its router's 16)
    with (embedded_path("deepseek-v3-tiny") / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    stored = {k: math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__"}
    mtp = {k: n for k, n in stored.items() if k.startswith("model.layers.3.")}
    stored = {k: n for k, n in stored.items() if k not in mtp}
    buffers = {k: n for k, n in stored.items() if k.endswith("e_score_correction_bias")}
    assert sum(stored.values()) - sum(buffers.values()) == listed["deepseek-v3-tiny"] and sum(buffers.values()) == 32
    mtp_record = json.loads((embedded_path("deepseek-v3-tiny") / "training.json").read_text())["mtp"]
    assert sum(mtp.values()) - 16 == mtp_record["parameters"] == 499_424
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    code, out, err = _run(monkeypatch, capsys, "export", "deepseek-v3-tiny", "-o", tmp_path / "e", "--parity", "none",
                          "--json")
    assert code == 0, err
    assert json.loads(out)["source"]["parameters"] == listed["deepseek-v3-tiny"]


# -- 10. an artifact whose weights were cut short: one line naming the file, before any runtime reads it -----------

WEIGHTS = {"onnxruntime": "model.onnx.data", "openvino": "openvino_model.bin"}


def _damaged(artifact: Path, tmp_path: Path, name: str, content: bytes | None = None) -> Path:
    """A copy of ``artifact`` whose file ``name`` is cut to half its length (or replaced by ``content``)."""
    copy = tmp_path / "damaged"
    shutil.copytree(artifact, copy)
    data = (copy / name).read_bytes()
    (copy / name).write_bytes(data[:len(data) // 2] if content is None else content)
    return copy


@pytest.mark.parametrize("command", ["generate", "eval", "compare", "serve"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_weights_are_one_line_naming_the_file(monkeypatch, capsys, tmp_path, artifacts, backend, command):
    damaged = _damaged(artifacts[backend], tmp_path, WEIGHTS[backend])
    length = (damaged / WEIGHTS[backend]).stat().st_size
    args = {"generate": ["generate", damaged, "1+2=", "--raw"],
            "eval": ["eval", damaged, "--no-latency", "--texts", "2", "--problems", "2", "-o", tmp_path / "out"],
            "compare": ["compare", artifacts[backend], damaged, "--no-latency", "--texts", "2", "--problems", "2"],
            "serve": ["serve", damaged, "--port", "0"]}[command]
    code, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, f"{damaged / WEIGHTS[backend]} is truncated: {length} bytes, ")
    assert not (tmp_path / "out").exists()


def test_weights_a_runtime_cannot_load_are_one_line_naming_the_model(monkeypatch, capsys, tmp_path, artifacts):
    """What the length check cannot see fails in the runtime's loader: the same kind of line, not a traceback."""
    damaged = _damaged(artifacts["openvino"], tmp_path, "openvino_model.xml", b"<net>not an IR</net>")
    code, err = run_cli(monkeypatch, capsys, "generate", damaged, "1+2=", "--raw")
    assert_one_line_error(code, err, f"openvino cannot load {damaged / 'openvino_model.xml'}: ")
    assert f"dstc verify {damaged}" in err


@pytest.mark.parametrize("backend", BACKENDS)
def test_whole_artifacts_still_generate(monkeypatch, capsys, artifacts, backend):
    code, out, err = _run(monkeypatch, capsys, "generate", artifacts[backend], "321+654=", "--raw",
                          "--new-tokens", "4")
    assert code == 0, err
    assert out.startswith("9750")


def test_serve_options_are_the_settings_fields_and_bad_ones_stop_before_any_load(monkeypatch, capsys, tmp_path):
    """`dstc serve`'s options are generated from ServeSettings (toolchain/serve/settings.py): every field but the
    keys (which come from --api-key/--api-key-file) is an option with the field's default; a value out of the
    section's bounds is one line, exit 2, before the artifact is opened (it does not exist here)."""
    from toolchain.cli import cli
    from toolchain.errors import InputError
    from toolchain.serve.settings import ServeSettings

    params = {p.name: p for p in cli.commands["serve"].params}
    assert set(ServeSettings.model_fields) - set(params) == {"api_keys"}
    for name, field in ServeSettings.model_fields.items():
        if name != "api_keys" and field.default_factory is None:
            assert params[name].default == field.default, name
    for option, value in (("--max-batch", "0"), ("--body-timeout", "0"), ("--max-queue", "-1"),
                          ("--kv-layout", "paged")):
        code, err = run_cli(monkeypatch, capsys, "serve", str(tmp_path / "missing"), option, value)
        assert_one_line_error(code, err, option)
    with pytest.raises(InputError, match="max_batch"):
        ServeSettings.check({"max_batch": 0})
