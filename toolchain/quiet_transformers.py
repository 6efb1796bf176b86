"""transformers kept quiet while dstc builds configs and models from a checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def quiet_transformers() -> Iterator[None]:
    """transformers' load report, warnings and progress bar off: they repeat, in 10-15 lines on stderr, what a
    one-line error says (and say nothing when all is well)."""
    from transformers.utils import logging as hf_logging  # transformers loads only where a model is built

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()
