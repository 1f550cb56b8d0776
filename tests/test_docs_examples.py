"""The docs a user follows are correct: the example configs load and resolve, the gateway session flow
(curl and the official openai client) runs against a live gateway, the guide's code runs, every knob
the docs name exists, every feature label used has a glossary row and every row holds in the code, and
every link stays inside the repository and points at something that exists."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

import docs_glossary
from arborl.config import Config, Section, load_config
from arborl.datapool import DataPool
from arborl.extensions import check_extensions
from arborl.run.job import train
from arborl.extensions import kind_setting_keys
from helpers.blackbox_gateway import ADMIN_KEY, start_harness

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
LABEL = re.compile(r"\b(A[1-4]|S[1-6]|P[12]|I[1-6]|C[1-4]|E[1-5])\b")


def _blocks(path: Path, lang: str, after: str) -> list[str]:
    """The ``lang`` code blocks of ``path`` under the heading ``after`` (up to the next heading)."""
    text = path.read_text()
    start = text.index(after)
    end = text.find("\n## ", start + len(after))
    section = text[start: end if end != -1 else None]
    return re.findall(rf"```{lang}\n(.*?)```", section, re.S)


# -- configs -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_example_config_loads_and_its_extensions_resolve(path, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = load_config(path)
    check_extensions(cfg)
    for f in [*cfg.rollout.data.train_files, *cfg.rollout.data.eval_files]:
        assert (REPO / f).is_file(), f
    if cfg.rollout.task == "dataset" and ":" in cfg.rollout.data.reward_function:
        assert (REPO / cfg.rollout.data.reward_function.split(":")[0]).is_file()


def test_the_example_configs_are_what_the_docs_say():
    names = {p.stem for p in CONFIGS}
    assert {"default", "dataset", "blackbox", "async", "seer"} <= names
    assert load_config(REPO / "configs/default.yaml") == load_config(None)  # the default job, spelled out
    assert load_config(REPO / "configs/async.yaml").scheduling.consume == "async_ratio"
    seer = load_config(REPO / "configs/seer.yaml")
    assert seer.scheduling.dispatch == "seer" and seer.gateway.num_engines == 2
    bb = load_config(REPO / "configs/blackbox.yaml").rollout
    assert bb.agent == "command" and bb.agent_command[-1] == "examples/blackbox_agent.py"
    # the YAML shown in the guide is the example config's data section
    (shown,) = _blocks(REPO / "docs/bring-your-own.md", "yaml", "## Your prompts and your reward")
    data = yaml.safe_load(shown)["rollout"]["data"]
    actual = yaml.safe_load((REPO / "configs/dataset.yaml").read_text())["rollout"]["data"]  # paths as written
    assert {k: actual[k] for k in data} == data


# -- the gateway session flow ---------------------------------------------------------------------
@pytest.fixture(scope="module")
def gateway():
    h = start_harness()
    yield h
    h.close()


def _flow_env(gateway) -> dict[str, str]:
    return {**os.environ, "ARBORL_BASE_URL": gateway.base_url, "ARBORL_ADMIN_KEY": ADMIN_KEY}


def test_the_python_session_flow_in_gateway_md_runs(gateway, tmp_path):
    (code,) = _blocks(REPO / "docs/gateway.md", "python", "## A session, step by step")
    script = tmp_path / "flow.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], env=_flow_env(gateway), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    status_line = out.stdout.strip().splitlines()[-1]
    assert status_line.startswith("finished [{") and "'name': 'correct'" in status_line
    assert "'value': 1.0" in status_line and status_line.endswith("]")  # rewards, then the token ids
    sessions = [s for s in gateway.gateway.sessions.all() if s.episode.task_id == "demo-1"]
    assert sessions and all(s.finished for s in sessions)


@pytest.mark.skipif(not (shutil.which("curl") and shutil.which("jq")), reason="needs curl and jq")
def test_the_curl_session_flow_in_gateway_md_runs(gateway, tmp_path):
    blocks = _blocks(REPO / "docs/gateway.md", "bash", "## A session, step by step")
    code = next(b for b in blocks if "curl" in b)
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", code], cwd=tmp_path, env=_flow_env(gateway),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    values, rest, dec = [], out.stdout.strip(), json.JSONDecoder()
    while rest:  # the replies of steps 3, 4 and 5, printed one after the other
        value, end = dec.raw_decode(rest)
        values.append(value)
        rest = rest[end:].strip()
    reward, finish, trajectory = values
    assert reward["name"] == "correct" and reward["call_id"].startswith("call-")
    assert finish["status"] == "finished" and finish["calls"] == 1
    assert trajectory["status"] == "finished" and trajectory["rewards"][0]["value"] == 1.0 and trajectory["tokens"]
    assert {"session.json", "reply.json"} <= {f.name for f in tmp_path.iterdir()}


# -- the guide's code ------------------------------------------------------------------------------
def test_the_guides_agent_and_loss_examples_run(tmp_path):
    guide = REPO / "docs/bring-your-own.md"
    (agent_code,) = [b for b in _blocks(guide, "python", "## An agent") if "make_agent" in b]
    (loss_code,) = _blocks(guide, "python", "## A loss or an advantage estimator")
    (tmp_path / "my_agent.py").write_text(agent_code)
    (tmp_path / "my_loss.py").write_text(loss_code)
    cfg = load_config(None, [
        f"runs_dir={tmp_path}", "name=guide", "model.source=tiny", "model.tiny_tokenizer=smollm2",
        "model.tiny_layers=1", "model.tiny_hidden=32", "engine.max_seq_len=256", "rollout.task=even_tokens",
        "rollout.steps=1", "rollout.batch_tasks=1", "rollout.group_size=3", "rollout.max_tokens=4",
        "rollout.eval_tasks=0", "scheduling.timeline=false", "train.advantage.drop_zero_variance=false",
        f"rollout.agent={tmp_path}/my_agent.py:make_agent", f"train.loss.kind={tmp_path}/my_loss.py:symmetric_ppo", "train.loss.settings.clip=0.1"])
    train(cfg)
    with DataPool(cfg.run_dir / "datapool.sqlite") as pool:
        episodes = [pool.get_episode(e.episode_id) for e in pool.episodes()]
    assert len(episodes) == 3 and all(len(e.calls) == 1 for e in episodes)
    tok = __import__("arborl.models", fromlist=["load_model"]).load_model(cfg.model).tokenizer
    assert "Think, then answer." in tok.decode(episodes[0].calls[0].prompt_token_ids)  # the guide's agent ran
    loss_ns: dict = {}
    exec(loss_code, loss_ns)
    logp, old = torch.tensor([[0.0, -1.0]]), torch.tensor([[-0.5, -0.5]])
    loss, _ = loss_ns["symmetric_ppo"](logp, old, torch.tensor([[1.0, -1.0]]), clip=0.1)
    # ratio e^0.5 clipped at 1 + clip; ratio e^-0.5 clipped at 1 - clip
    assert torch.allclose(loss, torch.tensor([[-1.1, 0.9]]))
    assert loss_ns["symmetric_ppo"].Settings(clip=0.1).clip == 0.1  # the settings the job validated


# -- names in the docs -----------------------------------------------------------------------------
def _knob_paths(model: type[Section], prefix: str = "") -> set[str]:
    out = set()
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, Section):
            out |= {prefix + name} | _knob_paths(ann, prefix + name + ".")
        else:
            out.add(prefix + name)
    return out


def test_every_knob_the_docs_name_exists():
    knobs = _knob_paths(Config) | kind_setting_keys()
    sections = "|".join(sorted({k.split(".")[0] for k in knobs if "." in k}))
    named = re.compile(rf"`((?:{sections})\.[a-z_][a-z0-9_.]*)(?=[`=\s,)])")  # not module paths (train.losses.X)
    files = (".sqlite", ".md", ".py", ".yaml", ".json", ".jsonl", ".png")
    pages = [REPO / "README.md", *[p for p in DOCS if p.name != "knobs.md"]]
    bad = []
    for page in pages:
        for m in named.finditer(page.read_text()):
            key = m.group(1).rstrip(".")
            if key not in knobs and not key.endswith(files):
                bad.append(f"{page.name}: {key}")
    assert not bad, bad


def test_every_feature_label_used_has_a_glossary_row():
    glossary = (REPO / "docs/glossary.md").read_text()
    rows = set(re.findall(r"^\| ([A-Z][0-9]) \|", glossary, re.M))
    used = set()
    for f in [*(REPO / "src").rglob("*.py"), *DOCS, REPO / "README.md"]:
        used |= set(LABEL.findall(f.read_text()))
    assert used and used <= rows, used - rows
    every = {f"{g}{i}" for g, n in [("A", 4), ("S", 6), ("P", 2), ("I", 6), ("C", 4), ("E", 5)] for i in range(1, n + 1)}
    every |= {"X1", "X2", "X4"}  # the fourth wave's rows built so far (DESIGN.md's X map)
    assert rows == every  # the whole feature map, nothing else


def test_the_glossary_is_generated_and_every_row_holds_in_the_code():
    assert (REPO / "docs/glossary.md").read_text() == docs_glossary.render((REPO / "docs/glossary.md").read_text()), (
        "docs/glossary.md is stale: run make glossary")
    assert [f.label for f in docs_glossary.FEATURES] == sorted(
        (f.label for f in docs_glossary.FEATURES), key=lambda lab: ("ASPICEX".index(lab[0]), lab))
    problems = [p for f in docs_glossary.FEATURES for p in docs_glossary.check(f)]
    assert not problems, problems
    assert "not built" not in (REPO / "docs/glossary.md").read_text()


@pytest.mark.parametrize("wrong, says", [
    (dict(code=("engine/specdec/eagle.py",)), "does not exist"),  # code that is not there
    (dict(code=("engine/specdec/suffix.py",)), "does not mention I1"),  # a file that does not build it
    (dict(knobs=("engine.spec.draft_depth",)), "not a config key"),
    (dict(knobs=("engine.spec.drafter=eagle",)), "not a valid setting"),  # a name no registry holds
    (dict(knobs=("train.correction.mode=tis_v2",)), "not a valid setting"),
    (dict(code=()), "names no code"),  # a row must say where the feature is built
])
def test_a_glossary_row_whose_status_is_wrong_fails_the_check(wrong, says):
    true = next(f for f in docs_glossary.FEATURES if f.label == "I1")
    assert docs_glossary.check(true) == []
    problems = docs_glossary.check(dataclasses.replace(true, **wrong))
    assert len(problems) == 1 and says in problems[0], problems


def _slug(heading: str) -> str:
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_links_stay_inside_the_repository_and_resolve():
    bad = []
    for page in [REPO / "README.md", *DOCS]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                bad.append(f"{page.name}: external link {target}")
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists() or REPO not in dest.parents:
                bad.append(f"{page.name}: {target} does not exist in the repository")
            elif anchor and dest.suffix == ".md":
                slugs = {_slug(h) for h in re.findall(r"^#+ (.*)$", dest.read_text(), re.M)}
                if anchor not in slugs:
                    bad.append(f"{page.name}: {target}: no heading #{anchor}")
    assert not bad, bad
    assert "DESIGN.md" not in (REPO / "README.md").read_text()
