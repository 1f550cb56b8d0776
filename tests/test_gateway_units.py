"""Gateway building blocks without a server: tool-call parsing, streamed text, rendering,
token stitching, drift, and the per-episode sample view. Real SmolLM2 tokenizer throughout."""

from __future__ import annotations

import copy
import json
import os
import string
from array import array

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arborl.config import ModelConfig
from arborl.gateway.errors import BadRequestError
from arborl.gateway.protocol import ChatCompletionRequest, parse, parse_json
from arborl.gateway.render import ChatRenderer, canonical, normalize_messages
from arborl.train.samples import episode_samples
from arborl.gateway.stitching import CallRecord, SessionHistory, Stitched, common_prefix_len, message_chain, stitch_chat
from arborl.gateway.textstream import TextStreamer, completion_text
from arborl.gateway.toolcalls import format_tool_call, markup_start, parse_tool_calls
from arborl.models import chat_token_ids, load_model
from arborl.types import Call

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.fixture(scope="module")
def tok():
    return load_model(ModelConfig(source="tiny", tiny_tokenizer="smollm2", tiny_layers=1, tiny_hidden=16)).tokenizer


EOS = 2  # <|im_end|> in SmolLM2's vocabulary

# ------------------------------------------------------------------ tool calls


def test_tool_call_blocks_parse_and_keep_surrounding_text():
    text = 'Let me add.\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n' \
           '<tool_call>{"name": "mul", "arguments": "{\\"x\\": 3}"}</tool_call>'
    out = parse_tool_calls(text, {"add", "mul"})
    assert out.errors == [] and out.content == "Let me add."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("add", {"a": 1, "b": 2}), ("mul", {"x": 3})]
    assert all(c.id.startswith("call_") for c in out.tool_calls)


def test_unclosed_last_block_and_json_fallback():
    out = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', {"add"})
    assert out.content is None and out.tool_calls[0].name == "add"
    out = parse_tool_calls('```json\n{"name": "add", "arguments": {"a": 5}}\n```', {"add"})
    assert out.content is None and json.loads(out.tool_calls[0].arguments) == {"a": 5}
    out = parse_tool_calls('[{"name": "add", "parameters": {"a": 1}}, {"name": "add", "arguments": {}}]', {"add"})
    assert len(out.tool_calls) == 2 and out.errors == []
    # a JSON answer that is not a call shape is just content
    assert parse_tool_calls('{"answer": 5}', {"add"}).tool_calls == []
    assert parse_tool_calls('{"answer": 5}', {"add"}).content == '{"answer": 5}'


