"""A small command-line coding agent written against the official openai SDK, and nothing of arborl.

Run by `arborl train` with `rollout.task=code_repair` and `rollout.code_repair.agent=command` inside
each episode's sandbox: its current directory is the repository to fix, OPENAI_BASE_URL /
OPENAI_API_KEY reach the run's gateway (every model call is recorded and trained on), ARBORL_TASK holds
the problem statement and ARBORL_SAMPLING the sampling parameters. It works like any CLI coding agent:
the model calls `shell` (run a command) and `write_file`; a reply without a tool call ends it.

It runs unchanged against any OpenAI-compatible server:
    OPENAI_BASE_URL=http://localhost:8000/v1 OPENAI_API_KEY=... OPENAI_MODEL=... python code_repair_agent.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import openai

TOOLS = [
    {"type": "function", "function": {
        "name": "shell", "description": "Run a bash command in the repository; returns its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file's whole content.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                       "required": ["path", "content"]}}},
]
SYSTEM = ("You fix a bug in the Python repository in your current directory. Look at the files with the shell "
          "tool, fix the code with write_file, and reply without a tool call when you are done.")


def run_tool(name: str, args: dict) -> str:
    if name == "shell":
        p = subprocess.run(["bash", "-c", args["command"]], capture_output=True, text=True, timeout=20)
        return (p.stdout + p.stderr)[-3000:] or f"(exit {p.returncode}, no output)"
    if name == "write_file":
        with open(args["path"], "w") as f:
            f.write(args["content"])
        return f"wrote {args['path']}"
    return f"error: unknown tool {name}"


def main(max_turns: int = 6) -> None:
    task = json.loads(os.environ["ARBORL_TASK"])
    sampling = json.loads(os.environ.get("ARBORL_SAMPLING", "{}"))
    client = openai.OpenAI(max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=TOOLS,
                                               **sampling)
        msg = reply.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            print(msg.content or "")
            return
        for tc in msg.tool_calls:
            try:
                out = run_tool(tc.function.name, json.loads(tc.function.arguments or "{}"))
            except Exception as e:  # noqa: BLE001 - a bad tool call is feedback for the model
                out = f"error: {type(e).__name__}: {e}"
            print(f"tool {tc.function.name}: {out[:200]!r}", file=sys.stderr)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})


if __name__ == "__main__":
    main()
