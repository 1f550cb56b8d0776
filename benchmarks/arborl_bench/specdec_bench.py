"""``arborl bench specdec``: speculative decoding in the built-in engine (SmolLM2-135M, CPU).

1. tau (Seer's Table 2 shape): GRPO groups of G = 8 on calculator prompts, temperature 1. Per prompt,
   G - 1 members are generated first (they fill the group's token store), then the measured members
   decode drafting from their own tokens only (``tau_suffix_self``), from the group's store
   (``tau_suffix_group``) and with top-4 multi-path (``tau_suffix_group_multipath``); tau is vLLM's
   mean acceptance length, 1 + accepted / drafts. The reported figures are paired (``paired_tau``: the
   variants draft on the same sampled streams, expected acceptance from the policy's probabilities);
   live decoding samples a different text per variant, so its taus (``tau_live``) mix drafter and text.
2. tail decode: tokens/s of 1-4 such members at a time (the long tail of a rollout) with the group
   suffix drafter, adaptive length, drafting time included, vs plain decoding, alternating A B A B.
   Every row decodes the same ``TAIL_MEMBERS`` members (batch 1: one after another) on a fresh copy of
   the references, so rows differ only in batch size, not in which sampled texts they meet.
   (``tau_group_gain_multipath``: group vs self, both top-4 multi-path.) The same texts are then
   replayed without timing noise (``specdec_ceiling``): ``tail_replay_by_batch`` gives the suffix drafts
   as drafted, only their accepted part (an oracle), and a free drafter of the policy's most likely
   tokens; ``tail_replay_free_rows_by_batch`` gives the same where verify rows cost nothing.
3. batch 32: a whole step's worth of fresh groups (4 x 8), adaptive, vs plain.
4. exactness: greedy tokens identical and max |log-prob difference| (SmolLM2, greedy and sampled drafts);
   a chi-square test of sampled tokens with vs without speculation on a tiny model (vocab 16).
5. simulator: the scheduling bench's Seer-like workload (GPU-class cost model), Seer dispatch plus
   speculative decoding at the measured first-position acceptance of group drafts, against pinned
   dispatch without it (``sim_seer_full_tail_reduction``).
6. draft checkpoint (``engine.spec.draft_model_path``): SmolLM2's first layers saved as a Hugging Face
   checkpoint of their own draft greedy decoding one sequence at a time vs plain
   (``draft_checkpoint_speedup``, ``draft_checkpoint_tau``): the mechanism's cost and exactness, as no
   trained smaller model of SmolLM2's tokenizer is available offline.
7. MTP: two GRPO runs of the job itself on a tiny random Llama (SmolLM2 on 2 CPU cores is too slow for
   >= 10 RL steps here), the mtp drafter's head trained online every step vs frozen at the same start
   (``mtp_tau_online``, ``mtp_tau_frozen``: mean tau of the last 3 steps).
"""

from __future__ import annotations

import io
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from arborl_bench.scheduling_bench import SEER_WORKLOAD
from arborl_bench.specdec_ceiling import RULES, free_rows, position_table, replay
from arborl.config import EngineConfig, ModelConfig, SpecConfig, load_config
from arborl.engine import LLMEngine
from arborl.engine.model_runner import ModelRunner
from arborl.engine.sampling import log_probs
from arborl.engine.specdec import Draft
from arborl.engine.specdec.adaptive import VerifyProfile
from arborl.engine.specdec.suffix import GroupStores, TokenStore, suffix_draft
from arborl.engine.specdec.verify import sampling_logprobs
from arborl.models import LoadedModel, chat_token_ids, load_model, tiny_llama
from arborl.sim import simulate
from arborl.tasks.calculator import EXAMPLE, SYSTEM_PROMPT, make_tasks
from arborl.types import GenerateRequest, SamplingParams

G = 8
MAX_TOKENS = 96
OUT_DIR = Path("runs") / "bench-specdec"
MTP_STEPS = 10  # RL steps of the online / frozen MTP runs
TAIL_MEMBERS = 4  # members decoded per tail row (batch 1, 2, 4: the same members, 4, 2 and 1 waves)
PROFILE = OUT_DIR / "verify_profile.json"  # measured once per run (first adaptive engine), then read


def calculator_prompts(loaded: LoadedModel, n: int) -> list[list[int]]:
    out = []
    for task in make_tasks("train", n, seed=0):
        msgs = [{"role": "system", "content": SYSTEM_PROMPT}, *EXAMPLE, {"role": "user", "content": task.prompt}]
        out.append(chat_token_ids(loaded.tokenizer, msgs))
    return out


