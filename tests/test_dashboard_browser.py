"""The dashboard in a real headless browser (Debian's chromium driven by Playwright): every page loads
with no console error; the curves hold the run's values (two runs overlaid), a line per held-out split
with the SFT stage a point apart, and titles clear of the plot toolbar; the timeline draws one
bar per recorded piece; the trajectory view shows the recorded token ids decoded, coloured by the loss
mask the data pool implies (built here from the calls by hand), and the other colourings; the token
audit page shows `arborl audit`'s counts and drifted calls of a real drifting run; a screenshot of each
page goes to test-artifacts/dashboard/."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from urllib.parse import quote

import pytest
from helpers.dashboard_runs import AGENTIC_STEPS, agentic_run, drifting_run, trained_run, warm_run
from test_dashboard_api import Server

from arborl.audit import audit_run, decoded_examples
from arborl.dashboard import create_app
from arborl.datapool import DataPool

pytestmark = pytest.mark.slow  # a training run and a browser: about a minute

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
        "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts" / "dashboard"
MASK_COLOURS = {1: "rgb(187, 247, 208)", 0: "rgb(229, 231, 235)"}  # app.js tokenColor, mode "mask"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    assert shutil.which(CHROMIUM), f"{CHROMIUM} is missing: `make browser` (apt-get install -y chromium) installs it"
    from playwright.sync_api import sync_playwright

    d = tmp_path_factory.mktemp("runs")
    trained = trained_run(d)
    agentic, written = agentic_run(d)
    warm_run(d)
    drifting = drifting_run(tmp_path_factory.mktemp("drifting"))
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with Server(create_app([d, drifting])) as srv, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        yield srv, browser, trained, agentic, written, drifting
        browser.close()


def open_page(site, path: str, shot: str, full: bool = True):
    """The page at ``path`` once it says it is drawn; fails on any console error or uncaught exception."""
    srv, browser = site[0], site[1]
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(srv.url + path)
    page.wait_for_selector("body[data-ready]", timeout=30_000)
    assert page.get_attribute("body", "data-ready") == "1", page.inner_text("main")
    page.screenshot(path=str(ARTIFACTS / f"{shot}.png"), full_page=full)
    assert errors == [], errors
    return page


def test_runs_page_lists_both_runs(site):
    page = open_page(site, "/", "runs")
    page.wait_for_selector("#runs tr[data-run]")
    shown = page.eval_on_selector_all("#runs tr[data-run]", "rows => rows.map(r => r.dataset.run)")
    assert shown == ["agentic", "trained", "warm", "drifting"]
    page.close()


def test_curves_show_the_runs_values_overlaid(site):
    trained = site[2]
    page = open_page(site, "/curves?run=agentic&run=trained", "curves")
    traces = page.evaluate("""() => document.querySelector('[data-metric="reward"]').data
                                 .map(t => ({name: t.name, x: Array.from(t.x), y: Array.from(t.y)}))""")
    rows = [json.loads(x) for x in (trained / "metrics.jsonl").read_text().splitlines()]
    want = [r for r in rows if r["kind"] == "step"]
    assert traces == [
        {"name": "agentic", "x": [1, 2, 3], "y": [r["reward"] for r in AGENTIC_STEPS]},
        {"name": "trained", "x": [r["step"] for r in want], "y": [r["reward"] for r in want]},
    ]
    acceptance = page.evaluate(
        """() => Array.from(document.querySelector('[data-metric="spec/spec_mean_acceptance_length"]').data[0].y)""")
    assert acceptance == [1.5, 2.5, 3.5]
    # a column no list names (another helper's metric) is drawn when "all other metrics" opens
    page.click("#more summary")
    page.wait_for_selector('[data-metric="zz_custom/metric"] .scatterlayer .point')
    custom = page.evaluate("""() => Array.from(document.querySelector('[data-metric="zz_custom/metric"]').data[0].y)""")
    assert custom == [7.0, 8.0, 9.0]
    assert page.locator('[data-metric="reward"] .scatterlayer .point').count() == 3 + len(want)
    page.close()


def test_curve_titles_clear_the_toolbar_and_held_out_splits_are_separate_lines(site):
    page = open_page(site, "/curves?run=agentic&run=warm", "curves-held-out")
    traces = page.evaluate("""() => document.querySelector('[data-metric="eval_success"]').data
                                 .map(t => ({name: t.name, mode: t.mode, x: Array.from(t.x)}))""")
    assert traces == [
        {"name": "agentic eval", "mode": "lines+markers", "x": [0, 3]},
        {"name": "agentic eval_perturbed", "mode": "lines+markers", "x": [0, 3]},
        {"name": "agentic eval after SFT", "mode": "markers", "x": [0]},
        {"name": "agentic eval_perturbed after SFT", "mode": "markers", "x": [0]},
        {"name": "warm eval", "mode": "lines+markers", "x": [0, 1, 2]},
        {"name": "warm eval after SFT", "mode": "markers", "x": [0]},
    ]
    # every chart's title (and any title Plotly draws) is shown apart from the plot's toolbar (the modebar)
    page.hover('[data-metric="reward"]')
    charts = page.evaluate("""() => Array.from(document.querySelectorAll('#main .chart')).map(c => {
        const cap = c.closest('figure') && c.closest('figure').querySelector('figcaption');
        const box = e => e.getBoundingClientRect().toJSON();
        return {metric: c.dataset.metric, caption: cap ? cap.textContent : null,
                modebar: box(c.querySelector('.modebar')),
                titles: [cap, ...c.querySelectorAll('.gtitle')].filter(Boolean).map(box)};
    })""")
    drawn = {c["metric"] for c in charts}
    assert len(charts) > 10 and {"split:agentic", "split:warm", "eval_success", "heldout_nll"} <= drawn

    def overlap(a, b):
        return a["left"] < b["right"] and b["left"] < a["right"] and a["top"] < b["bottom"] and b["top"] < a["bottom"]

    for c in charts:
        assert c["caption"] == c["metric"].removeprefix("split:"), c
        assert c["modebar"]["width"] > 0 and all(t["width"] > 0 for t in c["titles"]), c
        assert not any(overlap(t, c["modebar"]) for t in c["titles"]), c
    page.close()


def test_timeline_has_one_bar_per_piece(site):
    trained = site[2]
    spans = [json.loads(x) for x in (trained / "timeline" / "spans.jsonl").read_text().splitlines()]
    for step in (1, 2):
        page = open_page(site, f"/timeline?run=trained&step={step}", f"timeline-step{step}")
        pieces = [s for s in spans if s["kind"] == "span" and s["step"] == step - 1]
        assert page.locator("#timeline .barlayer .point").count() == len(pieces)
        assert len(pieces) > len({s["request_id"] for s in pieces})  # several pieces per request
        assert f"{len(pieces)} bars" in page.inner_text("#timeline-info")
        page.close()
    page = open_page(site, "/timeline?run=agentic&step=1", "timeline-migration")
    assert page.locator("#timeline .barlayer .point").count() == 5
    assert "1 probes, 1 migrations" in page.inner_text("#timeline-info")
    page.close()


def test_trajectory_tokens_are_decoded_and_coloured_by_the_loss_mask(site):
    written = site[4]
    page = open_page(site, "/trajectories?run=agentic&group=step0:t1&episode=ep-agentic-1", "trajectory")
    tok = written["tokenizer"]
    for i, sample in enumerate(written["samples"]):
        shown = page.eval_on_selector_all(
            f'.tokens[data-sample="{i}"] .tok',
            "els => els.map(e => [+e.dataset.id, +e.dataset.mask, e.textContent, getComputedStyle(e).backgroundColor])")
        assert [(tid, m) for tid, m, _, _ in shown] == sample
        assert [text for _, _, text, _ in shown] == [tok.decode([tid], skip_special_tokens=False) or f"⟨{tid}⟩"
                                                     for tid, _ in sample]
        assert [bg for _, _, _, bg in shown] == [MASK_COLOURS[m] for _, m in sample]
    text = page.inner_text("#episode")
    assert "hidden_tests" in text and "3 passed, 1 failed" in text and "history edited by the agent" in text
    assert "aborted calls" in text and '"result": "89"' in text
    # log-prob colouring: generated tokens by their probability, prompt tokens all one grey
    page.check('input[name="mode"][value="logprob"]')
    colours = page.eval_on_selector_all('.tokens[data-sample="0"] .tok[data-mask="1"]',
                                        "els => els.map(e => getComputedStyle(e).backgroundColor)")
    assert len(set(colours)) > 1 and MASK_COLOURS[1] not in colours
    # the mismatch colouring is offered because this episode recorded trainer log-probs
    assert page.is_enabled('input[name="mode"][value="mismatch"]')
    page.check('input[name="mode"][value="mismatch"]')
    page.screenshot(path=str(ARTIFACTS / "trajectory-mismatch.png"), full_page=True)
    page.close()


def test_a_real_runs_trajectory_shows_the_trainer_logprobs(site):
    """The tiny training run recorded its trainer's log-probs (no fake): the mismatch colouring is on
    for its episodes, every generated token names its trainer log-prob, and they agree with the
    rollout's (a sync run: white, no mismatch)."""
    trained = site[2]
    with DataPool(trained / "datapool.sqlite") as pool:
        ep = next(e for e in pool.episodes(status="finished", with_calls=False) if e.group_id.startswith("step0:"))
    page = open_page(site, f"/trajectories?run=trained&group={quote(ep.group_id)}&episode={ep.episode_id}",
                     "trajectory-trained")
    assert page.is_enabled('input[name="mode"][value="mismatch"]')
    page.check('input[name="mode"][value="mismatch"]')
    shown = page.eval_on_selector_all('.tokens .tok[data-mask="1"]',
                                      "els => els.map(e => [e.title, getComputedStyle(e).backgroundColor])")
    assert shown and all("trainer log-prob" in title for title, _ in shown)
    assert {bg for _, bg in shown} == {"rgb(255, 255, 255)"}
    page.close()


