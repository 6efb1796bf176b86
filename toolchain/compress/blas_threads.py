"""Compression's numpy BLAS on one thread, whatever the machine: the bytes a recipe compresses to must not depend
on where it is built.

NNCF's GPTQ and scale estimation and dstc's streamed AWQ multiply and factor matrices through numpy's BLAS
(OpenBLAS), which splits a product's sums by its thread count: deepseek-v3-tiny's GPTQ recipe wrote other INT4
weights in a Ray task (one CPU: Ray sets OMP_NUM_THREADS=1) than on the same machine's two threads. One thread
gives every machine with the same BLAS kernels one result; the runtimes' own thread pools (ONNX Runtime, OpenVINO,
torch) are not touched.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def one_blas_thread() -> Iterator[None]:
    from threadpoolctl import threadpool_limits  # loaded with the compress stage, not with the CLI

    with threadpool_limits(limits=1, user_api="blas"):
        yield