def engine(loaded: LoadedModel, *, spec: bool, stores: GroupStores | None = None, **spec_kw) -> LLMEngine:
    spec_kw.setdefault("profile_path", str(PROFILE))
    cfg = EngineConfig(max_batch_size=32, max_seq_len=1024, spec=SpecConfig(enabled=spec, **spec_kw))
    eng = LLMEngine(loaded.model, cfg, eos_token_ids=loaded.eos_token_ids, tokenizer=loaded.tokenizer)
    if spec and stores is not None:
        eng.spec.drafter.groups = stores
    return eng


def member(prompt: list[int], p: int, m: int, group: str, params: SamplingParams) -> GenerateRequest:
    return GenerateRequest(list(prompt), replace(params, seed=1000 * p + m), request_id=f"{group}/m{m}", group_id=group)


def references(loaded: LoadedModel, prompts: list[list[int]], params: SamplingParams, stores: GroupStores, tag: str) -> None:
    # (plain decoding: the references are ordinary samples)
    """The first G - 1 members of each group, decoded (plainly) into the group stores."""
    eng = engine(loaded, spec=True, stores=stores, adaptive=False, num_tokens=1)
    eng.spec.length.max_k = 0  # feed the stores, never draft: the references are ordinary samples
    eng.generate([member(pr, p, m, f"{tag}{p}", params) for p, pr in enumerate(prompts) for m in range(G - 1)])


def tau(loaded: LoadedModel, prompts, measured: int, params: SamplingParams, stores: GroupStores, tag: str, **spec_kw) -> dict:
    eng = engine(loaded, spec=True, stores=stores.copy(), adaptive=False, num_tokens=6, **spec_kw)
    res = eng.generate([member(pr, p, G - 1 + j, f"{tag}{p}", params) for p, pr in enumerate(prompts) for j in range(measured)])
    st = eng.stats_dict()
    decoded = st["generated_tokens"] - len(res)  # the first token of each comes from its prefill
    return {"tau": st["spec_mean_acceptance_length"], "acceptance_rate": st["spec_acceptance_rate"],
            "per_pos": st["spec_acceptance_per_position"], "tokens": sum(len(r.token_ids) for r in res),
            # tokens per sequence and decode step, steps where nothing was drafted included (count 1)
            "tokens_per_seq_step": decoded / max(1, eng.stats.batch_size_sum)}


@torch.inference_mode()
def paired_tau(loaded: LoadedModel, prompts, measured: int, params: SamplingParams, stores: GroupStores, tag: str,
               k: int = 6, stride: int = 2) -> dict:
    """tau of the three suffix variants on the *same* token streams: the measured members are sampled
    once (plain decoding); at every ``stride``-th decode position each variant drafts from what it would
    hold there (self: the member's own tokens so far; group: the G - 1 references too), and one verify
    forward per stream (every draft tree hung off its position of the stream) gives the policy's
    probabilities. Under rejection sampling a draft node is reached with the product of p along its
    path, so tau = 1 + E[accepted] = 1 + sum over nodes of that product, averaged over positions.
    Paired: the variants differ only in what they draft, not in which text they meet."""
    cfg = SpecConfig()
    variants = {"self": 1, "group": 1, "self_multipath": 4, "group_multipath": 4}  # name -> paths
    plain = engine(loaded, spec=False)
    res = plain.generate([member(pr, p, G - 1 + j, f"{tag}{p}", params) for p, pr in enumerate(prompts) for j in range(measured)])
    runner = ModelRunner(loaded.model, slots=1, max_len=8192)
    stop = frozenset(loaded.eos_token_ids)
    total = {v: 0.0 for v in variants}
    positions = 0
    for r in res:
        stream = r.prompt_token_ids + r.token_ids
        own, grp = TokenStore(cfg.min_match), stores.get(r.request_id.split("/")[0], cfg.min_match).copy()
        start = len(r.prompt_token_ids) + 1  # the first token comes from the prefill, drafts start after it
        own.extend("me", stream[:start], len(r.prompt_token_ids))
        grp.extend("me", stream[:start], len(r.prompt_token_ids))
        tokens, parents = list(stream), list(range(-1, len(stream) - 1))
        drafts: list[tuple[str, int, Draft]] = []  # variant, offset of its nodes, draft
        for n in range(start, len(stream)):
            if (n - start) % stride == 0:
                positions += 1
                for v, paths in variants.items():
                    # as the engine's decoder: nothing after a stop token is drafted (it could not be emitted)
                    d = suffix_draft(own if v.startswith("self") else grp, stream[:n], k, cfg, paths).ending_at(stop)
                    drafts.append((v, len(tokens), d))
                    tokens += d.tokens
                    parents += [n - 1 if q < 0 else len(tokens) - len(d) + q for q in d.parents]
            own.extend("me", stream[n : n + 1])
            grp.extend("me", stream[n : n + 1])
        logits = runner.verify([(0, 0, tokens, parents)])[0, : len(tokens)]
        logp = sampling_logprobs(logits.float(), params)
        for v, off, d in drafts:
            reach: list[float] = []
            for i, (tok, q) in enumerate(zip(d.tokens, d.parents)):
                row = parents[off + i]
                reach.append(float(logp[row, tok].exp()) * (reach[q] if q >= 0 else 1.0))
            total[v] += sum(reach)
    per = positions or 1
    return {v: 1.0 + t / per for v, t in total.items()} | {"positions": positions, "tokens": sum(len(r.token_ids) for r in res)}


