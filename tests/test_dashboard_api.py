"""The dashboard's JSON API over real run directories (a real tiny training run, and an agentic run
written through arborl's own writers, and a real run with an SFT warm start), over a real HTTP server: curves
carry every numeric column, a held-out series per split with the SFT stage apart, each step's time split; the timeline one bar per recorded piece, the trajectory view the trainer's tokens with the loss mask the
data pool implies; the data pool is read without being written, and live; `/dashboard` under
`arborl serve`."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
import time

import httpx
import pytest
import uvicorn
from helpers.dashboard_runs import (AGENTIC_EVALS, AGENTIC_STEPS, agentic_run, drifting_run, trained_run, untokenized_run,
                                    warm_run)
from helpers.tiny_run import ENV, TINY, arborl_cmd, set_args

from arborl import audit
from arborl.dashboard import create_app, faithfulness
from arborl.dashboard.runs import WELL_KNOWN, RunNotFoundError
from arborl.datapool import DataPool
from arborl.gateway.server import bind
from arborl.types import ArborlError, Call, Episode, EpisodeStatus


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs")
    trained = trained_run(d)
    agentic, written = agentic_run(d)
    warm_run(d)
    return d, trained, agentic, written


class Server:
    """The dashboard app on a loopback port (uvicorn in a thread)."""

    def __init__(self, app) -> None:
        self.sock = bind("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def server(runs):
    with Server(create_app([runs[0]])) as srv:
        yield srv


def get(server, path, **params):
    r = httpx.get(server.url + path, params=params, timeout=30)
    return r


def test_runs_and_curves_carry_every_numeric_column_well_known_first(runs, server):
    d, trained, agentic, _ = runs
    listed = get(server, "/api/runs").json()
    assert [r["key"] for r in listed] == ["agentic", "trained", "warm"]
    data = get(server, "/api/curves", run=["agentic", "trained"]).json()
    cols = data["columns"]
    # the other helpers' metrics show without being listed anywhere; the known ones come first, in order
    assert {"zz_custom/metric", "spec/spec_mean_acceptance_length", "dispatch/pieces"} <= set(cols)
    known = [c for c in cols if c in WELL_KNOWN]
    assert cols[: len(known)] == known and known == [k for k in WELL_KNOWN if k in cols]
    assert [r["zz_custom/metric"] for r in data["runs"]["agentic"]["step"]] == [7.0, 8.0, 9.0]
    trained_rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward"] for r in data["runs"]["trained"]["step"]] == [r["reward"] for r in trained_rows
                                                                      if r["kind"] == "step"]


def test_held_out_curves_are_a_line_per_split_with_the_sft_stage_apart(runs, server):
    """eval and eval_perturbed are two series, and the evaluation after the SFT warm start (step 0, like
    the one before) a series of its own: nothing joins them into one zig-zag line."""
    warm = runs[0] / "warm"
    data = get(server, "/api/curves", run=["agentic", "warm"]).json()["runs"]
    got = {s["name"]: (s["split"], s["stage"], [(r["step"], r["eval_success"]) for r in s["rows"]])
           for s in data["agentic"]["eval_series"]}
    assert got == {"eval": ("eval", "rl", [(0, 0.25), (3, 0.75)]),
                   "eval_perturbed": ("eval_perturbed", "rl", [(0, 0.125), (3, 0.375)]),
                   "eval after SFT": ("eval", "after_sft", [(0, 0.5)]),
                   "eval_perturbed after SFT": ("eval_perturbed", "after_sft", [(0, 0.25)])}
    assert len(data["agentic"]["eval"]) == len(AGENTIC_EVALS)  # the rows as written, still there
    # the real run's job wrote them: before, after SFT, rollout.eval_every=1's row (no split), after; and
    # the SFT stage's held-out NLL before and after it
    rows = [json.loads(x) for x in (warm / "metrics.jsonl").read_text().splitlines()]
    series = {s["name"]: s for s in data["warm"]["eval_series"]}
    assert list(series) == ["eval", "SFT held-out", "eval after SFT"]
    assert [(r["step"], r.get("stage")) for r in series["eval"]["rows"]] == [(0, "before"), (1, None), (2, "after")]
    assert [(r["step"], r["stage"]) for r in series["eval after SFT"]["rows"]] == [(0, "after_sft")]
    assert [r["heldout_nll"] for r in series["SFT held-out"]["rows"]] == [r["heldout_nll"] for r in rows
                                                                        if "heldout_nll" in r] != []
    assert sum(len(s["rows"]) for s in series.values()) == sum(r["kind"] == "eval" for r in rows)
    # the headline's held-out figures are the eval split's, before and after RL
    heads = {r["key"]: r["headline"] for r in get(server, "/api/runs").json()}
    assert (heads["agentic"]["eval_success_first"], heads["agentic"]["eval_success_last"]) == (0.25, 0.75)
    assert (heads["warm"]["eval_success_first"], heads["warm"]["eval_success_last"]) == (
        series["eval"]["rows"][0]["eval_success"], series["eval"]["rows"][-1]["eval_success"])


def test_time_split_parts_stack_to_the_step_time(runs, server):
    """Each step's rollout, train and weight-sync seconds as recorded, and the rest of step_s as "other"."""
    _, trained, _, _ = runs
    data = get(server, "/api/curves", run=["agentic", "trained"]).json()["runs"]
    ts = data["agentic"]["time_split"]
    parts = {p["name"]: p["y"] for p in ts["parts"]}
    assert ts["x"] == [1, 2, 3] and list(parts) == ["rollout", "train", "weight sync", "other"]
    assert (parts["rollout"], parts["train"], parts["weight sync"]) == tuple(
        [r[k] for r in AGENTIC_STEPS] for k in ("rollout_s", "train_s", "publish_s"))
    assert parts["other"] == pytest.approx([0.25] * 3)
    steps = [r for r in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "step"]
    ts = data["trained"]["time_split"]
    assert ts["x"] == [1, 2] and [p["key"] for p in ts["parts"]] == ["rollout_s", "train_s", "publish_s", "other"]
    for i, r in enumerate(steps):
        assert [p["y"][i] for p in ts["parts"][:3]] == [r["rollout_s"], r["train_s"], r["publish_s"]]
        assert all(p["y"][i] >= 0 for p in ts["parts"])
        assert sum(p["y"][i] for p in ts["parts"]) == pytest.approx(r["step_s"])


