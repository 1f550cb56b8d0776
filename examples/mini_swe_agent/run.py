"""Run the real mini-swe-agent (`mini`, PyPI mini-swe-agent) as one arborl episode's agent.

arborl runs this inside the episode's sandbox (rollout.agent=command; configs/mini_swe_agent.yaml): the
current directory is the repository, OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL reach the run's
gateway, ARBORL_TASK holds the problem statement and ARBORL_SAMPLING the sampling parameters. This
wrapper only does what a user of mini does on a machine without internet: it fills the config's model
name and sampling, points mini's config and trajectory files at /tmp, turns off litellm's price-list
download, and starts `mini` from the same venv as this interpreter. Exit status: mini's.

    .venv-mswea/bin/python examples/mini_swe_agent/run.py --config examples/mini_swe_agent/config.yaml
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml  # mini-swe-agent's own dependency


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="mini-swe-agent YAML config")
    args = ap.parse_args()
    task = json.loads(os.environ["ARBORL_TASK"])["prompt"]
    if not isinstance(task, str):  # chat messages: the last user message is the statement
        task = [m["content"] for m in task if m.get("role") == "user"][-1]
    sampling = json.loads(os.environ.get("ARBORL_SAMPLING") or "{}")
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["model"]["model_name"] = f"openai/{os.environ.get('OPENAI_MODEL', 'policy')}"
    kwargs = cfg["model"].setdefault("model_kwargs", {})
    for key in ("temperature", "top_p", "max_tokens", "seed"):
        if sampling.get(key) is not None:
            kwargs[key] = sampling[key]
    scratch = Path(tempfile.mkdtemp(prefix="mswea-"))
    (scratch / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(scratch), "LANG": "C.UTF-8",
        "OPENAI_BASE_URL": os.environ["OPENAI_BASE_URL"], "OPENAI_API_KEY": os.environ["OPENAI_API_KEY"],
        "MSWEA_CONFIGURED": "true", "MSWEA_SILENT_STARTUP": "1", "MSWEA_GLOBAL_CONFIG_DIR": str(scratch),
        "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
        "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_OFFLINE_MODE": "true", "PYTHONDONTWRITEBYTECODE": "1",
    }
    mini = Path(sys.executable).parent / "mini"
    traj = scratch / "traj.json"
    proc = subprocess.run([str(mini), "-c", str(scratch / "config.yaml"), "-t", task, "-y", "--exit-immediately",
                           "-o", str(traj)], env=env, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    info = json.loads(traj.read_text()).get("info", {}) if traj.is_file() else {}
    print(json.dumps({"exit_status": info.get("exit_status"), "submission": info.get("submission")}))
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