def tail_members(prompts: list[list[int]], rep: int, n: int, tag: str, params: SamplingParams) -> list[GenerateRequest]:
    """Round ``rep``'s tail members: member i takes prompt i mod P and a seed set by (rep, i) only,
    distinct from the references' (m < G)."""
    return [member(prompts[i % len(prompts)], i % len(prompts), G + 10 * rep + i, f"{tag}{i % len(prompts)}", params)
            for i in range(n)]


def tokens_per_s(eng: LLMEngine, reqs: list[GenerateRequest]) -> tuple[float, int]:
    busy0, tok0 = eng.stats.busy_s, eng.stats.generated_tokens
    eng.generate(reqs)
    return (eng.stats.generated_tokens - tok0) / (eng.stats.busy_s - busy0), eng.stats.generated_tokens - tok0


def speed(loaded, prompts, batch: int, reps: int, params, stores, tag: str, *, fresh_groups: bool,
          members: int = 0) -> dict:
    """tokens/s with the adaptive group suffix drafter vs plain (one engine, speculation on / off), A B B A.
    ``fresh_groups``: ``batch`` members of new groups at once. Otherwise the tail: ``members`` (>= batch) later members of the reference
    groups, the same ones whatever ``batch``, decoded ``batch`` at a time, each round on a fresh copy of
    the reference stores (so a row neither sees the members an earlier row decoded nor depends on one
    sampled text: at temperature 1 a single member may ramble where no sibling has a match)."""
    # one engine, speculation switched on and off between runs: two engine instances (each with its own
    # prepacked weights and KV cache) decoded up to ~15% apart on this machine with no speculation at all
    eng = engine(loaded, spec=True, stores=stores.copy(), num_tokens=6)
    decoder = eng.spec
    # warm-up at this batch size first: the first forwards of a new shape pay one-time kernel set-up,
    # which would otherwise land on whichever mode is timed first
    warm = replace(params, max_tokens=4)
    for on in (True, False):
        eng.spec = decoder if on else None
        eng.generate([member(prompts[i % len(prompts)], i, i, f"warm-{tag}{batch}-{i}-{on}", warm) for i in range(batch)])
    a, b, rounds = [], [], []
    for rep in range(reps):
        if fresh_groups:
            waves = [[member(pr, p, m, f"{tag}{rep}-{p}", params) for p, pr in enumerate(prompts) for m in range(G)][:batch]]
        else:
            decoder.drafter.groups = stores.copy()
            reqs = tail_members(prompts, rep, max(members, batch), tag, params)
            waves = [reqs[j : j + batch] for j in range(0, len(reqs), batch)]
        tok_a = tok_b = s_a = s_b = 0.0
        for w, wave in enumerate(waves):  # A B, B A, ...: slow drift of the machine hits both alike
            for is_spec in (True, False)[:: 1 if (rep + w) % 2 == 0 else -1]:
                eng.spec = decoder if is_spec else None
                busy0, tok0 = eng.stats.busy_s, eng.stats.generated_tokens
                eng.generate([replace(r, prompt_token_ids=list(r.prompt_token_ids)) for r in wave])  # a copy per run
                if is_spec:
                    tok_a, s_a = tok_a + eng.stats.generated_tokens - tok0, s_a + eng.stats.busy_s - busy0
                else:
                    tok_b, s_b = tok_b + eng.stats.generated_tokens - tok0, s_b + eng.stats.busy_s - busy0
        x, y = tok_a / s_a, tok_b / s_b
        a.append(x)
        b.append(y)
        rounds.append(round(x / y, 3))
    eng.spec = decoder
    st = decoder.stats()
    return {"spec_tps": sum(a) / reps, "plain_tps": sum(b) / reps, "ratio": sum(a) / sum(b), "rounds": rounds,
            "tau": st["spec_mean_acceptance_length"], "verify_steps": st["spec_verify_steps"],
            "plain_steps": st["spec_plain_steps"]}