def test_timeline_has_one_bar_per_recorded_piece(runs, server):
    _, trained, _, _ = runs
    spans = [json.loads(x) for x in (trained / "timeline" / "spans.jsonl").read_text().splitlines()]
    for step in (1, 2):
        mine = [s for s in spans if s["kind"] == "span" and s["step"] == step - 1]
        d = get(server, "/api/timeline", run="trained", step=step).json()
        bars = [b for t in d["figure"]["data"] if t["type"] == "bar" for b in t["base"]]
        assert d["bars"] == len(bars) == len(mine) > len({s["request_id"] for s in mine})  # pieces, not requests
        assert sorted(bars) == sorted(s["start"] for s in mine)
        assert d["probes"] == sum(s["probe"] for s in mine) > 0
    # the agentic run's step 1: a migration (A moves engine 0 -> 1), a probe, a cancelled piece, a publish line
    a = get(server, "/api/timeline", run="agentic", step=1).json()
    assert (a["bars"], a["requests"], a["probes"], a["migrations"]) == (5, 3, 1, 1)
    names = [t["name"] for t in a["figure"]["data"]]
    assert names == ["engine 0", "engine 1", "cancelled / aborted", "probe", "migration"]
    assert [s["x0"] for s in a["figure"]["layout"]["shapes"]] == [1.5]
    assert get(server, "/api/timeline", run="agentic").json()["steps"] == [1, 2]
    r = get(server, "/api/timeline", run="agentic", step=9)
    assert r.status_code == 404 and "steps with one: 1, 2" in r.json()["detail"]


