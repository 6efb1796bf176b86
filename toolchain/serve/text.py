"""Text from a stream of tokens: incremental detokenization and stop sequences."""

from __future__ import annotations


class IncrementalText:
    """The text of a growing list of token ids, as increments.

    Each call decodes a few tokens before the new ones as context and returns what they add; an increment that
    ends in U+FFFD (a character whose bytes span several tokens, not all here yet) is held back until it is whole.
    Decoded as ``tokenizer.decode(ids)`` of the whole list (what ``dstc generate`` prints), the increments add up
    to the same text.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self._prefix = 0  # ids[_prefix:_read] were decoded already and give the context
        self._read = 0

    def add(self, tokens: list[int]) -> str:
        self.ids += tokens
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        if len(text) > len(before) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the end, as U+FFFD)."""
        before = self.tokenizer.decode(self.ids[self._prefix:self._read])
        text = self.tokenizer.decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):]


class StopText:
    """Cuts text at the first of the stop sequences, which is not sent; holds back a tail that may begin one."""

    def __init__(self, stops: list[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """The part of ``text`` (after what was held back) that can be sent; sets ``stopped`` at a stop sequence."""
        if self.stopped:
            return ""
        buffer = self._held + text
        if not self.stops:
            self._held = ""
            return buffer
        hits = [i for i in (buffer.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[:min(hits)]
        hold = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buffer)), hold, -1):
                if buffer.endswith(stop[:k]):
                    hold = k
                    break
        self._held = buffer[len(buffer) - hold:] if hold else ""
        return buffer[:len(buffer) - hold]

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.stopped else held