def test_config_page_marks_changed_knobs(site):
    page = open_page(site, "/config?run=agentic", "config", full=False)  # a long table: the first screen
    changed = page.eval_on_selector_all("#knobs tr.changed", "rows => rows.map(r => r.dataset.key)")
    assert "model.source" in changed and "train.lr" in changed and "engine.prefix_cache" not in changed
    page.check("#only-changed")
    assert page.locator("#knobs tr[data-key]").count() == len(changed)
    page.close()


def test_audit_page_shows_the_counts_and_the_drifted_calls_tokens(site):
    """The audit page of a real run whose later calls drift (stitching off): arborl audit's counts, and each
    drifted call's tokens from the first difference on, JSON-quoted so whitespace shows."""
    page = open_page(site, "/audit?run=drifting", "audit")
    report, tok = audit_run(site[5])
    counts = dict(page.eval_on_selector_all("#audit-counts tr[data-key]",
                                            "rows => rows.map(r => [r.dataset.key, r.children[1].textContent])"))
    assert counts == {"calls": str(report.calls), "audited": str(report.audited), "drift_calls": str(report.drift_calls),
                      "drift_rate": f"{100 * report.drift_rate:.1f} %", "unfaithful_calls": str(report.unfaithful_calls),
                      "unfaithful_rate": f"{100 * report.unfaithful_rate:.1f} %",
                      "not_recorded": str(report.not_recorded), "token_calls": str(report.token_calls)}
    assert report.calls == report.audited > 0 and report.drift_calls > 0
    rows = page.eval_on_selector_all("#audit-examples tr[data-call]",
                                     "rows => rows.map(r => Array.from(r.children).map(c => c.textContent))")
    want = decoded_examples(report, tok)
    assert [r[0] for r in rows] == [e["call_id"] for e in want] != []
    assert [(r[2], r[5], r[6]) for r in rows] == [(str(e["position"]), json.dumps(e["engine"], ensure_ascii=False),
                                                   json.dumps(e["rerender"], ensure_ascii=False))
                                                  for e in want]
    page.close()
    # the tiny training run: one turn per episode, every call re-rendered to the engine's own tokens
    page = open_page(site, "/audit?run=trained", "audit-clean")
    report, _ = audit_run(site[2])
    assert report.drift_calls == 0 and report.calls > 0
    assert page.inner_text("#audit-counts tr[data-key=audited] td.num") == str(report.calls)
    assert page.is_visible("#audit-none") and page.locator("#audit-examples").count() == 0
    page.close()