def test_trajectory_view_decodes_recorded_ids_and_masks_generated_tokens(runs, server):
    _, _, _, w = runs
    groups = get(server, "/api/groups", run="agentic").json()
    assert groups == [{"bucket": "step 1", "groups": [{"group_id": "step0:t1", "episodes": 2, "mean_reward": 0.5}]}]
    eps = get(server, "/api/episodes", run="agentic", group="step0:t1").json()
    assert [e["episode_id"] for e in eps] == ["ep-agentic-1", "ep-agentic-2"]
    v = get(server, "/api/episode", run="agentic", id=w["episode_id"]).json()
    tok = w["tokenizer"]
    got = [[(t["id"], t["mask"]) for t in s["tokens"]] for s in v["samples"]]
    assert got == w["samples"]
    for s in v["samples"]:
        assert [t["text"] for t in s["tokens"]] == [tok.decode([t["id"]], skip_special_tokens=False)
                                                   for t in s["tokens"]]
    first = [t for t in v["samples"][0]["tokens"] if t["mask"]][: len(w["trainer_logprobs"])]
    assert [t["tlp"] for t in first] == pytest.approx(w["trainer_logprobs"], abs=1e-6)
    assert [t["lp"] for t in first] == pytest.approx(w["c1_logprobs"], abs=1e-6)
    assert v["has_trainer_logprobs"] and v["decoded"]
    assert [c["call_id"] for c in v["aborted_calls"]] == ["call-agentic-3"]
    assert v["samples"][1]["drift_events"][0]["reason"] == "history edited by the agent"
    assert v["meta"]["hidden_tests"] == {"passed": 3, "failed": 1} and v["process_rewards"][0]["value"] == 0.5
    assert v["interactions"][0]["result"] == "89" and v["reward_components"]["judge"] == 0.5
    assert get(server, "/api/episode", run="agentic", id="nope").status_code == 404
    r = get(server, "/api/episode", run="nope", id="x")
    assert r.status_code == 404 and "runs: agentic, trained, warm" in r.json()["detail"]


def test_a_real_run_records_trainer_logprobs_for_the_mismatch_view(runs, server):
    """The tiny run's trainer wrote its per-token log-probs of every trained call into the data pool,
    keyed by call and step: each step's group carries its step, and each generated token's trainer
    log-prob is the rollout's sampling log-prob of that token (the same weights, tempered the same: a
    sync run trains version v on version v's rollouts), so a token off by one would show."""
    _, trained, _, _ = runs
    with DataPool(trained / "datapool.sqlite") as pool:
        episodes = pool.episodes(status="finished")
        recorded = pool.trainer_logprobs(c.call_id for e in episodes for c in e.calls)
    steps = {e.group_id.split(":")[0]: {recorded[c.call_id][0] for c in e.calls if c.call_id in recorded}
             for e in episodes if e.group_id.startswith("step")}
    assert steps == {"step0": {1}, "step1": {2}}
    compared = 0
    for e in episodes:
        if not e.group_id.startswith("step"):
            continue
        v = get(server, "/api/episode", run="trained", id=e.episode_id).json()
        assert v["has_trainer_logprobs"]
        for s in v["samples"]:
            gen = [t for t in s["tokens"] if t["mask"]]
            assert all(t["tlp"] is not None for t in gen)
            assert [t["tlp"] for t in gen] == pytest.approx([t["blp"] for t in gen], abs=1e-4)  # off by one: ~2.4
            assert [t["blp"] for t in gen] == [t["slp"] for t in gen]  # rollout.temperature=0.8: tempered
            compared += len(gen)
    assert compared > 100


