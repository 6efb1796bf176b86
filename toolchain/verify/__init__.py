"""Verification of what a stage wrote, shared by the export, optimize and compile stages: parity of a graph with
the PyTorch reference end to end (parity.py) and layer by layer (layer_parity.py), and the smoke run of a compiled
artifact at its runtime's deployment defaults, in a child process (smoke.py) — each on the one greedy loop
(toolchain/runtime/generate.py)."""
