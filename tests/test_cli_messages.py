"""What the command line says: --version, a misspelt knob gets "did you mean", errors are not wrapped
mid-phrase, sim.policies takes a comma-separated list and a bad policy name fails before simulating;
curves.png and the Gantt charts say what they show."""

from __future__ import annotations

import json
import re
import subprocess

from helpers.tiny_run import ENV, arborl_cmd
from typer.testing import CliRunner

from arborl import __version__
from arborl.cli import app
from arborl.report import plural, run_figure, step_line
from arborl.report.curves import PANELS
from arborl.scheduling.timeline import Timeline

SMALL_SIM = ["--set", "sim.prompts=4", "--set", "sim.group_size=2", "--set", "sim.instances=2", "--set", "sim.steps=1",
             "--set", "sim.length_median=40", "--set", "sim.max_tokens=100"]


def test_version():
    out = subprocess.run(arborl_cmd("--version"), capture_output=True, text=True, env=ENV, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == f"arborl {__version__}"


def test_a_misspelt_knob_gets_a_suggestion_on_one_unwrapped_line():
    out = CliRunner().invoke(app, ["train", "--set", "engine.max_batch_sise=4", "--set", "rollout.lr=0.1"])
    assert out.exit_code == 2
    lines = out.output.splitlines()
    assert ("  engine.max_batch_sise: unknown key (did you mean engine.max_batch_size? see docs/knobs.md for the "
            "valid keys) (got 4)") in lines  # one line although longer than the 80 columns of the console
    assert any("rollout.lr: unknown key (did you mean train.lr?" in x for x in lines)


def test_sim_policies_take_a_comma_separated_list_and_a_bad_name_fails_first():
    runner = CliRunner()
    ok = runner.invoke(app, ["simulate", *SMALL_SIM, "--set", "sim.policies=sync/pinned,sync/seer"])
    assert ok.exit_code == 0, ok.output
    assert set(json.loads(ok.stdout.strip().splitlines()[-1])["policies"]) == {"sync/pinned", "sync/seer"}
    bad = runner.invoke(app, ["simulate", *SMALL_SIM, "--set", "sim.policies=sync/pinned,sync/seerr"])
    assert bad.exit_code == 2 and "sim.policies: unknown dispatch policy 'seerr'" in bad.output
    assert "sync/pinned:" not in bad.output  # nothing was simulated before the check


def test_plural_and_the_plain_step_line():
    assert plural(1, "step") == "1 step" and plural(2, "step") == "2 steps" and plural(0, "episode") == "0 episodes"
    m = {"step": 3, "reward": 0.5, "success": 0.25, "rollout_tokens_per_s": 411.6, "step_s": 3.21, "loss/total": 0.0123}
    assert step_line(m, 10) == "step 3/10  reward 0.500  success 0.250  412 tok/s  step 3.2s  loss 0.0123"
    assert step_line({**m, "loss/total": None}, 10).endswith("loss -")


def test_curves_cover_the_training_signals_and_the_held_out_evaluation():
    titles = [t for t, _, _ in PANELS]
    for want in ("reward / success", "loss", "KL", "grad norm", "clip fraction", "train-inference mismatch",
                 "rollout tokens/s", "held-out evaluation"):
        assert want in titles
    records = [{"kind": "step", "step": s, **{k: 0.1 * s for _, keys, kind in PANELS if kind == "step" for k in keys}}
               for s in (1, 2)]
    records += [{"kind": "eval", "step": s, "eval_success": 0.5, "eval_reward": 0.6} for s in (0, 2)]
    fig = run_figure(records)
    drawn = {ax.get_title(): [line.get_label() for line in ax.get_lines()] for ax in fig.axes if ax.get_title()}
    for title, keys, _ in PANELS:
        assert drawn[title] == list(keys), title
    empty = run_figure([{"kind": "step", "step": 1, "reward": 0.5}])
    assert any(t.get_text() == "no data" for ax in empty.axes for t in ax.texts)  # e.g. KL when it is off


def test_the_gantt_chart_has_a_legend():
    tl = Timeline()
    tl.start(0.0, "a", "g", 0)
    tl.end(1.0, "a", 5, "finish")
    tl.start(0.5, "b", "g", 1, probe=True)
    tl.end(2.0, "b", 3, "cancel")
    tl.mark(2.0, "publish")
    legend = tl.gantt_figure().axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["engine instance 0", "engine instance 1", "cancelled / aborted", "probe request",
                      "weights published"]


def test_errors_of_every_command_are_single_red_lines():
    out = CliRunner().invoke(app, ["export", "/nonexistent/run"])
    assert out.exit_code == 2
    assert re.fullmatch(r"/nonexistent/run holds no checkpoint: a run saves one at its end, every "
                        r"rollout.checkpoint_every steps, and when Ctrl-C / SIGTERM stops it\n", out.output)
