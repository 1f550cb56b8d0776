"""A verifiers (0.4.x, ``verifiers.v1``) environment, driven for arborl from the interpreter it is installed in.

This file imports nothing of arborl: arborl runs it with ``rollout.verifiers.python`` (a venv holding
verifiers, ``make verifiers`` makes ``.venv-vf``), so verifiers' pins never meet arborl's.

    python verifiers_bridge.py list --env ID_OR_FILE      # one JSON line per task: idx, key, prompt
    python verifiers_bridge.py serve --env ID_OR_FILE     # episodes on request, many at once
    python verifiers_bridge.py run --env ID_OR_FILE       # one episode, a black-box agent program

``serve`` loads the environment once and reads one JSON request per stdin line: ``{"id", "idx",
"base_url", "api_key", "model", "sampling"}`` (the task and the episode's gateway session); it answers
``{"id", "result"}`` (or ``{"id", "error"}``) on stdout, in the order episodes finish, and exits when
stdin closes. ``run`` takes the same from the ``command`` agent's environment (``ARBORL_TASK``,
``OPENAI_BASE_URL``, ``OPENAI_API_KEY``, ``OPENAI_MODEL``, ``ARBORL_SAMPLING``) and prints the result.
The environment runs as verifiers runs it -- its taskset, its
``Env.run`` (the multi-turn environment responses), its rewards and ``finalize`` -- with every model
turn sent by an in-process harness through verifiers' own interception server to the gateway, where
arborl records it token by token. verifiers' hosted defaults are replaced: a local subprocess runtime
(not a hosted sandbox), the gateway as the inference endpoint (not a hosted one), no ``uv`` download
(no stock harness is used). The environment is named by its id (an importable module exporting one
``Taskset``) or by ``path/to/file.py`` (``:Attr`` to pick one ``Taskset``/``Env``).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import sys
import types
from pathlib import Path
from typing import Any, Literal

HARNESS_ID = "arborl_gateway_harness"


def register_file(spec: str) -> str:
    """``dir/file.py[:Attr]`` -> a plugin id verifiers can import (module names must be lower case)."""
    path, _, attr = spec.partition(":")
    file = Path(path).expanduser().resolve()
    if not file.is_file():
        raise SystemExit(f"rollout.verifiers.env: {file} does not exist")
    name = ("arborl_vf_" + file.stem).replace("-", "_").lower()
    if name not in sys.modules:
        s = importlib.util.spec_from_file_location(name, file)
        module = importlib.util.module_from_spec(s)
        sys.modules[name] = module
        s.loader.exec_module(module)
    if not attr:
        return name
    shim = types.ModuleType(f"{name}_{attr}".lower())
    shim.__all__ = [attr]
    setattr(shim, attr, getattr(sys.modules[name], attr))
    sys.modules[shim.__name__] = shim
    return shim.__name__


def env_id(spec: str) -> str:
    return register_file(spec) if spec.partition(":")[0].endswith(".py") else spec


def register_harness() -> None:
    """An in-process harness: each model turn is one non-streaming chat call to verifiers' interception
    endpoint, which relays it to the gateway and records it on the trace."""
    import verifiers.v1 as vf
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.runtimes import ProgramResult
    from verifiers.v1.types import SystemMessage, UserMessage

    class GatewayHarnessConfig(vf.HarnessConfig):
        mode: Literal["http"] = "http"

    class GatewayHarness(vf.Harness[GatewayHarnessConfig]):
        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_RESUME = True  # later user turns relaunch on the whole conversation
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **_):  # noqa: ANN001
            system, prompt = self.resolve_prompt(data)
            msgs = [UserMessage(content=prompt)] if isinstance(prompt, str) else list(prompt or [])
            if system and not any(m.role == "system" for m in msgs):
                msgs.insert(0, SystemMessage(content=system))
            client = AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0)
            try:
                out = await client.chat.completions.create(model=ctx.model, messages=[message_to_wire(m) for m in msgs])
            finally:
                await client.close()
            reply = out.choices[0].message.content or ""
            return ProgramResult(exit_code=0, stdout=reply, stderr="")

    module = types.ModuleType(HARNESS_ID)
    module.GatewayHarness = GatewayHarness
    module.__all__ = ["GatewayHarness"]
    sys.modules[HARNESS_ID] = module


def load_env(spec: str, max_turns: int) -> Any:
    import verifiers.v1 as vf
    from verifiers.v1.utils.loaders import env_config_type

    register_harness()
    ident = env_id(spec)
    cls = env_config_type(ident)
    seats = [name for name, f in cls.model_fields.items()
             if isinstance(f.annotation, type) and issubclass(f.annotation, vf.AgentConfig)]
    seat = {"harness": {"id": HARNESS_ID}, "runtime": {"type": "subprocess"}, "max_turns": max_turns}
    return vf.load_environment(vf.resolve_env_config({"taskset": {"id": ident}, **{s: seat for s in seats}}))


def task_row(task: Any) -> dict[str, Any]:
    data = task.data
    prompt = data.prompt
    if not isinstance(prompt, (str, type(None))):
        prompt = [m.model_dump(exclude_none=True) if hasattr(m, "model_dump") else dict(m) for m in prompt]
    return {"idx": data.idx, "key": str(task.key), "prompt": prompt, "system_prompt": data.system_prompt}


def cmd_list(args: argparse.Namespace) -> int:
    env = load_env(args.env, 1)
    for task in env.taskset:
        print(json.dumps(task_row(task), default=str))
    return 0


async def run_episode(env: Any, tasks: dict[Any, Any], req: dict[str, Any], key_var: str) -> dict[str, Any]:
    """One episode of task ``req["idx"]`` against the gateway session ``req`` names."""
    import verifiers.v1 as vf

    task = tasks.get(req["idx"])
    if task is None:
        raise KeyError(f"the environment has no task with idx {req['idx']!r}")
    os.environ[key_var] = req["api_key"]
    ctx = vf.ModelContext(
        model=req.get("model") or "policy",
        client=vf.EvalClientConfig(base_url=req["base_url"], api_key_var=key_var),
        sampling=vf.SamplingConfig(**{k: v for k, v in (req.get("sampling") or {}).items() if v is not None}))
    try:
        episode = await env.run_episode(task, ctx)
    finally:
        os.environ.pop(key_var, None)
    traces = [t for t in episode.traces if getattr(t.agent, "trainable", True)] or list(episode.traces)
    rewards: dict[str, float] = {}
    weights: dict[str, float] = {}
    for tr in traces:
        for name, r in tr.rewards.items():
            if r is not None and r.score is not None:
                rewards[name] = float(r.score)
                weights[name] = float(r.weight)
    errors = [str(getattr(e, "message", e))[:500] for tr in episode.traces for e in tr.errors]
    return {"ok": bool(episode.ok), "reward": float(sum(tr.reward or 0.0 for tr in traces)), "rewards": rewards,
            "weights": weights, "metrics": {k: v for tr in traces for k, v in tr.metrics.items() if v is not None},
            "turns": sum(tr.num_turns for tr in traces), "errors": errors}


async def cmd_serve(args: argparse.Namespace) -> int:
    """Episodes on request (module docstring); the protocol owns the real stdout, so anything the
    environment prints goes to stderr."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    env = load_env(args.env, args.max_turns)
    tasks = {t.data.idx: t for t in env.taskset}
    loop = asyncio.get_running_loop()
    lines: asyncio.Queue[str | None] = asyncio.Queue()

    def read() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(lines.put_nowait, line)
        loop.call_soon_threadsafe(lines.put_nowait, None)

    async def one(req: dict[str, Any]) -> None:
        try:
            reply = {"id": req["id"], "result": await run_episode(env, tasks, req, f"ARBORL_VF_KEY_{req['id']}")}
        except Exception as e:  # noqa: BLE001 - one episode's failure is its own answer
            reply = {"id": req.get("id"), "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply, default=str) + "\n")

    import threading

    threading.Thread(target=read, daemon=True).start()
    running: set[asyncio.Task] = set()
    async with env.serving():
        while (line := await lines.get()) is not None:
            if line.strip():
                t = asyncio.create_task(one(json.loads(line)))
                running.add(t)
                t.add_done_callback(running.discard)
        await asyncio.gather(*running, return_exceptions=True)
    return 0


async def run_one(args: argparse.Namespace) -> dict[str, Any]:
    env = load_env(args.env, args.max_turns)
    tasks = {t.data.idx: t for t in env.taskset}
    req = {"idx": json.loads(os.environ["ARBORL_TASK"])["metadata"]["idx"], "base_url": os.environ["OPENAI_BASE_URL"],
           "api_key": os.environ["OPENAI_API_KEY"], "model": os.environ.get("OPENAI_MODEL"),
           "sampling": json.loads(os.environ.get("ARBORL_SAMPLING") or "{}")}
    async with env.serving():
        return await run_episode(env, tasks, req, "ARBORL_VF_KEY")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["list", "serve", "run"])
    ap.add_argument("--env", required=True)
    ap.add_argument("--max-turns", type=int, default=8)
    args = ap.parse_args()
    if args.mode == "list":
        return cmd_list(args)
    if args.mode == "serve":
        return asyncio.run(cmd_serve(args))
    out = asyncio.run(run_one(args))
    print(json.dumps(out, default=str))
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