def tail_ceilings(loaded, prompts, reps: int, params, stores, tag: str, batches: tuple[int, ...]) -> dict:
    """The tail rows replayed without timing noise (``specdec_ceiling``): the same members' texts, the
    run's verify profile, the suffix drafts as drafted, verified only where accepted (no rule choosing
    among these drafts does better), and a free drafter of the policy's own most likely tokens; also on
    a machine where verify rows cost nothing over a decode step."""
    profile = VerifyProfile.load(PROFILE)
    cfg, k = SpecConfig(), 6
    reqs = [r for rep in range(reps) for r in tail_members(prompts, rep, TAIL_MEMBERS, tag, params)]
    texts = engine(loaded, spec=False).generate(reqs)  # position-keyed sampling: the tail rows' very texts
    stop = frozenset(loaded.eos_token_ids)
    tables = [position_table(loaded.model, r, stores.get(r.request_id.split("/")[0], cfg.min_match).copy(), cfg, k, stop)
              for r in texts]
    out = {}
    for name, prof in (("measured", profile), ("free_rows", free_rows(profile))):
        out[name] = {b: {rule: round(replay(tables, prof, b, RULES[rule])["ratio"], 3) for rule in RULES} for b in batches}
    return out


def exactness(loaded, prompts, stores) -> dict:
    """Greedy: tokens identical; greedy and sampled: every log-prob equal to the plain engine's."""
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    plain = engine(loaded, spec=False).generate([member(pr, p, 0, f"x{p}", greedy) for p, pr in enumerate(prompts)])
    spec_eng = engine(loaded, spec=True, stores=stores, adaptive=False, num_tokens=6)
    spec_eng.generate([member(pr, p, 1, f"x{p}", greedy) for p, pr in enumerate(prompts)])  # a sibling first
    spec = spec_eng.generate([member(pr, p, 0, f"x{p}", greedy) for p, pr in enumerate(prompts)])
    identical = all(a.token_ids == b.token_ids for a, b in zip(plain, spec))
    diff = max(max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0) for a, b in zip(plain, spec))
    # sampled: the speculative stream differs from plain sampling, so replay that very stream through
    # the plain engine's own path (prefill the prompt, then one decode step per token) and compare
    sampled = SamplingParams(temperature=1.0, max_tokens=48)
    res = spec_eng.generate([member(pr, p, 2, f"x{p}", sampled) for p, pr in enumerate(prompts)])
    sampled_diff = max(_replay_diff(engine(loaded, spec=False), r) for r in res)
    # position-keyed draws: the plain engine, given the same seeds, samples those very texts
    plain_sampled = engine(loaded, spec=False).generate([member(pr, p, 2, f"x{p}", sampled) for p, pr in enumerate(prompts)])
    sampled_identical = all(a.token_ids == b.token_ids for a, b in zip(plain_sampled, res))
    # the floor: the plain engine against itself, its batched log-probs vs the same tokens replayed alone
    # (its attention's rounding depends on the batch: see docs, speculative decoding, exactness)
    plain_floor = max(_replay_diff(engine(loaded, spec=False), r) for r in plain)
    return {"greedy_identical": identical, "sampled_identical": sampled_identical, "plain_batch_logprob_max_abs_diff": plain_floor, "greedy_logprob_max_abs_diff": diff, "sampled_logprob_max_abs_diff": sampled_diff,
            "logprob_max_abs_diff": max(diff, sampled_diff),
            "accepted_tokens": spec_eng.stats_dict()["spec_accepted_tokens"]}


DRAFT_LAYERS = 8  # of SmolLM2-135M's 30, saved as the separate draft checkpoint


