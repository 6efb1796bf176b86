"""The optional parts of an install (pyproject.toml's extras): which extra brings each module that the base install
(serving, generating, verifying and gating an artifact) does not have, so that a command needing one says how to
install it in one line instead of failing with an ImportError."""

from __future__ import annotations

# top-level module -> the extra that installs it
EXTRA_OF_MODULE = {
    "torch": "build", "onnx_ir": "build", "onnxscript": "build", "onnxruntime_genai": "build", "nncf": "build",
    "threadpoolctl": "build", "matplotlib": "build", "lm_eval": "build", "datasets": "build",
    "ray": "ray", "psutil": "ray",
}


def missing_extra(error: ModuleNotFoundError) -> str | None:
    """The one-line message for a module an extra installs, or None when the missing module is no extra's."""
    module = error.name or ""  # a package absent (not a submodule of an installed one)
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    return f"this command needs {module}, which this install of dstc does not have: pip install 'dstc[{extra}]'"
