"""dstc: export, optimise, compress and compile DeepSeek language models for CPU inference."""

import sys

__version__ = "0.1.0"

# openvino_telemetry (which ov.convert_model and NNCF report to) forks a process from a background thread for every
# event, about 60 in one build; a fork stops numpy's OpenBLAS thread pool under a matmul in the main thread, which
# then hangs. Without the module both libraries fall back to their stubs: nothing is sent, nothing forks.
sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]  # None is what blocks the import
