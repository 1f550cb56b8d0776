"""Render a scripted expert's shell commands as a mini-swe-agent trajectory, by running mini-swe-agent itself.

`arborl envs demos code_repair --render-command ...` runs this inside each demonstration's sandbox (the
repository is the current directory) with JSON on stdin: {"task": statement, "steps": [{"thought",
"command"}, ...]}. mini's own DefaultAgent runs with the config's templates and LocalEnvironment, its model
replaced by mini's DeterministicModel replying "<thought>\n\n```bash\n<command>\n```" for each step, so
every observation is the real output of the command and every message is in mini's format. The last line
of stdout is {"messages": [...]}: what mini sent to its model, then the last reply.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import yaml


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    args = ap.parse_args()
    os.environ.setdefault("MSWEA_GLOBAL_CONFIG_DIR", tempfile.mkdtemp(prefix="mswea-"))
    os.environ.update(MSWEA_CONFIGURED="true", MSWEA_SILENT_STARTUP="1", LITELLM_LOCAL_MODEL_COST_MAP="True",
                      LITELLM_OFFLINE_MODE="true")
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.test_models import DeterministicModel, make_output

    plan = json.load(sys.stdin)
    cfg = yaml.safe_load(Path(args.config).read_text())
    regex = re.compile(cfg["model"]["action_regex"], re.DOTALL)
    outputs = []
    for step in plan["steps"]:
        content = f"{step['thought']}\n\n```bash\n{step['command']}\n```"
        found = regex.findall(content)
        if found != [step["command"]]:  # the policy must be able to write it: mini's own parser reads it back
            raise SystemExit(f"mini's action_regex does not read back {step['command']!r} from the reply")
        outputs.append(make_output(content, [{"command": step["command"]}], cost=0.0))
    model = DeterministicModel(outputs=outputs, observation_template=cfg["model"]["observation_template"])
    env_cfg = {k: v for k, v in cfg.get("environment", {}).items() if k != "environment_class"}
    agent_cfg = {k: v for k, v in cfg["agent"].items() if k != "agent_class"}
    agent = DefaultAgent(model, LocalEnvironment(**env_cfg), **agent_cfg)
    result = agent.run(plan["task"])
    messages = [{"role": m["role"], "content": m["content"]} for m in agent.messages if m["role"] != "exit"]
    print(json.dumps({"messages": messages, "exit_status": result.get("exit_status")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
