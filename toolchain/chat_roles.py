"""The roles a chat message may have (OpenAI's chat API): the server's requests (toolchain/serve/schemas.py) and
eval's chat records (toolchain/evaluate/dataset.py) accept these and no other."""

from __future__ import annotations

import typing
from typing import Literal

ChatRole = Literal["system", "developer", "user", "assistant", "tool"]
CHAT_ROLES: tuple[str, ...] = typing.get_args(ChatRole)
