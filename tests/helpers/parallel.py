"""Shared pieces of the train.parallel tests: a tiny model, grouped samples, process checks."""

from __future__ import annotations

import os
import random

from arborl.models import tiny_llama
from arborl.types import Sample

VOCAB = 128


def tiny(seed: int = 0):
    return tiny_llama(layers=2, hidden=32, vocab=VOCAB, heads=4, kv_heads=2, seed=seed)


def make_samples(seed: int, groups: int = 4, size: int = 3, prompt: tuple[int, int] = (3, 12)) -> list[Sample]:
    """GRPO-like groups: members share their prompt; group sizes of prompts vary."""
    rng = random.Random(seed)
    out = []
    for g in range(groups):
        head = [rng.randrange(VOCAB) for _ in range(rng.randint(*prompt))]
        for _ in range(size):
            resp = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))]
            toks = head + resp
            mask = [0] * len(head) + [1] * len(resp)
            adv = rng.uniform(-1, 1)
            out.append(Sample(
                episode_id=f"e{len(out)}", group_id=f"g{g}", token_ids=toks, loss_mask=mask,
                rollout_logprobs=[-rng.uniform(3, 6) if m else 0.0 for m in mask],
                versions=[0 if m else -1 for m in mask], chunk_ids=[0] * len(toks),
                advantages=[adv if m else 0.0 for m in mask], reward=adv,
            ))
    return out


def alive(pids: list[int]) -> list[int]:
    """The pids that still run (a zombie does not count)."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] != "Z":
                    out.append(pid)
        except FileNotFoundError:
            pass
    return out


def rank_children() -> list[int]:
    """Processes of this test process running ``arborl.train.ranks`` (any descendant generation)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
        except OSError:
            continue
        if b"arborl.train.ranks" in cmd and alive([int(entry)]):
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read()
            if f"ARBORL_TEST_OWNER={os.getpid()}".encode() in env:
                found.append(int(entry))
    return found


def rank_actor_processes(grace_s: float = 10.0) -> list[int]:
    """Ray trainer rank actor processes (``ray::RankActor``) still running after up to ``grace_s``
    (a killed actor's worker exits asynchronously)."""
    import time

    deadline = time.monotonic() + grace_s
    while True:
        found = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        if b"ray::RankActor" in f.read() and alive([int(entry)]):
                            found.append(int(entry))
                except OSError:
                    pass
        if not found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)