def draft_checkpoint(loaded: LoadedModel, prompts: list[list[int]], reps: int) -> dict:
    """engine.spec.draft_model_path: SmolLM2's first ``DRAFT_LAYERS`` layers (embeddings, final norm and
    head) written as a Hugging Face checkpoint of its own (no 1.7B/135M pair of one tokenizer fits this
    machine: this is the mechanism, not a trained draft model), drafting greedy decoding of one sequence
    at a time, fixed k = 4, vs plain decoding on the same engine (A B, B A, ...): tokens/s ratio, tau, and
    whether the tokens are the plain ones."""
    from transformers import AutoModelForCausalLM

    out = OUT_DIR / "draft-checkpoint"
    config = loaded.model.config.__class__.from_dict({**loaded.model.config.to_dict(), "num_hidden_layers": DRAFT_LAYERS})
    draft = AutoModelForCausalLM.from_config(config)
    draft.load_state_dict(loaded.model.state_dict(), strict=False)  # the layers past DRAFT_LAYERS are dropped
    draft.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    eng = engine(loaded, spec=True, drafter="draft_model", draft_model_path=str(out), adaptive=False, num_tokens=4)
    decoder = eng.spec
    reqs = [member(pr, p, 0, f"dc{p}", greedy) for p, pr in enumerate(prompts)]
    outputs: dict[bool, list[list[int]]] = {}
    tok = {True: 0, False: 0}
    busy = {True: 0.0, False: 0.0}
    for rep in range(reps):
        for on in (True, False)[:: 1 if rep % 2 == 0 else -1]:
            eng.spec = decoder if on else None
            for r in reqs:  # one at a time: the tail of a rollout
                busy0, tok0 = eng.stats.busy_s, eng.stats.generated_tokens
                res = eng.generate([replace(r, prompt_token_ids=list(r.prompt_token_ids))])[0]
                tok[on] += eng.stats.generated_tokens - tok0
                busy[on] += eng.stats.busy_s - busy0
                if rep == 0:
                    outputs.setdefault(on, []).append(res.token_ids)
    eng.spec = decoder
    spec_tps, plain_tps = tok[True] / busy[True], tok[False] / busy[False]
    return {"speedup": spec_tps / plain_tps, "spec_tps": spec_tps, "plain_tps": plain_tps,
            "tau": decoder.stats()["spec_mean_acceptance_length"], "greedy_identical": outputs[True] == outputs[False]}


@torch.inference_mode()
def _replay_diff(plain: LLMEngine, r) -> float:
    """max |log-prob| difference between ``r`` and the plain engine's decode path over r's tokens."""
    logits = [plain.runner.prefill([(0, r.prompt_token_ids, 0)])[0]]
    pos = len(r.prompt_token_ids)
    for tok in r.token_ids[:-1]:
        logits.append(plain.runner.decode([tok], [pos])[0])
        pos += 1
    lp = log_probs(torch.stack(logits).float())[torch.arange(len(r.token_ids)), torch.tensor(r.token_ids)]
    return float((lp - torch.tensor(r.logprobs)).abs().max())


def sampled_distribution(n: int) -> dict:
    """Chi-square homogeneity of the 6th sampled token with vs without speculation (tiny model, vocab 16,
    group suffix drafts, which a 16-token vocabulary makes frequent)."""
    vocab = 16
    model = tiny_llama(layers=2, hidden=32, vocab=vocab, heads=4, kv_heads=2, seed=5, init_std=0.6)
    params = SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True)
    counts, accepted = [], 0
    for spec in (False, True):
        cfg = EngineConfig(max_seq_len=64, max_batch_size=64, prefix_cache=False,
                           spec=SpecConfig(enabled=spec, adaptive=False, num_tokens=3, min_match=1))
        eng = LLMEngine(model, cfg, eos_token_ids=[vocab - 1])
        if spec:
            eng.spec.drafter.groups = GroupStores(64)
        reqs = [GenerateRequest([3, 1, 4, 1, 5, 9], replace(params, seed=7919 * spec + i), group_id=f"d{i // 16}")
                for i in range(n)]
        res = eng.generate(reqs)
        counts.append(torch.bincount(torch.tensor([r.token_ids[5] for r in res]), minlength=vocab).double())
        if spec:
            accepted = eng.spec.metrics.accepted_tokens
    a, b = counts
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    tot = a + b
    ea, eb = tot * a.sum() / tot.sum(), tot * b.sum() / tot.sum()
    stat = float(((a - ea) ** 2 / ea + (b - eb) ** 2 / eb).sum())
    p = float(torch.special.gammaincc(torch.tensor((len(a) - 1) / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)))
    return {"sampled_dist_pvalue": p, "chi2": stat, "samples": n, "accepted_tokens": accepted}


