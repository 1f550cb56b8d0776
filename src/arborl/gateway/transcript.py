"""A finished chat transcript (OpenAI ``messages`` + ``tools``) -> one training ``Sample``, rendered by
the gateway's own ``ChatRenderer`` (the same template, tool prompt and ``<tool_call>`` format a served
call gets), with loss only on what the assistant wrote.

The layout is the one stitching gives a recorded multi-turn episode: for assistant message i the
prompt is ``render(messages[:i], add_generation_prompt=True)``, the completion is the message's text as
the model would generate it (content, then its tool calls as ``<tool_call>`` blocks) followed by the
end-of-turn token, and the template's text after that token (ChatML's ``\\n``) is the bridge into the
next prompt. Completion tokens carry loss (mask 1, advantage 1); system, user and tool text, the tool
prompt, role headers and bridges do not. The whole transcript is one sample, so transcripts of one task
share their prompt in the trainer's prefix tree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from arborl.gateway.errors import BadRequestError
from arborl.gateway.render import ChatRenderer, digest, normalize_messages, tools_key
from arborl.types import Sample


def transcript_pieces(renderer: ChatRenderer, messages: Sequence[dict[str, Any]],
                      tools: list[dict[str, Any]] | None) -> list[tuple[str, bool]]:
    """(text, trained) pieces whose concatenation is the transcript as rendered up to its last
    assistant message's end-of-turn token. Raises BadRequestError for messages the renderer rejects,
    a transcript without an assistant message, or a template that is not prefix-stable."""
    msgs = normalize_messages(list(messages))
    eos = getattr(renderer.tokenizer, "eos_token", None) or ""
    pieces: list[tuple[str, bool]] = []
    done = ""  # the text covered so far
    for i, m in enumerate(msgs):
        if m["role"] != "assistant":
            continue
        prompt = renderer.render(msgs[:i], tools, add_generation_prompt=True)
        full = renderer.render(msgs[: i + 1], tools, add_generation_prompt=False)
        if not prompt.startswith(done) or not full.startswith(prompt):
            raise BadRequestError(
                f"messages[{i}]: the chat template does not render this transcript prefix-stably (an earlier "
                "turn renders differently once later messages follow), so its tokens cannot match a served episode",
                param="messages")
        reply = full[len(prompt):]
        tail = renderer.turn_tail(msgs[:i], tools, cached=True) or ""
        body, rest = (reply[: len(reply) - len(tail)], tail) if tail and reply.endswith(tail) else (reply, "")
        if rest and eos and rest.startswith(eos):  # the end-of-turn token is generated; what follows is the bridge
            body, rest = body + eos, rest[len(eos):]
        pieces += [(prompt[len(done):], False), (body, True)]
        done = prompt + body
        if rest:
            pieces.append((rest, False))
            done += rest
    if not any(trained for _, trained in pieces):
        raise BadRequestError("the transcript has no assistant message: nothing to train on", param="messages")
    while pieces and not pieces[-1][1]:
        pieces.pop()  # text after the last end-of-turn token carries no loss
    return pieces


def transcript_sample(renderer: ChatRenderer, messages: Sequence[dict[str, Any]],
                      tools: list[dict[str, Any]] | None = None, *, sample_id: str = "") -> Sample:
    """One Sample of ``messages``: token ids, loss mask 1 on the assistant's tokens (advantage 1 there),
    chunk ids counting assistant turns. ``group_id`` names the transcript's prompt (tools and the
    messages before the first assistant turn), so transcripts of one task pack as one prefix tree."""
    ids: list[int] = []
    mask: list[int] = []
    chunks: list[int] = []
    turn = 0
    for text, trained in transcript_pieces(renderer, messages, tools):
        toks = renderer.encode(text)
        ids += toks
        mask += [int(trained)] * len(toks)
        chunks += [turn] * len(toks)
        turn += int(trained)
    msgs = list(messages)
    first = next(i for i, m in enumerate(msgs) if m.get("role") == "assistant")
    group = digest(tools_key(tools), *(str(m.get("content")) for m in msgs[:first]))
    n = len(ids)
    return Sample(episode_id=sample_id or digest(group, str(n), *(str(t) for t in ids[-8:])), group_id=group,
                  token_ids=ids, loss_mask=mask, rollout_logprobs=[0.0] * n, versions=[-1] * n, chunk_ids=chunks,
                  advantages=[1.0] * n, reward=1.0)