@pytest.mark.parametrize(
    "text, reason",
    [
        ("<tool_call>{not json}</tool_call>", "not valid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "non-empty string 'name'"),
        ('<tool_call>{"name": "rm", "arguments": {}}</tool_call>', "unknown tool 'rm'"),
        ('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "add", "arguments": "{oops"}</tool_call>', "arguments string is not valid JSON"),
        ('{"name": "add", "arguments": {"a": 1}', "not valid JSON"),
    ],
)
def test_malformed_tool_calls_stay_content_and_are_counted(text, reason):
    out = parse_tool_calls(text, {"add"})
    assert out.tool_calls == [] and len(out.errors) == 1 and reason in out.errors[0]
    assert out.content == text.strip()


def test_one_malformed_block_does_not_spoil_the_valid_one():
    text = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call> and <tool_call>{bad}</tool_call>'
    out = parse_tool_calls(text, {"add"})
    assert len(out.tool_calls) == 1 and len(out.errors) == 1 and out.content == "and <tool_call>{bad}</tool_call>"


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


@SETTINGS
@given(name=st.text(string.ascii_letters + "_", min_size=1, max_size=12),
       args=st.dictionaries(st.text(max_size=6), json_values, max_size=4),
       before=st.text(max_size=20), after=st.text(max_size=20))
def test_format_then_parse_round_trips(name, args, before, after):
    text = before + format_tool_call(name, args) + after
    out = parse_tool_calls(text, {name})
    if "<tool_call>" in before or "<tool_call>" in after or "</tool_call>" in before:
        return  # the surrounding text itself contains markup; covered by the never-raises test
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [(name, args)]
    assert out.errors == []


@SETTINGS
@given(st.lists(st.sampled_from(list('<>/{}[]"`:,ntool_calnme ') + ["<tool_call>", "</tool_call>", '"name"']), max_size=30))
def test_parse_never_raises_and_markup_start_is_a_real_prefix(parts):
    text = "".join(parts)
    out = parse_tool_calls(text, {"add"})
    assert isinstance(out.errors, list)
    m = markup_start(text)
    if m is not None:
        assert "<tool_call>".startswith(text[m : m + 11]) or text[m:].startswith("<tool_call>")


# ------------------------------------------------------------------ streamed text


pieces = st.sampled_from([
    "Hello", " world", "\n", "  ", "é", "日本", "🙂", "<tool_call>", "</tool_call>", '{"name": "add", ',
    '"arguments": {"a": 1}}', "{", "[", "```", "STOP", "ST", "<|im_end|>", " 42", "<", "tool",
])


@SETTINGS
@given(parts=st.lists(pieces, min_size=1, max_size=12), tools=st.booleans(),
       stops=st.lists(st.sampled_from(["STOP", "\n\n", "world"]), max_size=2, unique=True),
       raw_tail=st.lists(st.integers(0, 49151), max_size=3))
def test_streamed_deltas_add_up_to_the_final_content(tok, parts, tools, stops, raw_tail):
    ids = tok.encode("".join(parts), add_special_tokens=False) + raw_tail  # raw ids: partial UTF-8 too

    def decode(x):
        return tok.decode(list(x), skip_special_tokens=True, clean_up_tokenization_spaces=False)

    text = completion_text(decode, ids, {EOS}, stops)
    final = parse_tool_calls(text, {"add"}).content if tools else text
    s = TextStreamer(decode, {EOS}, stops, tools=tools)
    streamed = "".join(s.push(t) for t in ids)
    assert (final or "").startswith(streamed)
    streamed += s.flush(final)
    assert streamed == (final or "")
    for stop in stops:
        assert stop not in streamed


def test_completion_text_drops_the_end_token_and_cuts_at_the_stop_string(tok):
    def decode(x):
        return tok.decode(list(x), skip_special_tokens=True)

    ids = tok.encode("abc STOP def", add_special_tokens=False)
    assert completion_text(decode, ids + [EOS], {EOS}, ["STOP"]) == "abc "
    assert completion_text(decode, ids + [EOS], {EOS}, []) == "abc STOP def"


# ------------------------------------------------------------------ rendering


def test_rendering_without_tools_is_the_templates_own_tokenization(tok):
    r = ChatRenderer(tok)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "more"}]}]
    norm = normalize_messages(msgs)
    plain = [{"role": m["role"], "content": m["content"]} for m in norm]
    assert r.encode(r.render(norm, None, add_generation_prompt=True)) == chat_token_ids(tok, plain)


def test_tools_go_into_the_system_prompt_for_templates_that_ignore_them(tok):
    r = ChatRenderer(tok)
    assert not r.native_tools
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    msgs = normalize_messages([
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                              "function": {"name": "add", "arguments": '{"a":2,"b":3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
    ])
    text = r.render(msgs, tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou may call one or more tools")
    assert '"name": "add"' in text and "<tool_call>" in text
    assert '<|im_start|>assistant\n<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>' in text
    assert "<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n" in text


def test_native_tool_templates_get_the_tools_themselves(tok):
    t = copy.deepcopy(tok)
    t.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{{ tools | map(attribute='function') | map(attribute='name') | join(',') }}"
        "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}"
        "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    r = ChatRenderer(t)
    assert r.native_tools
    tools = [{"type": "function", "function": {"name": "add"}}]
    text = r.render(normalize_messages([{"role": "user", "content": "x"}]), tools, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nTOOLS:add<|im_end|>") and "You may call" not in text


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "non-empty list"),
        ([{"role": "robot", "content": "x"}], "messages[0].role is 'robot'"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "reads text only"),
        ([{"role": "user", "content": "x", "tool_calls": [{}]}], "only assistant messages do"),
        ([{"role": "assistant", "tool_calls": [{"function": {}}]}], "messages[0].tool_calls[0] must look like"),
    ],
)
def test_bad_messages_say_what_to_fix(messages, fragment):
    with pytest.raises(BadRequestError) as e:
        normalize_messages(messages)
    assert fragment in e.value.message


