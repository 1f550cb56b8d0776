"""The feature-label tables of docs/glossary.md, generated from ``FEATURES`` and checked against the code.

Each label's "here" cell names the code that builds it (files or packages under ``src/arborl``, each of
which tags the label) and the knobs that turn it on (``key`` or ``key=value``, each a real config key
and, for a registry knob, a registered name). ``check`` says what does not hold; a test runs it, so a
row cannot claim code or knobs that are not there. ``python scripts/docs_glossary.py`` rewrites the
"Feature labels" section of docs/glossary.md (``make glossary``); a test fails when it is stale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from arborl.config import ConfigError, known_keys, load_data, validate_config
from arborl.extensions import REGISTRY_KNOBS, check_extensions, kind_setting_keys

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "arborl"
GLOSSARY = ROOT / "docs" / "glossary.md"
SECTION_START, SECTION_END = "## Feature labels", "## Terms"


@dataclass(frozen=True)
class Feature:
    label: str
    meaning: str
    code: tuple[str, ...]  # paths under src/arborl (a file, or a package: some file in it tags the label)
    knobs: tuple[str, ...] = ()  # "key" or "key=value"
    note: str = ""  # more of the "here" cell, after the code and knobs


GROUPS = {
    "A": "agents and their plumbing",
    "S": "scheduling of rollouts and training",
    "P": "prefix sharing",
    "I": "inference speed",
    "C": "credit assignment and rewards",
    "E": "environments",
    "X": "beyond the seed: what users of the peers ask for",
}

FEATURES: tuple[Feature, ...] = (
    Feature("A1", "Agents decoupled from the RL core: an agent is a plain Python loop (white box) that calls the "
            "model through a client.", ("agents/base.py", "agents/react.py"), note="(`run_agent`, `AgentLoop`)"),
    Feature("A2", "Black-box agents: any program that speaks the OpenAI API, pointed at a gateway, with every call "
            "captured for training.", ("agents/blackbox.py", "agents/command.py", "gateway/"), ("rollout.agent_command",)),
    Feature("A3", "A gateway that serves the model calls and a data pool that stores the trajectories for training "
            "(Forge's middleware).", ("gateway/", "datapool/")),
    Feature("A4", "Agent behaviour run as a separate rollout service (slime): episodes run in worker processes that "
            "reach the gateway over HTTP.", ("workers/",), ("rollout.workers",)),
    Feature("S1", "Windowed FIFO consumption (Forge): the trainer takes only finished samples inside a window "
            "[H, H + W) of generation order, H the oldest unfinished one.", ("scheduling/consume.py",),
            ("scheduling.consume=windowed_fifo", "scheduling.window")),
    Feature("S2", "Asynchronous ratio (ROLL): generation runs ahead of training, with a bound on the policy-version "
            "gap between the trainer and a sample.", ("scheduling/consume.py",),
            ("scheduling.consume=async_ratio", "scheduling.async_ratio")),
    Feature("S3", "Training-inference mismatch: the trainer recomputes each token's log-probability, compares it "
            "with the rollout engine's, and reweights or masks tokens whose ratio is too far from 1 (slime; TIS, "
            "MIS, IcePop).", ("train/corrections.py",), ("train.correction.mode=tis", "train.correction.mode=mis")),
    Feature("S4", "Sample-level drop when the policy version that generated a sample is too old (slime).",
            ("scheduling/consume.py",), ("scheduling.max_version_gap",), "(`VersionGapFilter`)"),
    Feature("S5", "Divided rollout (Seer): a group's requests are served in chunks of at most N new tokens from one "
            "global queue, rebalanced across engine instances with KV reuse or transfer.",
            ("scheduling/dispatch.py", "engine/dispatcher.py"), ("scheduling.dispatch=seer", "scheduling.chunk_tokens")),
    Feature("S6", "Context-aware scheduling (Seer): one probe request per group first, then the longest estimated "
            "group first (its estimate: its longest finished member).", ("scheduling/dispatch.py",),
            ("scheduling.context_aware",)),
    Feature("P1", "A prefix (radix) tree over requests at inference: the KV of a shared prompt prefix is computed "
            "once and reused.", ("prefix/", "engine/prefix_cache.py"), ("engine.prefix_cache",)),
    Feature("P2", "Prefix-tree merging at training: samples sharing a prefix (group members, turns) are packed as a "
            "tree so the prefix is computed once; loss and gradients are the same as flat packing.",
            ("prefix/", "train/packing.py"), ("train.packing=tree",)),
    Feature("I1", "Speculative decoding with a small draft model of the policy's tokenizer: the policy's first "
            "layers, or a separate checkpoint.", ("engine/specdec/draft_model.py",),
            ("engine.spec.drafter=draft_model", "engine.spec.draft_layers", "engine.spec.draft_model_path")),
    Feature("I2", "Drafting with a multi-token-prediction (MTP) head.", ("engine/specdec/mtp.py",),
            ("engine.spec.drafter=mtp", "engine.spec.mtp_path")),
    Feature("I3", "Keeping an MTP head aligned with the moving policy by training it online (top-K KL loss; Forge).",
            ("train/mtp.py",), ("train.mtp.enabled", "train.mtp.loss=topk_kl")),
    Feature("I4", "Group-shared drafts (Seer): the other responses of the same GRPO group feed a suffix tree of draft "
            "tokens.", ("engine/specdec/suffix.py",), ("engine.spec.drafter=suffix", "engine.spec.group_trees")),
    Feature("I5", "Low-precision (FP8, int8, bf16) rollout inference (slime).", ("models/quantize.py",),
            ("engine.weights_dtype=float8_e4m3", "engine.weights_dtype=int8")),
    Feature("I6", "Prefill / decode disaggregation (slime).", ("cluster/pd.py",), ("cluster.pd_prefill_engines",)),
    Feature("C1", "Process rewards: dense rewards or penalties on intermediate behaviour, not only the final outcome "
            "(Forge).", ("rewards/shaping.py", "rewards/advantages.py", "train/samples.py"),
            ("train.advantage.shaping.process_weight",),
            "an agent posts them (`POST /v1/sessions/{id}/reward`, `client.reward`); kept in `episode.meta[\"rewards\"]`"),
    Feature("C2", "Completion-time reward: finishing faster than the rest of the group is rewarded (Forge).",
            ("rewards/shaping.py",), ("train.advantage.shaping.speed_weight", "train.advantage.shaping.speed_metric")),
    Feature("C3", "Reward-to-go: each turn's return is the reward from that turn to the episode's end, for lower "
            "variance (Forge).", ("rewards/advantages.py",),
            ("train.advantage.estimator=reward_to_go", "train.advantage.settings.gamma")),
    Feature("C4", "Chunked MDP (ROLL): a chunk is the span of tokens between two environment interactions; returns, "
            "advantages and importance ratios are taken per chunk.",
            ("types.py", "train/samples.py", "rewards/advantages.py"), ("train.correction.level=chunk",),
            "(`Sample.chunk_ids`)"),
    Feature("E1", "A clean environment (sandbox) before every rollout (ROLL).", ("envs/workspace.py", "envs/base.py")),
    Feature("E2", "Tests hidden during the episode and loaded only at the final evaluation (ROLL).",
            ("envs/base.py", "tasks/code_repair/scoring.py"), (), "(`runtime.evaluate`)"),
    Feature("E3", "Environment filtering: drop tasks whose ground truth fails or whose no-op passes (ROLL).",
            ("tasks/code_repair/validate.py",), ("rollout.code_repair.require_validated",), "(`arborl envs validate`)"),
    Feature("E4", "An LLM as judge against false positives (ROLL).", ("tasks/judge.py",), ("rollout.judge.mode",)),
    Feature("E5", "Environment diversity: variants with other package versions, configs, removed dependencies "
            "(ROLL).", ("tasks/code_repair/perturb.py",), ("rollout.code_repair.variants",), "(`arborl envs perturb`)"),
    Feature("X1", "The ecosystem's environment formats: Gymnasium / GEM / SkyRL-Gym text environments, Harbor task "
            "folders, verifiers environments.", ("tasks/gym_env.py", "tasks/harbor/", "tasks/verifiers_env.py"),
            ("rollout.task=gym", "rollout.task=harbor", "rollout.task=verifiers"), "(`arborl envs validate harbor`)"),
    Feature("X2", "An existing agent CLI (mini-swe-agent) learns unchanged through the gateway, warm-started on "
            "demonstrations in its own format.", ("agents/command.py", "tasks/code_repair/demos.py"),
            ("rollout.agent_command",), "(`configs/mini_swe_agent.yaml`, `arborl envs demos --render-command`)"),
    Feature("X4", "Token faithfulness audited: every recorded conversation re-rendered and compared with the ids the "
            "engine and the trainer used; a run that drifts too much stops.", ("gateway/audit.py",),
            ("gateway.record_messages", "gateway.max_drift_rate"), "(`arborl audit`)"),
)


def _tags(path: Path, label: str) -> bool:
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
    pattern = re.compile(rf"\b{label}\b")
    return any(pattern.search(f.read_text()) for f in files)


def check(feature: Feature) -> list[str]:
    """What ``feature``'s row claims that the code does not hold (empty: the row is true)."""
    problems = []
    if not feature.code:
        problems.append(f"{feature.label}: names no code")
    for rel in feature.code:
        path = SRC / rel
        if not path.exists():
            problems.append(f"{feature.label}: src/arborl/{rel} does not exist")
        elif not _tags(path, feature.label):
            problems.append(f"{feature.label}: src/arborl/{rel} does not mention {feature.label}")
    keys = set(known_keys()) | kind_setting_keys()
    for knob in feature.knobs:
        key, eq, value = knob.partition("=")
        if key not in keys:
            problems.append(f"{feature.label}: {key} is not a config key")
            continue
        if not eq:
            continue
        try:
            cfg = validate_config(load_data(None, [knob]))
            if key in REGISTRY_KNOBS:
                check_extensions(cfg)
        except ConfigError as e:
            problems.append(f"{feature.label}: {knob} is not a valid setting ({e})")
    return problems


