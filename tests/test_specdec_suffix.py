"""Suffix drafts: n-gram matching over token stores, frequency-scored single path and top-k
multi-path, group stores fed from several threads at once, LRU of groups; the bench's paired tau. A few seconds."""

from __future__ import annotations

import threading

import torch

from arborl.config import SpecConfig
from arborl.engine.sequence import Sequence
from arborl.engine.specdec.draft import Draft
from arborl.engine.specdec.suffix import GroupStores, SuffixDrafter, TokenStore, draft_paths
from arborl.models import tiny_llama
from arborl.types import GenerateRequest, SamplingParams


def seq(tokens: list[int], rid: str, group: str = "") -> Sequence:
    return Sequence(GenerateRequest(list(tokens), SamplingParams(), request_id=rid, group_id=group), torch.Generator(), 0)


def test_longest_match_votes_and_frequency_path():
    store = TokenStore(n=2)
    store.extend("a", [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4, 5, 8])
    # context ends in 1 2 3: the occurrences matching 3 tokens (two of them) vote, not the 2-token one (9 2 3)
    conts = store.continuations([0, 1, 2, 3], k=3, max_match=8)
    assert conts == [[4, 5, 8], [4, 5, 9]]
    assert draft_paths(conts, 3, 1, 0.1) == [[4, 5, 8]]  # ties at depth 3 go to the most recent
    assert draft_paths(conts, 3, 1, 0.6) == [[4, 5]]  # min_prob: 1/2 at depth 3 is below 0.6
    # max_match caps how far a match extends back: then 9 2 3 counts as long as 1 2 3
    assert len(store.continuations([0, 1, 2, 3], k=3, max_match=2)) == 3
    assert store.continuations([7, 7], k=3, max_match=8) == []  # no occurrence
    assert TokenStore(n=3).continuations([1, 2], k=3, max_match=8) == []  # shorter than min_match


def test_multipath_top_k_tree():
    conts = [[4, 5, 6], [4, 5, 6], [4, 7, 7], [8, 1, 1]]
    paths = draft_paths(conts, 3, 3, 0.0)
    assert paths == [[4, 5, 6], [4, 7, 7], [8, 1, 1]]
    d = Draft.from_paths(paths)
    assert d.tokens == [4, 5, 6, 7, 7, 8, 1, 1] and d.parents == [-1, 0, 1, 0, 3, -1, 5, 6]
    assert d.depth() == 3 and len(d.truncated(1)) == 2 and d.truncated(2).parents == [-1, 0, 0, -1, 3]
    cut = d.ending_at({5})  # 5 ends the sequence: its child 6 goes, the sibling path 4 7 7 stays
    assert cut.tokens == [4, 5, 7, 7, 8, 1, 1] and cut.parents == [-1, 0, 0, 2, -1, 4, 5]
    assert d.ending_at({9}) is d and d.ending_at({8}).tokens == [4, 5, 6, 7, 7, 8]


def test_group_members_draft_from_siblings_and_self_only_does_not():
    cfg = SpecConfig(enabled=True, min_match=2)
    sibling = [10, 11, 12, 13, 14, 15, 16, 17]
    for group_trees, expect in ((True, [14, 15, 16]), (False, [])):
        d = SuffixDrafter(cfg.model_copy(update={"group_trees": group_trees}), GroupStores(4))
        done = seq([1, 2] + sibling, "s0", "g")
        d.sync(done)
        d.release(done)
        me = seq([1, 2, 10, 11, 12, 13], "s1", "g")
        d.sync(me)
        assert d.propose([me], 3)[0].tokens == expect