def mtp_online_vs_frozen(steps: int) -> dict:
    """GRPO runs (the job itself) on a tiny random Llama with SmolLM2's tokenizer (even_tokens, lr high
    enough that the policy drifts): the mtp drafter with its head trained every step (online) vs the same
    starting head never trained again (frozen). The starting head is trained on a first run's step-0
    rollouts. tau per step = 1 + accepted / drafts of that step's rollout."""
    from arborl.run.job import train  # entry-point layer, like this bench

    root = OUT_DIR / "mtp"
    head0 = root / "head0.pt"
    base = [f"runs_dir={root}", "seed=3", "model.source=tiny", "model.tiny_tokenizer=smollm2", "model.tiny_layers=2",
            "model.tiny_hidden=64", "engine.max_seq_len=512", "engine.max_batch_size=16", "rollout.task=even_tokens",
            "rollout.batch_tasks=4", "rollout.group_size=4", "rollout.max_tokens=32", "rollout.eval_tasks=0",
            "train.lr=0.05", "scheduling.timeline=false", "engine.spec.enabled=true", "engine.spec.drafter=mtp",
            "engine.spec.adaptive=false", "engine.spec.num_tokens=3", "train.mtp.lr=0.003", "train.mtp.iters=4"]
    quiet = Console(file=io.StringIO())
    train(load_config(None, [*base, "name=warm", "rollout.steps=1", "train.mtp.enabled=true", "train.mtp.iters=30",
                             f"train.mtp.save_path={head0}"]), overwrite=True, console=quiet)
    out = {}
    for name, online in (("online", True), ("frozen", False)):
        cfg = load_config(None, [*base, f"name={name}", f"rollout.steps={steps}", f"engine.spec.mtp_path={head0}",
                                 f"train.mtp.enabled={str(online).lower()}"])
        train(cfg, overwrite=True, console=quiet)
        rows = [json.loads(x) for x in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
        rows = [r for r in rows if r["kind"] == "step"]
        taus, drafts, accepted = [], 0, 0
        for r in rows:  # the engine counters are cumulative: one step's tau from the differences
            d, a = r["spec/spec_drafts"] - drafts, r["spec/spec_accepted_tokens"] - accepted
            drafts, accepted = r["spec/spec_drafts"], r["spec/spec_accepted_tokens"]
            taus.append(1 + a / d if d else 1.0)
        out[name] = {"tau_by_step": [round(t, 3) for t in taus], "reward_by_step": [round(r["reward"], 3) for r in rows]}
    return out


def simulated_tail(acceptance: float, seeds: list[int]) -> dict:
    """Mean tail (last 10% of a step's requests) of the Seer-like workload: pinned without speculation,
    Seer without, Seer with speculation at ``acceptance``."""
    tails: dict[str, list[float]] = {"pinned": [], "seer": [], "seer_spec": []}
    for seed in seeds:
        base = [*SEER_WORKLOAD, "sim.steps=1", f"sim.seed={seed}"]
        plain = simulate(load_config(None, [*base, "sim.policies=sync/pinned,sync/seer"]))["policies"]
        spec = simulate(load_config(None, [*base, "sim.policies=sync/seer", f"sim.spec_acceptance={acceptance}"]))["policies"]
        tails["pinned"].append(plain["sync/pinned"]["tail_s"])
        tails["seer"].append(plain["sync/seer"]["tail_s"])
        tails["seer_spec"].append(spec["sync/seer"]["tail_s"])
    mean = {k: sum(v) / len(v) for k, v in tails.items()}
    return {"tail_s": mean, "seer_tail_reduction": 1 - mean["seer"] / mean["pinned"],
            "seer_full_tail_reduction": 1 - mean["seer_spec"] / mean["pinned"]}


def run(quick: bool, console: Console) -> dict:
    torch.manual_seed(0)
    load = os.getloadavg()[0]
    if load > (os.cpu_count() or 1):  # other work holds the cores: spinning OpenMP threads would distort the ratios
        torch.set_num_threads(1)
    console.print(f"load average {load:.1f} on {os.cpu_count()} cores; torch threads {torch.get_num_threads()}")
    console.print("loading SmolLM2-135M-Instruct ...")
    loaded = load_model(ModelConfig(source="smollm2"))
    # quick: 4 prompts (~200 paired positions); with 2 (~100) the group gain read +0.07 on one machine and +0.26 on
    # another, too few to point the way the full run does
    n_prompts, measured, max_tokens = (4, 2, 64) if quick else (8, 3, MAX_TOKENS)
    prompts = calculator_prompts(loaded, n_prompts)
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    stores = GroupStores(1024)
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    PROFILE.unlink(missing_ok=True)

    ex = exactness(loaded, prompts[:2] if quick else prompts[:4], stores)
    console.print(f"  greedy identical {ex['greedy_identical']}, max |log-prob diff| greedy "
                  f"{ex['greedy_logprob_max_abs_diff']:.2e}, sampled {ex['sampled_logprob_max_abs_diff']:.2e} "
                  f"({ex['accepted_tokens']} draft tokens accepted); plain batched vs alone "
                  f"{ex['plain_batch_logprob_max_abs_diff']:.2e}")
    dc = draft_checkpoint(loaded, prompts[:2], 2)
    console.print(f"  draft checkpoint ({DRAFT_LAYERS} layers): {dc['spec_tps']:.1f} vs {dc['plain_tps']:.1f} tok/s = "
                  f"{dc['speedup']:.2f}x, tau {dc['tau']:.3f}, greedy identical {dc['greedy_identical']}")
    dist = sampled_distribution(1000 if quick else 2000)
    console.print(f"  sampled tokens chi-square p {dist['sampled_dist_pvalue']:.3f} ({dist['accepted_tokens']} accepted)")

    t0 = time.perf_counter()
    references(loaded, prompts, params, stores, "grp")
    console.print(f"  {G - 1} references x {n_prompts} prompts: {time.perf_counter() - t0:.1f}s")
    taus = {
        "self": tau(loaded, prompts, measured, params, stores, "grp", group_trees=False),
        "group": tau(loaded, prompts, measured, params, stores, "grp"),
        "group_multipath": tau(loaded, prompts, measured, params, stores, "grp", num_paths=4),
    }
    for k, v in taus.items():
        console.print(f"  tau {k}: {v['tau']:.3f} (acceptance {v['acceptance_rate']:.3f}, per position "
                      f"{[round(a, 3) for a in v['per_pos']]}, {v['tokens']} tokens)")
    paired = paired_tau(loaded, prompts, measured, params, stores, "grp")
    console.print(f"  paired tau (same streams, {paired['positions']} positions): self {paired['self']:.3f}, group "
                  f"{paired['group']:.3f}, self multipath {paired['self_multipath']:.3f}, group multipath "
                  f"{paired['group_multipath']:.3f}")
    per_pos = taus["group"]["per_pos"]
    acceptance = per_pos[0] if per_pos else 0.0
    sim = simulated_tail(min(acceptance, 0.95), [0] if quick else [0, 1, 2])
    console.print(f"  sim tails {sim['tail_s']}, Seer + spec reduction {sim['seer_full_tail_reduction']:.3f}")

    reps = 3  # A B, B A, A B, each round other members (seeds): one round swung a row by 0.1-0.3
    tail = {}
    for b in (1, 2, 4):
        f = tail[b] = speed(loaded, prompts, b, reps, params, stores, "grp", fresh_groups=False, members=TAIL_MEMBERS)
        console.print(f"  tail batch {b}: {f['spec_tps']:.1f} vs {f['plain_tps']:.1f} tok/s = {f['ratio']:.2f}x {f['rounds']}")
    ceil = tail_ceilings(loaded, prompts, reps, params, stores, "grp", tuple(tail))
    for name, by_b in ceil.items():
        console.print(f"  tail replayed ({name} verify cost): " + "; ".join(f"batch {b} " + ", ".join(
            f"{r} {v:.2f}x" for r, v in by_rule.items()) for b, by_rule in by_b.items()))
    # three rounds of the full max_tokens even when quick: one round's ratio swung 0.86-1.05 with spec never on, and
    # at 32 tokens a round was ~1 s of decoding
    b32 = speed(loaded, calculator_prompts(loaded, 4), 32, 3, params, stores, "b32-", fresh_groups=True)
    console.print(f"  batch 32: {b32['spec_tps']:.1f} vs {b32['plain_tps']:.1f} tok/s = {b32['ratio']:.2f}x "
                  f"(verify / plain steps {b32['verify_steps']} / {b32['plain_steps']})")

    tail_speedup = min(f["ratio"] for f in tail.values())
    t0 = time.perf_counter()
    mtp = mtp_online_vs_frozen(MTP_STEPS)
    mtp_tau = {k: sum(v["tau_by_step"][-3:]) / 3 for k, v in mtp.items()}  # at the end: the last 3 steps
    console.print(f"  mtp tau by step, online {mtp['online']['tau_by_step']}, frozen {mtp['frozen']['tau_by_step']} "
                  f"({time.perf_counter() - t0:.0f}s)")
    table = Table(title="arborl bench specdec (SmolLM2-135M-Instruct, CPU, calculator GRPO groups, G=8, T=1)")
    for col in ("figure", "value"):
        table.add_column(col)
    rows = [(f"tau {k}, paired on the same streams (1 + E[accepted])", f"{paired[k]:.3f}")
            for k in ("self", "group", "self_multipath", "group_multipath")]
    rows += [(f"tau {k}, live decoding (1 + accepted/drafts)", f"{v['tau']:.3f}") for k, v in taus.items()]
    rows += [(f"tail batch {b}: spec / plain tokens/s", f"{f['spec_tps']:.1f} / {f['plain_tps']:.1f} = {f['ratio']:.2f}x")
             for b, f in tail.items()]
    rows += [("batch 32 (adaptive): spec / plain tokens/s", f"{b32['spec_tps']:.1f} / {b32['plain_tps']:.1f} = {b32['ratio']:.2f}x"),
             ("batch 32: verify / plain steps", f"{b32['verify_steps']} / {b32['plain_steps']}"),
             (f"mtp tau, last 3 of {MTP_STEPS} RL steps (tiny model): online / frozen",
              f"{mtp_tau['online']:.3f} / {mtp_tau['frozen']:.3f}"),
             (f"draft checkpoint (SmolLM2's first {DRAFT_LAYERS} layers, own HF dir), greedy batch 1: spec / plain tokens/s",
              f"{dc['spec_tps']:.1f} / {dc['plain_tps']:.1f} = {dc['speedup']:.2f}x (tau {dc['tau']:.3f})"),
             ("greedy tokens identical", str(ex["greedy_identical"])),
             ("sampled tokens identical to plain sampling, same seeds", str(ex["sampled_identical"])),
             ("max |log-prob - plain|", f"{ex['logprob_max_abs_diff']:.2e}"),
             ("max |log-prob| plain batched vs plain alone (floor)", f"{ex['plain_batch_logprob_max_abs_diff']:.2e}"),
             ("sampled tokens chi-square p (tiny model)", f"{dist['sampled_dist_pvalue']:.3f}"),
             ("sim Seer-like: tail pinned / Seer / Seer + spec (s)",
              " / ".join(f"{v:.0f}" for v in sim["tail_s"].values())),
             (f"sim Seer + spec tail reduction (acceptance {acceptance:.2f})", f"{sim['seer_full_tail_reduction']:.3f}")]
    for r in rows:
        table.add_row(*r)
    console.print(table)
    return {
        "bench": "specdec",
        "quick": quick,
        "load_avg_1m": load,
        "torch_threads": torch.get_num_threads(),
        "group_size": G,
        "prompts": n_prompts,
        "max_tokens": max_tokens,
        # paired: every variant drafts on the same sampled streams (the live runs sample different texts)
        "tau_suffix_self": paired["self"],
        "tau_suffix_group": paired["group"],
        "tau_suffix_group_multipath": paired["group_multipath"],
        "tau_group_gain": paired["group"] - paired["self"],
        "tau_suffix_self_multipath": paired["self_multipath"],
        # what the group adds to multi-path drafting (top-4 paths both sides)
        "tau_group_gain_multipath": paired["group_multipath"] - paired["self_multipath"],
        "tau_positions": paired["positions"],
        "tau_live": {k: v["tau"] for k, v in taus.items()},
        "acceptance_per_position_group": taus["group"]["per_pos"],
        "tokens_per_seq_step": {k: v["tokens_per_seq_step"] for k, v in taus.items()},
        "tail_decode_speedup": tail_speedup,
        "tail_decode_speedup_by_batch": {b: f["ratio"] for b, f in tail.items()},
        # noise-free replays of the tail rows (specdec_ceiling): suffix / suffix_oracle / greedy_oracle
        "tail_replay_by_batch": ceil["measured"],
        "tail_replay_free_rows_by_batch": ceil["free_rows"],
        "batch32_ratio": b32["ratio"],
        # engine.spec.draft_model_path: a separate HF checkpoint drafting (greedy, one sequence at a time)
        "draft_checkpoint_speedup": dc["speedup"],
        "draft_checkpoint_tau": dc["tau"],
        "draft_checkpoint_greedy_identical": dc["greedy_identical"],
        "draft_checkpoint_layers": DRAFT_LAYERS,
        "greedy_identical": ex["greedy_identical"],
        "sampled_identical": ex["sampled_identical"],
        "logprob_max_abs_diff": ex["logprob_max_abs_diff"],
        "greedy_logprob_max_abs_diff": ex["greedy_logprob_max_abs_diff"],
        "sampled_logprob_max_abs_diff": ex["sampled_logprob_max_abs_diff"],
        "plain_batch_logprob_max_abs_diff": ex["plain_batch_logprob_max_abs_diff"],
        "sampled_dist_pvalue": dist["sampled_dist_pvalue"],
        "sim_spec_acceptance": acceptance,
        "sim_seer_tail_reduction": sim["seer_tail_reduction"],
        "sim_seer_full_tail_reduction": sim["seer_full_tail_reduction"],
        "mtp_tau_online": mtp_tau["online"],
        "mtp_tau_frozen": mtp_tau["frozen"],
        "mtp_model": "tiny random Llama (2 layers, hidden 64, SmolLM2 tokenizer), even_tokens GRPO",
        "mtp_steps": MTP_STEPS,
        "mtp_tau_by_step": {k: v["tau_by_step"] for k, v in mtp.items()},
        "mtp_reward_by_step": {k: v["reward_by_step"] for k, v in mtp.items()},
    }
