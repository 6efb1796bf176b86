"""The fp32 PyTorch reference an artifact is measured against: which checkpoint (choice.py), the whole model
(whole.py) or one layer at a time with experts on demand (layered.py), and its outputs on evaluation data with their
cache (record.py, cache.py). The way in is outputs.py: eval, compare, export parity and the verify checks open the
reference there.

The PyTorch modules the reference is built of stay with the exporter, which traces the same modules into the graph:
transformers' layers given weights from the checkpoint reader (toolchain/export/reference.py) and the MTP layers'
(toolchain/export/mtp_reference.py, and each family's own, reached through its architecture's hooks)."""
