"""A completion's token ids -> the text the client gets, in one go or token by token.

The engine returns every token it produced, including the end-of-turn token and the token that
completed a stop string; the *text* follows OpenAI: no end token, cut before the first stop string.
With tools, the content is stripped of surrounding whitespace and tool-call markup is held back
while streaming, so the streamed deltas always add up to the final content.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from arborl.gateway.toolcalls import markup_start

Decode = Callable[[Sequence[int]], str]  # special tokens skipped


def cut_at_stop(text: str, stops: Sequence[str]) -> str:
    cut = len(text)
    for s in stops:
        i = text.find(s)
        if 0 <= i < cut:
            cut = i
    return text[:cut]


def completion_text(decode: Decode, token_ids: Sequence[int], end_ids: Collection[int], stops: Sequence[str]) -> str:
    """The response text of a finished completion."""
    ids = list(token_ids)
    if ids and ids[-1] in end_ids:
        ids.pop()
    return cut_at_stop(decode(ids), stops)


class TextStreamer:
    """Incremental text of one choice: ``push`` each token, send what it returns; at the end
    ``flush(final_content)`` returns the rest (the final content always extends what was sent)."""

    def __init__(self, decode: Decode, end_ids: Collection[int], stops: Sequence[str], *, tools: bool) -> None:
        self._decode = decode
        self._end_ids = end_ids
        self._stops = list(stops)
        self._tools = tools
        self._ids: list[int] = []
        self.sent = ""

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        ids = self._ids[:-1] if token_id in self._end_ids else self._ids
        text = cut_at_stop(self._decode(ids), self._stops)
        safe = self._safe_text(text)
        if len(safe) > len(self.sent) and safe.startswith(self.sent):
            delta, self.sent = safe[len(self.sent) :], safe
            return delta
        return ""

    def flush(self, final_content: str | None) -> str:
        final = final_content or ""
        if final.startswith(self.sent):
            delta, self.sent = final[len(self.sent) :], final
            return delta
        return ""  # cannot happen with the hold-back rules; never resend text

    def _safe_text(self, text: str) -> str:
        """The longest part of ``text`` no later token can change."""
        end = len(text)
        while end and text[end - 1] == "\ufffd":  # a multi-byte character still incomplete
            end -= 1
        for s in self._stops:  # a tail that may grow into a stop string
            for k in range(min(len(s) - 1, end), 0, -1):
                if text[:end].endswith(s[:k]):
                    end -= k
                    break
        text = text[:end]
        if not self._tools:
            return text
        text = text.lstrip()
        if text[:1] in ("{", "[", "`"):  # may be a JSON tool call: hold all
            return ""
        m = markup_start(text)
        if m is not None:
            text = text[:m]
        return text.rstrip()