def test_request_validation_names_fields():
    with pytest.raises(BadRequestError, match=r"temperature: .*greater than or equal to 0.*got -1"):
        parse(ChatCompletionRequest, {"messages": [], "temperature": -1})
    with pytest.raises(BadRequestError, match=r"n: .*got \"many\""):
        parse(ChatCompletionRequest, {"n": "many"})
    with pytest.raises(BadRequestError, match="not valid JSON at line 1 column 2"):
        parse_json(b"{oops")
    with pytest.raises(BadRequestError, match="must be a JSON object"):
        parse(ChatCompletionRequest, [1, 2])


# ------------------------------------------------------------------ stitching


def _record(call_id, prompt, completion, msgs=None, tools=None, reply=None, ends_turn=True):
    full = array("i", prompt + completion)
    chain = message_chain(msgs, tools) if msgs is not None else None
    key = canonical(normalize_messages([reply])[0]) if reply else None
    return CallRecord(call_id, full, len(prompt), ends_turn, chain, key)


words = st.text(alphabet=string.ascii_letters + string.digits + " .,!?\n{}\"'", min_size=1, max_size=25)


@SETTINGS
@given(turns=st.lists(st.tuples(words, words), min_size=1, max_size=4), system=st.one_of(st.none(), words),
       tool_turn=st.booleans())
def test_stitched_prompts_decode_to_the_template_text(tok, turns, system, tool_turn):
    """Stitching the engine's completions (content + <|im_end|>) onto the history gives exactly the
    text the template renders for the whole conversation: the policy sees the real chat format."""
    r = ChatRenderer(tok)
    hist = SessionHistory()
    msgs: list[dict] = [{"role": "system", "content": system}] if system else []
    tools = [{"type": "function", "function": {"name": "add"}}] if tool_turn else None
    prev = None
    for i, (user, answer) in enumerate(turns):
        msgs.append({"role": "tool" if (tool_turn and i) else "user", "content": user})
        norm = normalize_messages(msgs)
        chain = message_chain(norm, tools)
        full_text = r.render(norm, tools, add_generation_prompt=True)
        if prev is None:
            prompt = r.encode(full_text)
        else:
            found = hist.find_parent(norm, chain)
            assert found is not None and found[0] is prev
            got = stitch_chat(r, found[0], found[1], norm, tools, full_text)
            assert isinstance(got, Stitched)
            prompt = got.prompt_ids
            assert prompt[: len(prev.full_ids)] == prev.full_ids.tolist()
        assert tok.decode(prompt, skip_special_tokens=False) == full_text
        completion = r.encode(answer) + [EOS]
        reply = {"role": "assistant", "content": answer}
        prev = CallRecord(f"c{i}", array("i", prompt + completion), len(prompt), True, chain, canonical(normalize_messages([reply])[0]))
        hist.add(prev)
        msgs.append(reply)


def test_a_cut_completion_gets_the_whole_turn_end_in_the_bridge(tok):
    r = ChatRenderer(tok)
    m1 = normalize_messages([{"role": "user", "content": "hi"}])
    p1 = r.encode(r.render(m1, None, add_generation_prompt=True))
    c1 = r.encode("half an ans")  # finish_reason length: no <|im_end|>
    rec = _record("c1", p1, c1, m1, None, {"role": "assistant", "content": "half an ans"}, ends_turn=False)
    m2 = normalize_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "half an ans"},
                             {"role": "user", "content": "go on"}])
    got = stitch_chat(r, rec, 1, m2, None, r.render(m2, None, add_generation_prompt=True))
    assert isinstance(got, Stitched)
    assert got.prompt_ids[: len(p1) + len(c1)] == p1 + c1
    assert tok.decode(got.prompt_ids[len(p1) + len(c1):]) == "<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n"


