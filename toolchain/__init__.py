"""dstc: export, optimise, compress and compile DeepSeek language models for CPU inference."""

__version__ = "0.1.0"
