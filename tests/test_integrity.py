"""Reliability and integrity (issue #10): nothing of a user's is deleted, the stage cache is verified before reuse,
reports are bound to their artifact, signed manifests, prompt limits, and every bad input gives exit 2 with one
line and nothing written."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from cli_helpers import assert_one_line_error, run_cli
from toolchain.atomic import MARKER
from toolchain.build import build
from toolchain.interface.files import MANIFEST, SIGNATURE
from toolchain.hashing import self_digest
from toolchain.manifest import verify_artifact
from toolchain.stages.runner import cache_root

REPO = Path(__file__).resolve().parent.parent
EVAL_SMALL = ["--texts", "8", "--problems", "4", "--no-latency"]


def write_recipe(path: Path, **fields) -> Path:
    path.write_text(yaml.safe_dump({"name": path.stem, "model": "r1-distill-qwen-tiny", "export": {"parity": []},
                                    "compile": {"backend": "onnxruntime", "verify": False}, **fields}))
    return path


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DSTC_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, cache):
    root = tmp_path_factory.mktemp("art")
    build(write_recipe(root / "qwen.yaml"), root / "art")
    return root / "art"


@pytest.fixture
def art_copy(artifact, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(artifact, copy)
    return copy


def tree(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# -- 1. data loss ------------------------------------------------------------------------------------------------


def test_a_directory_with_dstc_like_file_names_is_not_replaced(monkeypatch, capsys, tmp_path, cache):
    webapp = tmp_path / "webapp"
    webapp.mkdir()
    (webapp / "manifest.json").write_text("{}")
    (webapp / "index.html").write_text("x")
    before = tree(webapp)
    code, err = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", webapp, "--parity", "none")
    assert_one_line_error(code, err, "was not written by dstc")
    assert tree(webapp) == before


def test_an_empty_or_dstc_written_directory_is_replaced_and_marked(monkeypatch, capsys, tmp_path, cache):
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(2):  # empty, then dstc's own
        code, _ = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", out, "--parity", "none")
        assert code == 0 and (out / MARKER).is_file() and (out / "model.onnx").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]  # no temporaries, no lock left


def test_outputs_take_the_umask_not_0700(monkeypatch, capsys, tmp_path, cache):
    old = os.umask(0o022)
    try:
        code, _ = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", tmp_path / "o", "--parity",
                          "none")
    finally:
        os.umask(old)
    assert code == 0 and (tmp_path / "o").stat().st_mode & 0o777 == 0o755


def test_shape_faithful_does_not_overwrite_a_foreign_checkpoint(monkeypatch, capsys, tmp_path):
    theirs = tmp_path / "ckpt"
    shutil.copytree(REPO / "toolchain/models/embedded/r1-distill-qwen-tiny", theirs)
    before = tree(theirs)
    code, err = run_cli(monkeypatch, capsys, "models", "shape-faithful", "deepseek-r1-distill-qwen-1.5b", "-o", theirs,
                        "--layers", "1")
    assert_one_line_error(code, err, "was not written by dstc")
    assert tree(theirs) == before


def test_eval_does_not_overwrite_a_users_report_and_checks_before_the_work(monkeypatch, capsys, tmp_path,
                                                                          artifact):
    theirs = tmp_path / "site"
    theirs.mkdir()
    (theirs / "report.html").write_text("mine")
    code, err = run_cli(monkeypatch, capsys, "eval", artifact, "-o", theirs, *EVAL_SMALL)
    assert_one_line_error(code, err, "was not written by dstc")
    assert (theirs / "report.html").read_text() == "mine"
    assert "[eval]" not in err  # refused before the reference model loads, not after evaluating


# -- 2. the stage cache is verified before reuse -----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["flip", "delete"])
def test_a_damaged_cache_entry_is_run_again(tmp_path, monkeypatch, damage):
    monkeypatch.setenv("DSTC_CACHE_DIR", str(tmp_path / "cache"))
    recipe = write_recipe(tmp_path / "r.yaml")
    first = build(recipe, tmp_path / "art")
    (export_dir,) = cache_root().glob("export-*")
    graph = export_dir / "model.onnx"
    if damage == "flip":
        data = bytearray(graph.read_bytes())
        data[len(data) // 2] ^= 0xFF
        graph.write_bytes(bytes(data))
    else:
        graph.unlink()

    class Log:
        lines: list[str] = []

        def stage_started(self, *a): ...

        def stage_finished(self, *a): ...

        def log(self, message):
            self.lines.append(message)

    events = Log()
    second = build(recipe, tmp_path / "art", events=events)
    # the export ran again (to the same bytes), so the compile stage's id is unchanged and it is reused
    assert second["provenance"]["cached_stages"] == ["compile"]
    assert any("does not match what was recorded" in line and "model.onnx" in line for line in events.lines)
    assert second["files"] == first["files"] and verify_artifact(tmp_path / "art") == []


# -- 3. reports are bound to artifacts, manifests to their digest and signature ------------------------------------


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory, artifact):
    root = tmp_path_factory.mktemp("evaluated")
    a, b = root / "a", root / "b"
    shutil.copytree(artifact, a)
    build(write_recipe(root / "other.yaml", compile={"backend": "onnxruntime", "verify": True}), b)
    for art in (a, b):
        proc = subprocess.run([sys.executable, "-m", "toolchain", "eval", str(art), *EVAL_SMALL],
                              capture_output=True, text=True, timeout=600, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
    return a, b


def test_gate_refuses_a_report_copied_from_another_artifact(monkeypatch, capsys, tmp_path, evaluated):
    a, b = evaluated
    target = tmp_path / "a"
    shutil.copytree(a, target)
    assert run_cli(monkeypatch, capsys, "gate", target, "--min-top1-agreement", "0.5")[0] == 0
    shutil.copyfile(b / "report.json", target / "report.json")
    code, err = run_cli(monkeypatch, capsys, "gate", target, "--min-top1-agreement", "0.5")
    assert_one_line_error(code, err, "was not written for the artifact")
    assert any("report: " in p and "not written for the artifact" in p for p in verify_artifact(target))


def test_verify_catches_an_edited_manifest_report_and_rendered_report(tmp_path, evaluated):
    a, _ = evaluated
    target = tmp_path / "a"
    shutil.copytree(a, target)
    assert verify_artifact(target) == []
    html = target / "report.html"
    html.write_text(html.read_text().replace("</body>", "<script>x</script></body>"))
    assert verify_artifact(target) == ["changed: report.html (since dstc eval wrote it)"]
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["files"]["model.onnx"] = "0" * 64
    (target / MANIFEST).write_text(json.dumps(manifest))
    problems = verify_artifact(target)
    assert problems[0] == "changed: manifest.json (its content does not match its digest)"
    assert "changed: model.onnx" in problems


def test_a_report_edited_after_eval_is_refused(monkeypatch, capsys, tmp_path, evaluated):
    a, _ = evaluated
    target = tmp_path / "a"
    shutil.copytree(a, target)
    report = json.loads((target / "report.json").read_text())
    report["metrics"]["top1_agreement"]["value"] = 0.5
    (target / "report.json").write_text(json.dumps(report))
    code, err = run_cli(monkeypatch, capsys, "gate", target / "report.json", "--min-top1-agreement", "0.4")
    assert_one_line_error(code, err, "changed after dstc wrote it")


def _forge(report_path: Path, digest: bool) -> dict:
    """The report with its accuracy made perfect: what a text editor does to pass a gate."""
    report = json.loads(report_path.read_text())
    report["metrics"]["kl_mean"]["value"] = 0.0
    report["metrics"]["top1_agreement"]["value"] = 1.0
    report.pop("digest", None)
    if digest:
        report["digest"] = self_digest(report)
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    return report


def test_a_forged_report_passes_neither_gate_nor_verify(monkeypatch, capsys, tmp_path, evaluated):
    """Issue #39: a report with its figures edited and its digest deleted passed `dstc gate` and `dstc verify`; with
    the digest recomputed it still must not, since manifest.json records the report eval wrote."""
    a, _ = evaluated
    target = tmp_path / "a"
    shutil.copytree(a, target)
    strict = ("--max-kl-mean", "1e-10")  # the fp32 artifact measures ~8e-9
    assert run_cli(monkeypatch, capsys, "gate", target, *strict)[0] == 1  # the real figures fail these limits
    assert run_cli(monkeypatch, capsys, "verify", target)[0] == 0
    _forge(target / "report.json", digest=False)
    assert_one_line_error(*run_cli(monkeypatch, capsys, "gate", target, *strict), "has no digest")
    assert run_cli(monkeypatch, capsys, "verify", target)[0] == 1
    _forge(target / "report.json", digest=True)
    assert_one_line_error(*run_cli(monkeypatch, capsys, "gate", target, *strict), "is not the report manifest.json")
    assert any("is not the report manifest.json records" in p for p in verify_artifact(target))
    # a standalone copy without a digest is refused too
    alone = tmp_path / "alone.json"
    shutil.copyfile(target / "report.json", alone)
    _forge(alone, digest=False)
    assert_one_line_error(*run_cli(monkeypatch, capsys, "gate", alone, *strict), "has no digest")
    # and a manifest rewritten to record the forged report no longer matches its digest, or, recomputed, a signature
    manifest = json.loads((target / MANIFEST).read_text())
    manifest["report"]["report.json"] = hashlib.sha256((target / "report.json").read_bytes()).hexdigest()
    (target / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    assert_one_line_error(*run_cli(monkeypatch, capsys, "gate", target, *strict), "changed after dstc wrote it")
    signed = tmp_path / "signed"
    shutil.copytree(a, signed)
    key, pub = tmp_path / "key.pem", tmp_path / "pub.pem"
    assert run_cli(monkeypatch, capsys, "keygen", key, pub)[0] == 0
    assert run_cli(monkeypatch, capsys, "sign", signed, "--key", key)[0] == 0
    _forge(signed / "report.json", digest=True)
    manifest = json.loads((signed / MANIFEST).read_text())
    manifest["report"]["report.json"] = hashlib.sha256((signed / "report.json").read_bytes()).hexdigest()
    manifest["digest"] = self_digest(manifest)
    (signed / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    assert verify_artifact(signed) == []  # hashes anyone can recompute: only the signature tells
    assert verify_artifact(signed, pub)[0].startswith("bad signature")


def test_a_report_of_an_older_schema_is_read_with_a_warning(monkeypatch, capsys, tmp_path, evaluated):
    a, _ = evaluated
    report = json.loads((a / "report.json").read_text())
    report = {**report, "schema": "dstc.report/4"}
    report.pop("digest")
    old = tmp_path / "old.json"
    old.write_text(json.dumps(report))
    code, err = run_cli(monkeypatch, capsys, "gate", old, "--min-top1-agreement", "0.5")
    assert code == 0 and "dstc: warning:" in err and "an edit of its figures cannot be told" in err


def test_sign_and_verify_with_ed25519(monkeypatch, capsys, tmp_path, art_copy):
    key, pub = tmp_path / "key.pem", tmp_path / "pub.pem"
    assert run_cli(monkeypatch, capsys, "keygen", key, pub)[0] == 0
    assert key.stat().st_mode & 0o777 == 0o600
    assert_one_line_error(*run_cli(monkeypatch, capsys, "keygen", key, pub), "does not overwrite keys")
    assert run_cli(monkeypatch, capsys, "verify", art_copy, "--public-key", pub)[0] == 1  # not signed yet
    assert run_cli(monkeypatch, capsys, "sign", art_copy, "--key", key)[0] == 0
    assert (art_copy / SIGNATURE).is_file()
    assert run_cli(monkeypatch, capsys, "verify", art_copy, "--public-key", pub)[0] == 0
    other_key, other_pub = tmp_path / "k2.pem", tmp_path / "p2.pem"
    run_cli(monkeypatch, capsys, "keygen", other_key, other_pub)
    assert verify_artifact(art_copy, other_pub)[0].startswith("bad signature")
    # a rewritten manifest (even with a recomputed digest) no longer matches the signature
    manifest = json.loads((art_copy / MANIFEST).read_text())
    manifest["git_commit"] = "forged"
    manifest["digest"] = self_digest(manifest)
    (art_copy / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    assert verify_artifact(art_copy, pub)[0].startswith("bad signature")
    # an artifact that does not match its manifest is not signed
    (art_copy / "model.onnx").write_bytes(b"x")
    assert_one_line_error(*run_cli(monkeypatch, capsys, "sign", art_copy, "--key", key), "refusing to sign")


def test_eval_refuses_a_reference_that_is_not_the_build_source(monkeypatch, capsys, tmp_path, cache):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REPO / "toolchain/models/embedded/r1-distill-qwen-tiny", ckpt)
    recipe = write_recipe(tmp_path / "r.yaml", model=str(ckpt))
    build(recipe, tmp_path / "art")
    generation = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**generation, "note": "changed"}))
    code, err = run_cli(monkeypatch, capsys, "eval", tmp_path / "art", *EVAL_SMALL)
    assert_one_line_error(code, err, "is not the one the artifact was built from")
    assert "changed generation_config.json" in err and not (tmp_path / "art" / "report.json").exists()
    code, _ = run_cli(monkeypatch, capsys, "eval", tmp_path / "art", "--reference", ckpt, *EVAL_SMALL)
    assert code == 0
    reference = json.loads((tmp_path / "art" / "report.json").read_text())["reference"]
    assert reference["override"] is True and reference["matches_build_source"] is False


# -- 4. prompts ----------------------------------------------------------------------------------------------------


def test_generate_refuses_a_prompt_past_the_context_before_loading(monkeypatch, capsys, artifact):
    context = json.loads((artifact / "config.json").read_text())["max_position_embeddings"]
    code, err = run_cli(monkeypatch, capsys, "generate", artifact, "1+2= " * context, "--raw")
    assert_one_line_error(code, err, f"exceeds the model's context of {context} tokens")
    code, err = run_cli(monkeypatch, capsys, "generate", artifact, "1+2=", "--raw", "--new-tokens",
                        str(context))
    assert_one_line_error(code, err, "exceeds the model's context")


def test_generate_refuses_invalid_utf8(artifact):
    proc = subprocess.run([sys.executable, "-m", "toolchain", "generate", str(artifact), b"\xff\xfe 1+2=", "--raw"],
                          capture_output=True, timeout=300, cwd=REPO)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and "not valid UTF-8" in err and "Traceback" not in err


# -- 6. concurrency ------------------------------------------------------------------------------------------------


def test_a_second_writer_of_one_target_fails_cleanly_and_later_writes_work(monkeypatch, capsys, tmp_path, cache):
    out = tmp_path / "out"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from toolchain.atomic import atomic_output_dir
        with atomic_output_dir(Path({str(out)!r})) as tmp:
            print("holding", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "holding"
        code, err = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", out, "--parity", "none")
        assert_one_line_error(code, err, f"is being written by another dstc process (pid {holder.pid})")
    finally:
        holder.kill()
        holder.wait()
    # the killed holder left its temporary directory and lock file; the next writer clears them and succeeds
    code, _ = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", out, "--parity", "none")
    assert code == 0 and (out / "model.onnx").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- 5. one line, exit 2, nothing written: every bad input through the CLI ----------------------------------------


def _bad_config(tmp_path: Path, **changes) -> Path:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(REPO / "toolchain/models/embedded/r1-distill-qwen-tiny", ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, **changes}))
    return ckpt


def _export_dir(tmp_path: Path, graph: bytes | None) -> Path:
    export = tmp_path / "exported"
    code = subprocess.run([sys.executable, "-m", "toolchain", "export", "r1-distill-qwen-tiny", "-o", str(export),
                           "--parity", "none"], cwd=REPO, capture_output=True, timeout=300).returncode
    assert code == 0
    if graph is not None:
        (export / "model.onnx").write_bytes(graph if graph else (export / "model.onnx").read_bytes()[:500])
    return export


def _nested_report(tmp_path: Path) -> Path:
    path = tmp_path / "report.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    return path


def _symlink_out(tmp_path: Path) -> Path:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    return tmp_path / "link"


BAD_INPUTS = {
    # name: (args builder(tmp_path, artifact) -> args, expected fragment)
    "config value of the wrong type": (lambda t, a: ["export", _bad_config(t, hidden_size="big"), "-o", t / "o"],
                                       "hidden_size must be a positive integer"),
    "negative layer count": (lambda t, a: ["export", _bad_config(t, num_hidden_layers=-2), "-o", t / "o"],
                             "num_hidden_layers must be a positive integer"),
    "rms_norm_eps of the wrong type": (lambda t, a: ["export", _bad_config(t, rms_norm_eps="x"), "-o", t / "o"],
                                       "rms_norm_eps"),
    "garbage model.onnx to optimize": (lambda t, a: ["optimize", _export_dir(t, b"garbage"), "-o", t / "o",
                                                     "--backend", "onnxruntime"], "not a readable ONNX model"),
    "truncated model.onnx to compress": (lambda t, a: ["compress", _export_dir(t, b""), "-o", t / "o"],
                                         "not a readable ONNX model"),
    "truncated model.onnx to compile": (lambda t, a: ["compile", _export_dir(t, b""), "-o", t / "o", "--backend",
                                                      "openvino"], "not a readable ONNX model"),
    "-o .": (lambda t, a: ["export", "r1-distill-qwen-tiny", "-o", ".", "--parity", "none"],
             "is the current directory or contains it"),
    "unwritable compare --html": (lambda t, a: ["compare", a, a, "--html", t / "no" / "such" / "dir.html"],
                                  "is not a writable directory"),
    # os.access allows root everything; the probe in toolchain/atomic.py finds what cannot be created, before the work
    "eval -o where no directory can be made (/proc)": (lambda t, a: ["eval", a, "-o", "/proc/dstc-out", "--no-latency"],
                                                        "cannot write to /proc/dstc-out"),
    "compare --html where no file can be made (/proc)": (lambda t, a: ["compare", a, a, "--html", "/proc/dstc.html",
                                                                       "--no-latency"], "cannot write /proc/dstc.html"),
    "missing second artifact in compare": (lambda t, a: ["compare", a, t / "missing", "--no-latency"],
                                           "is not a directory"),
    "deeply nested report.json": (lambda t, a: ["gate", _nested_report(t), "--min-top1-agreement", "0.5"],
                                  "nested too deeply"),
    "generate on an artifact with a missing file": (lambda t, a: ["generate", _without(t, a, "model.onnx.data"
                                                                                       if (a / "model.onnx.data").exists()
                                                                                       else "tokenizer.json"), "1+2="],
                                                    "is incomplete"),
    "gptq on onnxruntime": (lambda t, a: ["compress", t / "nonexistent", "-o", t / "o", "--gptq"],
                            "gptq runs on the openvino target only"),
    "bad option value": (lambda t, a: ["export", "r1-distill-qwen-tiny", "-o", t / "o", "--new-tokens", "0"],
                         "--new-tokens"),
}


def _without(tmp_path: Path, artifact: Path, name: str) -> Path:
    copy = tmp_path / "incomplete"
    shutil.copytree(artifact, copy)
    (copy / name).unlink()
    return copy


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_writes_nothing(monkeypatch, capsys, tmp_path, artifact, cache, case):
    build_args, fragment = BAD_INPUTS[case]
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    args = build_args(tmp_path, artifact)
    before = tree(tmp_path)
    code, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, fragment)
    assert tree(tmp_path) == before
    assert not [p for p in tmp_path.rglob(".*") if p.name != MARKER]


def test_a_full_disk_is_one_line_and_leaves_nothing(monkeypatch, capsys, tmp_path, cache):
    import toolchain.stages.export as export_stage

    def full(*_a, **_k):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x"))

    monkeypatch.setattr(export_stage, "save_graph", full)
    code, err = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", tmp_path / "o", "--parity",
                        "none", "--no-cache")  # the export itself, not a copy of the one cached earlier
    assert_one_line_error(code, err, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_a_symlinked_output_writes_through_the_link_and_leaves_nothing_behind(monkeypatch, capsys, tmp_path,
                                                                               cache):
    link = _symlink_out(tmp_path)
    code, err = run_cli(monkeypatch, capsys, "export", "r1-distill-qwen-tiny", "-o", link, "--parity", "none")
    assert code == 0, err
    assert (tmp_path / "real" / "model.onnx").is_file() and link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_duplicate_recipe_key_negative_perplexity_and_unmeasured_gates(monkeypatch, capsys, tmp_path, evaluated):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: a\nmodel: r1-distill-qwen-tiny\nname: b\ncompile: {backend: openvino}\n")
    assert_one_line_error(*run_cli(monkeypatch, capsys, "build", recipe), "duplicate key 'name' (line 3)")
    a, _ = evaluated
    report = json.loads((a / "report.json").read_text())
    report.pop("digest")
    report["metrics"]["perplexity"]["value"] = -3.0
    report["digest"] = self_digest(report)
    baseline = tmp_path / "baseline.json"
    baseline.write_text(json.dumps(report))
    assert_one_line_error(*run_cli(monkeypatch, capsys, "gate", a, "--baseline", baseline, "--max-perplexity-increase",
                                   "0.1"), "perplexity -3.0 is below 1")
    # exact match is measured on the embedded task; drop the measurement to stand for a model it does not apply to
    report = json.loads((a / "report.json").read_text())
    report.pop("digest")
    report["metrics"]["exact_match_drop"]["value"] = None
    report["digest"] = self_digest(report)
    unmeasured = tmp_path / "unmeasured.json"
    unmeasured.write_text(json.dumps(report))
    code, _ = run_cli(monkeypatch, capsys, "gate", unmeasured, "--max-exact-match-drop", "2")
    assert code == 1
    code, _ = run_cli(monkeypatch, capsys, "gate", unmeasured, "--max-exact-match-drop", "2", "--allow-unmeasured")
    assert code == 0


def test_an_interrupt_a_finalizer_swallows_still_leaves_the_target(tmp_path):
    """Ctrl-C raised inside a finalizer is printed as "Exception ignored" and lost by Python; the output is
    still not committed, and the process still exits as interrupted. In a child: it signals itself."""
    target = tmp_path / "out"
    target.mkdir()
    (target / MARKER).write_text("")
    (target / "kept").write_text("before")
    script = textwrap.dedent(f"""
        import gc, os, signal, sys, time
        from pathlib import Path
        from toolchain import interrupts
        from toolchain.atomic import atomic_output_dir

        class Session:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler runs here, inside the finalizer

        interrupts.install()
        try:
            with atomic_output_dir(Path({str(target)!r})) as tmp:
                (tmp / "kept").write_text("after")
                Session()
                gc.collect()
                print("survived the finalizer", flush=True)
        except KeyboardInterrupt:
            sys.exit(130)
        """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=Path(__file__).parent.parent, capture_output=True,
                          text=True, timeout=120)
    assert "survived the finalizer" in proc.stdout and "Exception ignored" in proc.stderr, proc.stderr
    assert proc.returncode == 130, proc.stderr
    assert (target / "kept").read_text() == "before"
    assert not list(tmp_path.glob(".out.*"))
