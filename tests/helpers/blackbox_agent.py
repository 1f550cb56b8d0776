"""A black-box agent for the runner tests: an ordinary program using the official openai client.

It knows nothing of arborl except the environment the runner sets (OPENAI_BASE_URL, OPENAI_API_KEY,
OPENAI_MODEL, ARBORL_TASK, ARBORL_SESSION_ID). Modes (argv[1]):

* ``tools``: a tool-use loop with an ``add`` tool; prints the final answer; posts a step reward (and says
  on stderr what the gateway answered: an untrusted agent's reward is refused);
* ``hang``: starts a child process that writes its pid to argv[2], then both sleep (timeout test);
* ``fail``: writes to both streams and exits 3;
* ``finish-self``: one call, then finishes its own session as "failed" and exits 0;
* ``task``: prints where the task came from and the prompt's length.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import openai

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.",
                                        "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                        "b": {"type": "integer"}},
                                                       "required": ["a", "b"]}}}


def session_post(path: str, body: dict) -> httpx.Response:
    url = f"{os.environ['OPENAI_BASE_URL']}/sessions/{os.environ['ARBORL_SESSION_ID']}/{path}"
    return httpx.post(url, json=body, headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})


def tools() -> None:
    task = json.loads(os.environ["ARBORL_TASK"])
    client = openai.OpenAI(max_retries=0)  # base_url and api_key come from the environment
    messages = [{"role": "user", "content": task["prompt"]}]
    for _ in range(4):
        r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, tools=[ADD], temperature=0)
        msg = r.choices[0].message
        messages.append(msg.model_dump(exclude_none=True))
        if not msg.tool_calls:
            print(msg.content, flush=True)
            posted = session_post("reward", {"value": 1.0, "name": "answered", "call_id": r.choices[0].model_extra["call_id"]})
            print(f"reward: HTTP {posted.status_code}", file=sys.stderr, flush=True)
            return
        for tc in msg.tool_calls:
            args = json.loads(tc.function.arguments)
            print(f"tool {tc.function.name}({args})", file=sys.stderr, flush=True)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": str(args["a"] + args["b"])})
    sys.exit(2)


def hang(pid_file: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", f"import os,time; open({pid_file!r},'w').write(str(os.getpid())); time.sleep(600)"])
    print(f"started child {child.pid}", flush=True)
    time.sleep(600)


def fail() -> None:
    print("some output", flush=True)
    print("something went wrong", file=sys.stderr, flush=True)
    sys.exit(3)


def finish_self() -> None:
    client = openai.OpenAI(max_retries=0)
    client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    session_post("finish", {"status": "failed"})


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "tools":
        tools()
    elif mode == "hang":
        hang(sys.argv[2])
    elif mode == "fail":
        fail()
    elif mode == "finish-self":
        finish_self()
    elif mode == "task":
        if "ARBORL_TASK_FILE" in os.environ:
            with open(os.environ["ARBORL_TASK_FILE"]) as f:
                print("file", len(json.load(f)["prompt"]))
        else:
            print("env", len(json.loads(os.environ["ARBORL_TASK"])["prompt"]), os.environ["OPENAI_API_BASE"])
