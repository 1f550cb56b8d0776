"""Token faithfulness, audited (X4, `arborl audit RUN`): every recorded chat call's conversation is rendered
again with the chat template and compared with the token ids the engine consumed (which are the ids
the trainer uses: the data pool holds exactly those).

Two counts per run:

* **drift**: the re-rendered conversation's ids differ from the ids the engine consumed or produced:
  the call's prompt, or the earlier calls' tokens it continues. A model whose output does not
  re-tokenize to itself (a tool call the template re-renders with other spacing, a stop string
  cutting a token) drifts. With stitching on (``gateway.stitching``) the engine was given the policy's
  own earlier tokens anyway, so such a call is drifted but still faithful; re-tokenizing frameworks
  train on the re-rendered ids instead, off the policy.
* **unfaithful** (a subset): the call's prompt does not extend the tokens an earlier call of the
  episode produced (stitching off or impossible, or the agent rewrote its history). The gateway
  notes these as they happen (``call.meta["drift"]``) with a reason, which the report counts:
  ``stitching_off``, ``prompt_tokens_diverge`` (re-tokenized: the policy is trained on a history it did not
  generate), or the agent's own edits (``assistant_message_missing``: mini-swe-agent drops a reply
  that broke its format; ``message_edited``, ``history_truncated``, ``tools_changed``).
  ``retokenized_calls`` counts the calls whose re-render differs from their own prompt ids.

A chat call is audited when its request was recorded (``gateway.record_messages``); token-in and
completions calls have no conversation to re-render and are counted as such.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from arborl.gateway.render import ChatRenderer
from arborl.types import Call, Episode

WINDOW = 8  # tokens shown on each side of a first difference


@dataclass
class CallAudit:
    call_id: str
    episode_id: str
    drift: bool
    unfaithful: bool
    stitched: bool
    position: int | None = None  # first differing token position
    engine_ids: list[int] = field(default_factory=list)  # the engine's ids from there (WINDOW)
    rerender_ids: list[int] = field(default_factory=list)  # the re-render's ids from there


@dataclass
class AuditReport:
    calls: int = 0
    audited: int = 0  # chat calls whose request was recorded
    not_recorded: int = 0  # chat calls recorded without their messages (gateway.record_messages off)
    token_calls: int = 0  # token-in / completions calls: nothing to re-render
    drift_calls: int = 0
    retokenized_calls: int = 0  # the re-render differs from the call's own prompt ids
    unfaithful_calls: int = 0
    unfaithful_reasons: dict[str, int] = field(default_factory=dict)  # the gateway's reason for each
    examples: list[CallAudit] = field(default_factory=list)  # the first drifted / unfaithful calls

    @property
    def drift_rate(self) -> float:
        return self.drift_calls / self.audited if self.audited else 0.0

    @property
    def unfaithful_rate(self) -> float:
        return self.unfaithful_calls / self.calls if self.calls else 0.0

    def summary(self) -> dict[str, Any]:
        return {"calls": self.calls, "audited": self.audited, "not_recorded": self.not_recorded,
                "token_calls": self.token_calls, "drift_calls": self.drift_calls, "drift_rate": self.drift_rate,
                "retokenized_calls": self.retokenized_calls, "unfaithful_calls": self.unfaithful_calls,
                "unfaithful_rate": self.unfaithful_rate, "unfaithful_reasons": dict(self.unfaithful_reasons),
                "examples": [asdict(e) for e in self.examples]}


def call_drifted(call: Call) -> bool:
    """What the gateway noted while serving: the re-render differed where it stitched, or the prompt did
    not extend the earlier tokens (the step metric ``drift_calls`` counts these)."""
    stitch = call.meta.get("stitch") or {}
    return stitch.get("retokenized_diff_at") is not None or bool(call.meta.get("drift"))


def audit_call(renderer: ChatRenderer, call: Call) -> CallAudit | None:
    """The call re-rendered from its recorded request, or None when it has none to re-render."""
    request = call.meta.get("request")
    if not isinstance(request, dict) or "messages" not in request:
        return None
    ids = renderer.encode(renderer.render(request["messages"], request.get("tools"), add_generation_prompt=True))
    got = list(call.prompt_token_ids)
    n = 0
    while n < min(len(ids), len(got)) and ids[n] == got[n]:
        n += 1
    drift = not (n == len(ids) == len(got))
    return CallAudit(call.call_id, call.episode_id, drift, bool(call.meta.get("drift")), "stitch" in call.meta,
                     n if drift else None, got[n:n + WINDOW] if drift else [], ids[n:n + WINDOW] if drift else [])


def _against_earlier(call: Call, by_id: dict[str, Call], a: CallAudit) -> CallAudit:
    """An unfaithful call whose prompt is the re-render: the difference is with the tokens the earlier
    call produced (the gateway's drift event names it and the position)."""
    ev = call.meta["drift"]
    earlier = by_id.get(ev.get("against_call", ""))
    n = int(ev.get("position", 0))
    produced = list(earlier.prompt_token_ids) + list(earlier.completion_token_ids) if earlier else []
    return CallAudit(a.call_id, a.episode_id, True, True, a.stitched, n, produced[n:n + WINDOW],
                     list(call.prompt_token_ids[n:n + WINDOW]))


def audit_episodes(renderer: ChatRenderer, episodes: Iterable[Episode], *, examples: int = 5) -> AuditReport:
    """A call drifts when its re-render differs from the ids the engine consumed, or when those ids do not
    extend what an earlier call of the episode produced (unfaithful: the re-render replaced the policy's
    own tokens)."""
    report = AuditReport()
    for ep in episodes:
        by_id = {c.call_id: c for c in ep.calls}
        for call in ep.calls:
            report.calls += 1
            unfaithful = bool(call.meta.get("drift"))
            report.unfaithful_calls += unfaithful
            if unfaithful:
                why = str(call.meta["drift"].get("reason", "prompt_tokens_diverge"))
                report.unfaithful_reasons[why] = report.unfaithful_reasons.get(why, 0) + 1
            if call.meta.get("endpoint") != "chat" or call.meta.get("input") == "tokens":
                report.token_calls += 1
                continue
            a = audit_call(renderer, call)
            if a is None:
                report.not_recorded += 1
                continue
            report.retokenized_calls += a.drift
            if unfaithful and not a.drift:
                a = _against_earlier(call, by_id, a)
            report.audited += 1
            report.drift_calls += a.drift
            if a.drift and len(report.examples) < examples:
                report.examples.append(a)
    return report