def test_drift_reasons_and_first_differing_position(tok):
    r = ChatRenderer(tok)
    hist = SessionHistory()
    m1 = normalize_messages([{"role": "user", "content": "What is the capital of France?"}])
    p1 = r.encode(r.render(m1, None, add_generation_prompt=True))
    c1 = r.encode("Paris.") + [EOS]
    hist.add(_record("c1", p1, c1, m1, None, {"role": "assistant", "content": "Paris."}))

    def drift(msgs, tools=None):
        norm = normalize_messages(msgs)
        ids = r.encode(r.render(norm, tools, add_generation_prompt=True))
        return hist.drift(ids, messages=norm, chain=message_chain(norm, tools)), ids

    ev, ids = drift([{"role": "user", "content": "What is the capital of Spain?"}])
    assert ev["reason"] == "message_edited" and ev["message_index"] == 0 and ev["against_call"] == "c1"
    assert ids[: ev["position"]] == p1[: ev["position"]] and ids[ev["position"]] != p1[ev["position"]]
    ev, ids = drift([{"role": "user", "content": "What is the capital of France?"},
                     {"role": "assistant", "content": "Lyon."}, {"role": "user", "content": "Sure?"}])
    assert ev["reason"] == "assistant_message_edited" and ev["message_index"] == 1
    assert ev["position"] == common_prefix_len(ids, p1 + c1) and ev["position"] >= len(p1)
    ev, _ = drift([{"role": "user", "content": "What is the capital of France?"}, {"role": "user", "content": "?"}])
    assert ev["reason"] == "assistant_message_missing"
    ev, _ = drift(m1, [{"type": "function", "function": {"name": "add"}}])
    assert ev["reason"] == "tools_changed"
    # a prompt that extends the recorded tokens is no drift
    assert hist.drift(p1 + c1 + [5, 6]) is None


# ------------------------------------------------------------------ samples


def _call(eid, prompt, completion, version=0, meta=None, finish="stop"):
    n = len(completion)
    return Call(eid, list(prompt), list(completion), [-0.5] * n, [-0.25] * n, [version] * n, finish, meta=meta or {})


def test_stitched_calls_merge_and_edited_history_splits():
    a = _call("e", [1, 2, 3], [10, 11])
    b = _call("e", [1, 2, 3, 10, 11, 4, 5], [12], version=1)  # extends a: merge
    c = _call("e", [1, 2, 9], [13], meta={"drift": {"position": 2, "reason": "message_edited"}})  # edited: new sample
    d = _call("e", [1, 2, 3, 10, 11, 4, 5, 12, 6], [14], finish="abort")  # aborted: skipped
    s1, s2 = episode_samples([a, b, c, d])
    assert s1.token_ids == [1, 2, 3, 10, 11, 4, 5, 12]
    assert s1.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s1.versions == [-1, -1, -1, 0, 0, -1, -1, 1]
    assert s1.rollout_logprobs == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5]
    assert s1.sample_logprobs == [0, 0, 0, -0.25, -0.25, 0, 0, -0.25]
    assert s1.chunk_ids == [0, 0, 0, 0, 0, 1, 1, 1]
    assert s1.call_ids == [a.call_id, b.call_id] and s1.drift_events == []
    assert s2.token_ids == [1, 2, 9, 13] and s2.chunk_ids == [2] * 4
    assert s2.drift_events == [{"call_id": c.call_id, "position": 2, "reason": "message_edited"}]
    assert len(episode_samples([a, b, c, d], include_aborted=True)) == 2  # d extends s1
    assert s1.advantages == [0.0] * 8  # advantages come with the batch (train.samples.build_samples)


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["extend", "branch", "resample", "fresh"]),
                          st.lists(st.integers(0, 50), min_size=1, max_size=4),
                          st.lists(st.integers(100, 150), min_size=1, max_size=4)), min_size=1, max_size=8))
