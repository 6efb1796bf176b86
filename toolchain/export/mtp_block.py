"""What a family's multi-token-prediction block is, as the references, parity and training ask it, chosen by the
family's own declaration (Architecture.mtp_wiring), so that no code outside a family's modules tells the families
apart. Two wirings exist: "layer", one decoder layer of the family over the main model's final-normed hidden state
(DeepSeek-V3 and V3.2: mtp_reference.LayerMtp), and "streams", DeepSeek-V4's block over its hyper-connection
streams (deepseek_v4_mtp_reference.StreamsMtp). Their graphs: toolchain/export/mtp.py GRAPHS."""

from __future__ import annotations

from typing import Any, Protocol, TypeAlias

import numpy as np
import torch

from toolchain.export.architectures import ARCHITECTURES
from toolchain.export.deepseek_v4_mtp_reference import StreamsMtp, V4MtpModel
from toolchain.export.mtp_reference import LayerMtp, MtpModel

MtpModule: TypeAlias = MtpModel | V4MtpModel  # the blocks' torch modules, by wiring


class MtpBlock(Protocol):
    def load(self, model, reader, index: int) -> MtpModule:
        """The block ``index`` of the checkpoint ``reader`` (opened with mtp=True) as a float32 PyTorch reference
        over the loaded main ``model``'s embedding, head and RoPE."""

    def new(self, model, index: int) -> MtpModule:
        """An untrained block over ``model``'s embedding, head and RoPE (toolchain/models/mtp_training.py)."""

    def main_outputs(self, model, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
        """(the main model's final-normed hidden state, what the block reads of it) for its forward's inputs."""

    def main_hidden(self, model, ids: np.ndarray, mask: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
        """What the block reads at each position of a left-padded batch, as the main model's reference computes it
        (zeros at padding where the reference runs each row alone)."""

    def hub_tensors(self, model, mtp: Any) -> dict[str, torch.Tensor]:
        """The block's tensors under the hub checkpoint's names."""


WIRINGS: dict[str, MtpBlock] = {"layer": LayerMtp(), "streams": StreamsMtp()}


def mtp_block(model_type: str) -> MtpBlock:
    """The MTP block of the family ``model_type`` names."""
    arch = ARCHITECTURES.get(model_type)
    if arch is None or not arch.exports_mtp or arch.mtp_wiring not in WIRINGS:
        raise ValueError(f"no MTP layer for {model_type}")
    return WIRINGS[arch.mtp_wiring]


def load_mtp(model, reader, index: int) -> MtpModule:
    """The checkpoint's MTP layer ``index`` over the loaded main ``model``, as its family wires it."""
    return mtp_block(model.config.model_type).load(model, reader, index)