def test_config_shows_knobs_changed_from_defaults(runs, server):
    r = get(server, "/api/config", run="agentic")
    assert "sekrit" not in r.text  # the gateway's admin key is never shown (the dashboard sits beside the gateway)
    c = r.json()
    assert c["knobs"][[k["key"] for k in c["knobs"]].index("gateway.admin_key")]["value"] == "***"
    knobs = {k["key"]: k for k in c["knobs"]}
    assert knobs["model.source"]["value"] == "tiny" and knobs["model.source"]["changed"]
    assert knobs["rollout.task"]["value"] == "calculator" and not knobs["rollout.task"]["changed"]  # the default
    assert knobs["train.lr"]["value"] == 0.05 and knobs["train.lr"]["default"] != 0.05
    assert not knobs["engine.prefix_cache"]["changed"] and knobs["engine.prefix_cache"]["description"]
    assert "task: calculator" in c["config_yaml"]


def test_data_pool_is_read_only_and_live(runs, server):
    _, _, agentic, _ = runs
    f = agentic / "datapool.sqlite"
    before = f.read_bytes()
    assert get(server, "/api/episode", run="agentic", id="ep-agentic-1").status_code == 200
    assert f.read_bytes() == before  # nothing written by the dashboard
    # a running job records a new group: the next request shows it, no restart
    with DataPool(f) as pool:
        ep = Episode("t2", "step1:t2", status=EpisodeStatus.RUNNING, episode_id="ep-live")
        pool.put_episode(ep)
        pool.add_call(Call("ep-live", [1, 2, 3], [4, 5], [-1.0, -1.0], [-1.0, -1.0], [2, 2], "stop", call_id="c-live"))
        groups = get(server, "/api/groups", run="agentic").json()
        assert [b["bucket"] for b in groups] == ["step 1", "step 2"]
        v = get(server, "/api/episode", run="agentic", id="ep-live").json()
        assert [(t["id"], t["mask"]) for t in v["samples"][0]["tokens"]] == [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1)]
    # and metrics appended by the job show in the next curves read
    with (agentic / "metrics.jsonl").open("a") as out:
        out.write(json.dumps({**AGENTIC_STEPS[-1], "step": 4, "reward": 1.0}) + "\n")
    rows = get(server, "/api/curves", run="agentic").json()["runs"]["agentic"]["step"]
    assert [r["reward"] for r in rows] == [0.25, 0.5, 0.75, 1.0]


@pytest.fixture(scope="module")
def audited(runs, tmp_path_factory):
    """A server over the trained and agentic runs, a real run whose later calls drift, and a run without a
    tokenizer; the runs by key."""
    d = tmp_path_factory.mktemp("audited")
    paths = {"trained": runs[1], "agentic": runs[2], "drifting": drifting_run(d), "untokenized": untokenized_run(d)}
    with Server(create_app(list(paths.values()))) as srv:
        yield srv, paths


def _cli_audit(path, examples=5):
    """What `arborl audit` prints last for the run (arborl/audit.py, as cli.py's audit builds it)."""
    report, tok = audit.audit_run(path, examples=examples)
    return json.loads(json.dumps({**report.summary(), "examples": audit.decoded_examples(report, tok)}))


def test_audit_is_arborl_audits_answer_for_a_real_run(audited):
    srv, paths = audited
    for key in ("trained", "drifting"):
        f = paths[key] / "datapool.sqlite"
        before = f.read_bytes()
        got = get(srv, "/api/audit", run=key).json()
        assert got == _cli_audit(paths[key])
        assert f.read_bytes() == before  # the audit wrote nothing
        assert got["calls"] > 0 and got["audited"] == got["calls"]  # every chat request recorded
        assert got["not_recorded"] == got["token_calls"] == 0
    with DataPool(paths["trained"] / "datapool.sqlite") as pool:
        assert get(srv, "/api/audit", run="trained").json()["calls"] == sum(
            len(e.calls) for e in pool.episodes())
    assert get(srv, "/api/audit", run="trained").json()["drift_calls"] == 0  # one turn: the prompt is the render
    # three turns with stitching off: the later calls' prompts are the replies re-rendered as text
    d = get(srv, "/api/audit", run="drifting").json()
    assert d["calls"] == 12 and d["drift_calls"] > 0 and d["unfaithful_calls"] > 0
    assert d["drift_rate"] == d["drift_calls"] / d["audited"]
    assert len(d["examples"]) == min(5, d["drift_calls"])
    for e in d["examples"]:
        assert e["engine"] != e["rerender"] and e["position"] > 0 and not e["stitched"]
    assert len(get(srv, "/api/audit", run="drifting", examples=1).json()["examples"]) == 1