def test_samples_account_for_every_generated_token_exactly_once(ops):
    calls: list[Call] = []
    for op, suffix, completion in ops:
        if not calls or op == "fresh":
            prompt = suffix
        else:
            last = calls[-1]
            full = last.prompt_token_ids + last.completion_token_ids
            if op == "extend":
                prompt = full + suffix
            elif op == "resample":
                prompt = list(last.prompt_token_ids)
            else:
                prompt = full[: max(1, len(full) // 2)] + [7] + suffix
        calls.append(_call("e", prompt, completion))
    samples = episode_samples(calls)
    for s in samples:
        s.validate()
    assert sum(s.num_generated for s in samples) == sum(len(c.completion_token_ids) for c in calls)
    by_id = {c.call_id: c for c in calls}
    for s in samples:
        pos = 0
        for cid in s.call_ids:  # each merged call: its prompt is the sample so far (+ suffix), then its completion
            c = by_id[cid]
            assert s.token_ids[: len(c.prompt_token_ids)] == c.prompt_token_ids
            assert all(m == 0 for m in s.loss_mask[pos : len(c.prompt_token_ids)])
            end = len(c.prompt_token_ids) + len(c.completion_token_ids)
            assert s.token_ids[len(c.prompt_token_ids) : end] == c.completion_token_ids
            assert all(m == 1 for m in s.loss_mask[len(c.prompt_token_ids) : end])
            pos = end
        assert pos == len(s.token_ids)
    # an "extend" never starts a new sample
    for (op, _, _), c in zip(ops[1:], calls[1:]):
        if op == "extend":
            assert not any(s.call_ids[0] == c.call_id for s in samples)


def test_a_model_without_tokenizer_serves_token_in_token_out(tmp_path):
    import asyncio

    from arborl.config import EngineConfig
    from arborl.datapool import DataPool
    from arborl.engine import AsyncEngine, LLMEngine
    from arborl.engine.pool import EnginePool
    from arborl.gateway import Gateway
    from arborl.models import tiny_llama

    eng = AsyncEngine(LLMEngine(tiny_llama(vocab=64, hidden=16, layers=1), EngineConfig(max_seq_len=32, num_threads=1),
                                eos_token_ids=[63]))
    pool = DataPool(tmp_path / "p.sqlite")
    gw = Gateway(EnginePool([eng]), datapool=pool)

    async def go():
        s = (await gw.create_session()).session
        with pytest.raises(BadRequestError, match="no tokenizer with a chat template: send prompt_token_ids"):
            gw.start_chat(s, {"messages": [{"role": "user", "content": "x"}]})
        with pytest.raises(BadRequestError, match="stop strings need a tokenizer"):
            gw.start_chat(s, {"prompt_token_ids": [1, 2], "stop": ["x"]})
        with pytest.raises(BadRequestError, match="no tokenizer: send token ids"):
            gw.start_completion(s, {"prompt": "text"})
        r = await gw.chat_completion(s, {"prompt_token_ids": [1, 2, 3], "max_tokens": 4, "ignore_eos": True,
                                         "return_token_ids": True, "logprobs": True})
        c = await gw.completion(s, {"prompt": [1, 2, 3], "max_tokens": 4, "ignore_eos": True, "return_token_ids": True,
                                    "temperature": 0})
        return s, r, c

    try:
        s, r, c = asyncio.run(go())
    finally:
        eng.shutdown()
    assert len(r["choices"][0]["token_ids"]) == 4 and r["choices"][0]["message"]["content"] == ""
    assert [x["token"] for x in r["choices"][0]["logprobs"]["content"]] == [f"<{t}>" for t in r["choices"][0]["token_ids"]]
    assert c["choices"][0]["prompt_token_ids"] == [1, 2, 3] and len(pool.calls(s.session_id)) == 2
    pool.close()
