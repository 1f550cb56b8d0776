"""The built-in white-box code agent: a ReAct loop whose tools act on the episode's sandboxed
workspace -- list, read, write and replace in files, run a shell command -- and whose final answer
(a reply without a tool call) submits the workspace as it is.

Every tool runs as a command in the sandbox (``runtime.run``), never on the host: a path the agent
names, a symlink it made, a command it runs can only reach what the sandbox shows.
"""

from __future__ import annotations

import json
from typing import Any

from arborl.agents.react import ReActAgent, Tool
from arborl.envs.base import CommandResult, Runtime, Workspace

SYSTEM_PROMPT = (
    "You are a software engineer fixing a bug in a small Python repository (your current directory). "
    "Use the tools to look at the files, edit the code and run commands (for example python -c or your own "
    "quick checks). When the bug is fixed, answer with a short summary and no tool call: that submits your "
    "changes. The tests that judge your fix are hidden."
)

_WRITE = "import json,sys; a=json.load(sys.stdin); open(a['path'],'w').write(a['content']); print('wrote', len(a['content']), 'characters to', a['path'])"
_REPLACE = (
    "import json,sys; a=json.load(sys.stdin); s=open(a['path']).read(); n=s.count(a['old']); "
    "sys.exit(f\"error: the text to replace occurs {n} times in {a['path']}; it must occur exactly once\") if n!=1 else None; "
    "open(a['path'],'w').write(s.replace(a['old'],a['new'])); print('replaced 1 occurrence in', a['path'])"
)


def _text(res: CommandResult) -> str:
    out = res.stdout + (("\n" + res.stderr) if res.stderr.strip() else "")
    if res.timed_out:
        out += "\n(the command was killed: it ran past its time limit)"
    elif res.returncode:
        out += f"\n(exit code {res.returncode})"
    return out.strip() or "(no output)"


def _param(**props: str) -> dict[str, Any]:
    return {"type": "object", "properties": {k: {"type": "string", "description": d} for k, d in props.items()},
            "required": list(props)}


def code_tools(runtime: Runtime, ws: Workspace, *, timeout_s: float = 30.0, python: str = "python") -> list[Tool]:
    """The code agent's tools, bound to one episode's workspace."""

    async def run(argv: list[str], stdin: str | None = None) -> str:
        return _text(await runtime.run(ws, argv, timeout_s=timeout_s, stdin=stdin))

    async def list_files(path: str = ".") -> str:
        return await run(["find", path, "-type", "f", "-not", "-path", "*/.*", "-not", "-name", "*.pyc"])

    async def read_file(path: str) -> str:
        return await run(["cat", "-n", "--", path])

    async def write_file(path: str, content: str) -> str:
        return await run([python, "-c", _WRITE], json.dumps({"path": path, "content": content}))

    async def replace_in_file(path: str, old: str, new: str) -> str:
        return await run([python, "-c", _REPLACE], json.dumps({"path": path, "old": old, "new": new}))

    async def run_command(command: str) -> str:
        return await run(["bash", "-c", command])

    return [
        Tool("list_files", list_files, "List the files under a directory of the repository.",
             {"type": "object", "properties": {"path": {"type": "string", "description": "directory, default ."}}}),
        Tool("read_file", read_file, "Show a file with line numbers.", _param(path="file path")),
        Tool("write_file", write_file, "Replace a file's whole content.", _param(path="file path", content="new content")),
        Tool("replace_in_file", replace_in_file, "Replace one exact occurrence of a text in a file.",
             _param(path="file path", old="exact text to replace (must occur once)", new="replacement text")),
        Tool("run_command", run_command, "Run a shell command in the repository and see its output.",
             _param(command="a bash command")),
    ]


def code_agent(runtime: Runtime, ws: Workspace, sampling: dict[str, Any], *, max_turns: int = 8,
               timeout_s: float = 30.0, system_prompt: str = SYSTEM_PROMPT) -> ReActAgent:
    """The ReAct code agent on ``ws``."""
    return ReActAgent(code_tools(runtime, ws, timeout_s=timeout_s), system_prompt=system_prompt,
                      max_turns=max_turns, **sampling)