def test_audit_of_a_run_without_a_data_pool_or_a_chat_template_is_a_4xx_with_the_reason(audited, tmp_path):
    srv, paths = audited
    r = get(srv, "/api/audit", run="untokenized")
    assert r.status_code == 404 and "no tokenizer" in r.json()["detail"]
    (paths["untokenized"] / "datapool.sqlite").rename(tmp_path / "moved.sqlite")
    try:
        r = get(srv, "/api/audit", run="untokenized")
        assert r.status_code == 404 and "has no datapool.sqlite" in r.json()["detail"]
    finally:
        (tmp_path / "moved.sqlite").rename(paths["untokenized"] / "datapool.sqlite")
    # the agentic run's checkpoint holds a bare tokenizer.json: no chat template to re-render with
    r = get(srv, "/api/audit", run="agentic")
    assert r.status_code == 404 and "no chat template" in r.json()["detail"]
    with pytest.raises(ArborlError, match="no chat template"):
        audit.audit_run(paths["agentic"])
    r = get(srv, "/api/audit", run="nope")
    assert r.status_code == 404 and "unknown run 'nope'" in r.json()["detail"]
    assert get(srv, "/api/audit", run="drifting", examples=-1).status_code == 422


def test_audit_is_kept_until_the_data_pool_changes(audited, tmp_path, monkeypatch):
    """Computed once per state of the data pool: again only after a job wrote to it."""
    run = tmp_path / "copy"
    shutil.copytree(audited[1]["drifting"], run)
    done = []

    def counted(*a, **kw):
        done.append(a)
        return audit.audit_run(*a, **kw)

    monkeypatch.setattr(faithfulness, "audit_run", counted)
    with Server(create_app([run])) as srv:
        first = get(srv, "/api/audit", run="copy").json()
        assert get(srv, "/api/audit", run="copy").json() == first and len(done) == 1
        with DataPool(run / "datapool.sqlite") as pool:  # a running job records a token-in call
            pool.put_episode(Episode("t9", "step1:t9", status=EpisodeStatus.FINISHED, episode_id="ep-new"))
            pool.add_call(Call("ep-new", [1, 2], [3], [-1.0], [-1.0], [1], "stop", call_id="c-new"))
            later = get(srv, "/api/audit", run="copy").json()
        assert len(done) == 2
        assert (later["calls"], later["token_calls"]) == (first["calls"] + 1, 1)
        assert later == _cli_audit(run)


def test_unknown_paths_are_typed_errors(tmp_path):
    with pytest.raises(RunNotFoundError, match="does not exist"):
        create_app([tmp_path / "missing"])


@pytest.mark.slow  # starts `arborl serve` in a subprocess
def test_dashboard_is_served_under_arborl_serve(runs, tmp_path):
    """`arborl serve` mounts the dashboard of runs_dir at /dashboard beside the gateway."""
    d = runs[0]
    cmd = arborl_cmd("serve", "--port", "0", *set_args([f"runs_dir={d}", "name=served", *TINY]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        url = proc.stdout.readline().strip()
        assert url.endswith("/v1"), proc.stderr.read()
        base = url[:-3]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
        page = httpx.get(base + "/dashboard/curves", timeout=30)
        assert page.status_code == 200 and '<base href="/dashboard/">' in page.text
        keys = [r["key"] for r in httpx.get(base + "/dashboard/api/runs", timeout=30).json()]
        assert keys == ["agentic", "served", "trained", "warm"]
        js = httpx.get(base + "/dashboard/static/plotly.min.js", timeout=30)
        assert js.status_code == 200 and len(js.content) > 1_000_000
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