def test_a_shared_prompt_is_indexed_once_and_members_answers_outvote_its_example():
    """Members of a group share their prompt: its n-grams are indexed for the first member only (the
    match still extends back through every member's copy), so a worked example in the prompt counts
    once while each member's own answer after the same words counts once per member."""
    example = [5, 1, 2, 3, 7, 8]  # the prompt's worked example: after 1 2 3 comes 7 8
    stores = GroupStores(4)
    d = SuffixDrafter(SpecConfig(enabled=True, min_match=2), stores)
    for m in range(3):  # three members answered 1 2 3 -> 9 9
        s = seq(example, f"m{m}", "g")
        s.output.extend([4, 1, 2, 3, 9, 9])
        d.sync(s)
        d.release(s)
    me = seq(example, "me", "g")
    me.output.extend([6, 1, 2, 3])
    d.sync(me)
    store = stores.get("g", 2)
    assert len(store.index[(1, 2)]) == 1 + 3 + 1  # the prompt once, each answer, me
    assert len(store.index[(8, 4)]) == 3  # where the members' streams leave the shared prompt
    # the prompt (once) votes 7 8, the three members 9 9, at the same match length (3 tokens)
    assert d.propose([me], 2)[0].tokens == [9, 9]
    # every member's stream keeps its whole prompt: a match reaching back into it still extends
    assert store.continuations(example + [4, 1, 2, 3], 2, 16) == [[9, 9]] * 3
    # a stream with no prefix in common is indexed in full
    store.extend("other", [2, 3, 7])
    assert len(store.index[(2, 3)]) == 1 + 3 + 1 + 1
    # a multi-turn episode: turn 2's prompt holds turn 1 (prompt, answer) and an observation
    turns = TokenStore(n=2)
    turns.extend("t1", [1, 2, 3, 4], prompt_len=2)
    turns.extend("t2", [1, 2, 3, 4, 9, 8, 7], prompt_len=6)
    assert len(turns.index[(1, 2)]) == 1 and len(turns.index[(2, 3)]) == 1  # turn 1 once
    assert len(turns.index[(3, 4)]) == 2 and turns.continuations([3, 4], 2, 16) == [[9, 8]]  # where they part


