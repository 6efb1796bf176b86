"""report.html and compare.html as a reader gets them: parsed into elements (the standard library's HTML parser) and,
where a headless browser is installed (Debian's chromium-headless-shell; none comes from PyPI without a download
at run time), loaded in it, its DOM read back and its console checked for errors: plots present, the gate lines
on them, no script."""

from __future__ import annotations

import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest
from test_render import gated, make_report

from toolchain.report.comparison import render_comparison_html
from toolchain.report.html import render_html

VOID = {"meta", "br", "img", "input", "link", "hr", "col", "area", "base", "embed", "source", "track", "wbr"}
BROWSERS = ("chromium-headless-shell", "chromium", "chromium-browser", "google-chrome")


class Elements(HTMLParser):
    """Every element's path from the root (html/body/main/figure/svg...), its text, and tags left unclosed or
    closed out of order (an SVG's own elements may be self-closing)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.paths: list[str] = []
        self.texts: list[tuple[str, str]] = []  # (path, text)
        self.misnested: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.paths.append("/".join([*self.stack, tag]))
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.paths.append("/".join([*self.stack, tag]))

    def handle_endtag(self, tag):
        if not self.stack or self.stack[-1] != tag:
            self.misnested.append(f"</{tag}> in {'/'.join(self.stack)}")
            return
        self.stack.pop()

    def handle_data(self, data):
        if data.strip():
            self.texts.append(("/".join(self.stack), data.strip().replace("\u2212", "-")))


def parse(page: str) -> Elements:
    elements = Elements()
    elements.feed(page)
    elements.close()
    assert elements.misnested == [] and elements.stack == [], (elements.misnested, elements.stack)
    return elements


def count(elements: Elements, suffix: str) -> int:
    return sum(path.endswith(suffix) for path in elements.paths)


@pytest.fixture(scope="module")
def pages(tmp_path_factory) -> dict[str, Path]:
    ort = gated(make_report("onnxruntime"), kl_limit=5e-3, weight_limit=0.08)
    ov = gated(make_report("openvino"), kl_limit=5e-3, weight_limit=0.08)
    root = tmp_path_factory.mktemp("pages")
    (root / "report.html").write_text(render_html(ort))
    (root / "compare.html").write_text(render_comparison_html([ort, ov], ["onnxruntime", "openvino"]))
    return {"report": root / "report.html", "compare": root / "compare.html"}


def test_report_html_has_its_plots_and_gate_lines_as_elements(pages):
    page = parse(pages["report"].read_text())
    assert count(page, "main/figure/svg") == 9 and count(page, "/script") == 0
    headings = [text for path, text in page.texts if path.endswith("main/h2")]
    assert headings == ["Gates", "Accuracy", "Speed and size", "Latency per case", "Quantization error"]
    svg_texts = [text for path, text in page.texts if "/svg/" in path]
    assert "gate max_kl_mean 0.005 (dotted: mean KL)" in svg_texts and "gate max_weight_error 0.08" in svg_texts
    assert not [t for t in svg_texts if "×10" in t or "^" in t]  # plain log-axis ticks
    assert any("Not a KL measured with one layer" in text for path, text in page.texts if path.endswith("main/p"))


def test_compare_html_has_its_plots_the_machine_and_the_gate_lines(pages):
    page = parse(pages["compare"].read_text())
    assert count(page, "main/figure/svg") == 8 and count(page, "/script") == 0
    notes = " ".join(text for path, text in page.texts if path.endswith("main/p"))
    assert "Measured on Test CPU @ 3 GHz" in notes and "4 threads" in notes
    assert "gate max_kl_mean 0.005 (dotted: mean KL)" in [t for path, t in page.texts if "/svg/" in path]


def _browser() -> str | None:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


@pytest.mark.skipif(_browser() is None, reason="no headless browser installed (apt-get install "
                                               "chromium-headless-shell); the parsed-element tests above still run")
@pytest.mark.parametrize("name", ["report", "compare"])
def test_a_headless_browser_renders_the_page_with_no_console_error(pages, name, tmp_path):
    """The browser's DOM after loading: the same figures and SVGs the page holds, the gate line's text, and no
    console message (a script error, a resource it could not load)."""
    browser = _browser()
    assert browser is not None
    argv = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}"]
    proc = subprocess.run([*argv, "--dump-dom", pages[name].as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    expected = 9 if name == "report" else 8
    assert dom.count("<svg") == expected and len(re.findall(r'<figure class="plot"', dom)) == expected
    assert "gate max_kl_mean 0.005 (dotted: mean KL)" in dom.replace("\u2212", "-")
    assert not re.findall(r"CONSOLE|Uncaught", proc.stderr), proc.stderr[-2000:]
    shot = tmp_path / f"{name}.png"
    proc = subprocess.run([*argv, "--hide-scrollbars", "--window-size=1100,3000", f"--screenshot={shot}",
                           pages[name].as_uri()], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and shot.stat().st_size > 50_000  # a page drawn, not a blank one
    if name == "report":  # the console check can fail: a page with a script error is caught by it
        broken = tmp_path / "broken.html"
        broken.write_text(pages[name].read_text().replace("</main>", "<script>undefinedFunction();</script></main>"))
        proc = subprocess.run([*argv, "--dump-dom", broken.as_uri()], capture_output=True, text=True, timeout=120)
        assert "Uncaught ReferenceError: undefinedFunction" in proc.stderr