def _here(feature: Feature) -> str:
    parts = [", ".join(f"`{p}`" for p in feature.code)]
    if feature.note:
        parts.append(feature.note)
    if feature.knobs:
        parts.append(", ".join(f"`{k}`" for k in feature.knobs))
    return "; ".join(parts).replace("; (", " (")


def render_section() -> str:
    out = [
        SECTION_START,
        "",
        "Code comments, knob descriptions and these docs tag a technique with a short label (`P2`, `S3`,",
        "`C4`, ...). The labels number the project's feature map: the techniques arborl set out to cover,",
        "most of them taken from production agentic-RL systems (MiniMax Forge, Alibaba ROLL, Moonshot Seer,",
        "Zhipu/THUDM slime). Each row says what the label means, the code that builds it (under `src/arborl/`,",
        "each file tagging the label) and the knobs that turn it on. The tables are generated by `make glossary`",
        "(`python scripts/docs_glossary.py`) from `scripts/docs_glossary.py`, and a test checks every path,",
        "key and registered name they name against the code.",
        "",
    ]
    for group, title in GROUPS.items():
        out += [f"### {group}: {title}", "", "| label | meaning | here |", "|---|---|---|"]
        out += [f"| {f.label} | {f.meaning} | {_here(f)} |" for f in FEATURES if f.label[0] == group]
        out.append("")
    return "\n".join(out)


def render(current: str) -> str:
    """``current`` (the glossary's text) with its feature-label section regenerated."""
    start, end = current.index(SECTION_START), current.index(SECTION_END)
    return current[:start] + render_section() + "\n" + current[end:]


if __name__ == "__main__":
    GLOSSARY.write_text(render(GLOSSARY.read_text()))
