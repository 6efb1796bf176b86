"""Reading real checkpoints at real size: a lazy, tensor-by-tensor reader (FP8, sharded, fused experts), the
PyTorch reference built from it one decoder layer at a time, and a writer of DeepSeek-V3's FP8 hub layout."""

from toolchain.checkpoint.reader import CheckpointReader, open_checkpoint

__all__ = ["CheckpointReader", "open_checkpoint"]
