"""Token stitching and drift detection: a session's memory of the calls it served.

**Stitching.** When a chat request's messages are an earlier call's messages, then the assistant
message that call returned (compared by ``render.canonical``), then new messages, the new prompt is
that call's exact ``prompt + completion`` token ids, a *bridge* that closes the assistant turn the
way the template does (``\\n`` after ``<|im_end|>`` for ChatML; the whole ``<|im_end|>\\n`` when the
completion did not end on an end-of-turn token), and the new messages rendered as a suffix. The
policy so conditions on exactly the tokens it produced, and the calls merge into one training
sample. A request whose messages equal an earlier call's request reuses that call's prompt
(a resample or a client retry is a sibling of it, not a drift).

**Drift.** A request that extends no earlier call is rendered in full. If its tokens do not extend
the token sequence (prompt + completion) of any earlier call, a drift event is recorded on the call:
the call it is compared with (the one sharing the longest token prefix), the first differing token
position, and a reason at the message level (history edited or truncated, assistant message edited
or missing, tools changed, template not prefix-stable, stitching off, token prompt diverges).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from arborl.gateway.render import ChatRenderer, canonical, digest, tools_key
from arborl.prefix import common_prefix_len

RECENT = 16  # earlier calls a drifting prompt is compared with (token prefix), newest first


def message_chain(messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[str]:
    """H_0 = hash of the tools, H_{i+1} = hash(H_i, canonical(messages[i])): H_k names messages[:k]."""
    chain = [tools_key(tools)]
    for m in messages:
        chain.append(digest(chain[-1], canonical(m)))
    return chain


@dataclass(eq=False)
class CallRecord:
    """What a session remembers of one served call."""

    call_id: str
    full_ids: array  # prompt + completion token ids ('i' array: 4 bytes a token)
    prompt_len: int
    ends_turn: bool  # the completion's last token is an end-of-turn (EOS / stop) token
    chain: list[str] | None = None  # chat: message_chain of the request
    response_key: str | None = None  # chat: canonical() of the assistant message returned
    text_key: str | None = None  # completions: prompt text + completion text, as decoded

    @property
    def n_messages(self) -> int:
        return len(self.chain) - 1 if self.chain else 0

    @property
    def prompt_ids(self) -> list[int]:
        return self.full_ids[: self.prompt_len].tolist()


@dataclass
class Stitched:
    prompt_ids: list[int]
    parent: CallRecord
    info: dict[str, Any]  # goes to call.meta["stitch"]


@dataclass
class SessionHistory:
    """The calls one session served, indexed for parent lookup. Not thread-safe: the owner locks."""

    records: list[CallRecord] = field(default_factory=list)
    _by_chain: dict[str, list[CallRecord]] = field(default_factory=dict)

    def add(self, rec: CallRecord) -> None:
        self.records.append(rec)
        if rec.chain:
            self._by_chain.setdefault(rec.chain[-1], []).append(rec)

    def clear(self) -> None:
        self.records.clear()
        self._by_chain.clear()

    # -- chat ---------------------------------------------------------------------------------------
    def same_request(self, chain: list[str]) -> CallRecord | None:
        """The newest call whose request had exactly these messages and tools."""
        recs = self._by_chain.get(chain[-1])
        return recs[-1] if recs else None

    def find_parent(self, messages: Sequence[dict[str, Any]], chain: list[str]) -> tuple[CallRecord, int] | None:
        """(call, k): the newest call whose messages are ``messages[:k]`` and whose returned
        assistant message is ``messages[k]``, for the largest such k."""
        for k in range(len(messages) - 1, -1, -1):
            if messages[k]["role"] != "assistant":
                continue
            recs = self._by_chain.get(chain[k])
            if not recs:
                continue
            key = canonical(messages[k])
            for rec in reversed(recs):
                if rec.response_key == key:
                    return rec, k
        return None

    # -- completions (text) -------------------------------------------------------------------------
    def find_text_parent(self, prompt_text: str) -> CallRecord | None:
        best = None
        for rec in reversed(self.records[-RECENT:]):
            if rec.text_key and prompt_text.startswith(rec.text_key):
                if best is None or len(rec.text_key) > len(best.text_key or ""):
                    best = rec
        return best

    # -- drift --------------------------------------------------------------------------------------
    def drift(
        self,
        prompt_ids: Sequence[int],
        *,
        messages: Sequence[dict[str, Any]] | None = None,
        chain: list[str] | None = None,
        reason: str | None = None,
    ) -> dict[str, Any] | None:
        """The drift event of a prompt that was not stitched, or None when it extends an earlier
        call's tokens (or there is no earlier call)."""
        if not self.records:
            return None
        best, best_len = None, -1
        for rec in reversed(self.records[-RECENT:]):
            n = common_prefix_len(prompt_ids, rec.full_ids)
            if n > best_len:
                best, best_len = rec, n
        assert best is not None
        if best_len == len(best.full_ids):
            return None  # the prompt extends that call token for token
        event: dict[str, Any] = {
            "against_call": best.call_id,
            "position": best_len,  # first differing token position
            "against_len": len(best.full_ids),
            "prompt_len": len(prompt_ids),
        }
        if reason is None and messages is not None and chain is not None and best.chain:
            reason, index = _message_reason(messages, chain, best)
            if index is not None:
                event["message_index"] = index
        event["reason"] = reason or "prompt_tokens_diverge"
        return event


def _message_reason(messages: Sequence[dict[str, Any]], chain: list[str], rec: CallRecord) -> tuple[str, int | None]:
    assert rec.chain is not None
    if chain[0] != rec.chain[0]:
        return "tools_changed", None
    j = 0
    while j < min(len(chain), len(rec.chain)) - 1 and chain[j + 1] == rec.chain[j + 1]:
        j += 1
    if j < rec.n_messages:
        return ("history_truncated" if j == len(messages) else "message_edited"), j
    if j == len(messages):
        return "no_new_message", None
    if messages[j]["role"] == "assistant":
        return "assistant_message_edited", j
    return "assistant_message_missing", j


def stitch_chat(
    renderer: ChatRenderer,
    parent: CallRecord,
    k: int,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    full_text: str,
) -> Stitched | str:
    """Stitch ``messages`` (whose ``messages[:k]`` + ``messages[k]`` are ``parent``'s request and
    reply) onto ``parent``'s tokens. Returns the stitched prompt, or why the template forbids it."""
    prefix_text = renderer.render(messages[: k + 1], tools, add_generation_prompt=False)
    if not full_text.startswith(prefix_text):
        return "template_not_prefix_stable"
    tail = renderer.turn_tail(messages[:k], tools, cached=True)
    if tail is None or not prefix_text.endswith(tail):
        tail = renderer.turn_tail(messages[:k], tools)
        if tail is None or not prefix_text.endswith(tail):
            return "template_not_prefix_stable"
    bridge = tail
    if parent.ends_turn:
        end_text = renderer.decode(parent.full_ids[-1:].tolist())
        if tail.startswith(end_text):
            bridge = tail[len(end_text) :]
    suffix = renderer.encode(bridge + full_text[len(prefix_text) :])
    prompt = parent.full_ids.tolist() + suffix
    info = {"parent_call": parent.call_id, "suffix_start": len(parent.full_ids), "suffix_tokens": len(suffix)}
    return Stitched(prompt, parent, info)