def test_group_store_fed_concurrently_from_threads():
    """Several engines (threads) feed one group's store at once: every n-gram is indexed exactly once."""
    stores = GroupStores(4)
    drafters = [SuffixDrafter(SpecConfig(enabled=True, min_match=2), stores) for _ in range(4)]
    streams = {f"m{i}": torch.randint(0, 20, (2000,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(8)}

    def feed(worker: int) -> None:
        d = drafters[worker]
        for rid in list(streams)[worker::4]:
            s = seq(streams[rid][:1], rid, "grp")
            for t in streams[rid][1:]:
                s.output.append(t)
                d.sync(s)
                d.propose([s], 3)  # readers interleave with writers

    threads = [threading.Thread(target=feed, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = stores.get("grp", 2)
    assert store.streams == streams
    want: dict[tuple, int] = {}
    for s in streams.values():
        for i in range(len(s) - 1):
            want[tuple(s[i : i + 2])] = want.get(tuple(s[i : i + 2]), 0) + 1
    assert {k: len(v) for k, v in store.index.items()} == want


def test_group_stores_keep_the_most_recent_groups():
    stores = GroupStores(max_groups=2)
    a = stores.get("a", 2)
    stores.get("b", 2)
    assert stores.get("a", 2) is a  # a used again: b is now the oldest
    stores.get("c", 2)
    assert len(stores) == 2 and stores.get("a", 2) is a
    assert stores.get("b", 2) is not None and len(stores.get("b", 2).streams) == 0  # b was dropped


def test_prompt_lookup_adds_the_requests_own_most_recent_continuation_beside_the_groups_vote():
    """Three siblings wrote ``a b -> x y z``; this request's own text (a file it read) has ``a b -> p q r``
    last. The group's vote drafts x y z; prompt lookup adds p q r as a second path of the tree; without a
    group (or with group_trees off) the own store is the draft store and lookup adds its latest match."""
    a, b = 50, 51
    cfg = SpecConfig(enabled=True, min_match=2)
    for knob, expect in ((False, [[60, 61, 62]]), (True, [[60, 61, 62], [70, 71, 72]])):
        d = SuffixDrafter(cfg.model_copy(update={"prompt_lookup": knob}), GroupStores(4))
        for i in range(3):
            done = seq([10 + i, 2, a, b, 60, 61, 62, 9], f"s{i}", "g")  # prompts that differ: each indexed
            d.sync(done)
            d.release(done)
        me = seq([3, 4, a, b, 70, 71, 72, 5, a, b], "me", "g")
        d.sync(me)
        draft = d.propose([me], 3)[0]
        assert draft.depth() == 3 and len(draft) == 3 * len(expect)
        want = Draft.from_paths(expect)
        assert (draft.tokens, draft.parents) == (want.tokens, want.parents)
        d.release(me)
        assert "me" not in d._own  # a finished request's own store goes with it
    # own tokens only: the vote over its two occurrences and lookup's most recent one agree, no duplicate path
    d = SuffixDrafter(cfg.model_copy(update={"prompt_lookup": True, "group_trees": False}), GroupStores(4))
    me = seq([a, b, 70, 71, 72, 5, a, b], "solo")
    d.sync(me)
    assert d.propose([me], 3)[0].tokens == [70, 71, 72]


def test_suffix_knobs_change_the_drafts():
    stream = [1, 2, 3, 4, 5, 9, 2, 3, 4, 6, 7, 1, 2, 3, 4, 5, 8]

    def propose(ctx: list[int], **knobs) -> list[int]:
        d = SuffixDrafter(SpecConfig(enabled=True, group_trees=False, **knobs), GroupStores(2))
        s = seq(stream + ctx, "q")
        d.sync(s)
        return d.propose([s], 3)[0].tokens

    assert propose([0, 1, 2, 3]) == [4, 5, 8]
    assert propose([0, 1, 2, 3], min_prob=0.6) == [4, 5]
    assert propose([0, 9, 2, 3], max_match=2) == [4, 5, 8]  # 2-token matches everywhere: the frequent path
    assert propose([0, 9, 2, 3]) == [4, 6, 7]  # the longest match (9 2 3) decides
    assert propose([0, 2, 3], min_match=3, fallback_tokens=0) == []  # "2 3" is too short a match
    assert len(propose([0, 1, 2, 3], num_paths=3)) > 3  # a tree with the other continuations


def test_paired_tau_measures_every_variant_on_the_same_streams():
    """The bench's tau: the three variants draft on the same sampled streams; references of the group
    raise it, multi-path more (tiny model, vocab 16, so that siblings share n-grams)."""
    from arborl_bench.specdec_bench import paired_tau, references
    from arborl.models.loading import LoadedModel

    model = tiny_llama(layers=2, hidden=32, vocab=16, heads=4, kv_heads=2, seed=5, init_std=0.6)
    loaded = LoadedModel(model, None, "tiny", [15], 16, 2048)
    prompts, params = [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7, 6, 5, 4]], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    stores = GroupStores(64)
    references(loaded, prompts, params, stores, "g")
    tau = paired_tau(loaded, prompts, 2, params, stores, "g")
    assert tau["positions"] == 2 * 2 * 12  # every second of the 23 decode positions of 4 streams
    assert tau["group"] > tau["self"] + 0.2 and tau["group_multipath"] > tau["group"]


def test_fallback_drafts_from_the_last_token_only_for_a_clear_favourite():
    def propose(stream: list[int], **knobs) -> list[int]:
        d = SuffixDrafter(SpecConfig(enabled=True, group_trees=False, min_match=2, **knobs), GroupStores(2))
        s = seq(stream, "q")
        d.sync(s)
        return d.propose([s], 4)[0].tokens

    clear = [4, 5, 1, 4, 5, 1, 4, 6, 3, 99, 4]  # "99 4" never occurred; 4 was followed by 5, 5, 6
    assert propose(clear) == [5]  # one token (fallback_tokens=1), 5 has 2/3 of the votes
    assert propose(clear, fallback_tokens=2) == [5, 1]  # "4 5" was followed by 1 twice: 2/3 x 1 >= 0.3
    assert propose(clear, fallback_tokens=0) == []
    split = [7, 10, 7, 11, 7, 12, 7, 13, 99, 7]  # 7 was followed by four tokens, 1/4 each
    assert propose(split) == []
    assert propose([4, 5, 1, 4, 5]) == [1, 4, 5]  # an ordinary 2-token match ("4 5"): k tokens, not 1
