"""A black-box agent for `rollout.agent=command`: an ordinary program using the official openai client.

arborl runs it once per episode with OPENAI_BASE_URL / OPENAI_API_KEY set to the episode's gateway
session (so the client needs no arguments), OPENAI_MODEL, ARBORL_TASK (the task as JSON) and
ARBORL_SAMPLING (the sampling parameters the run trains at, as JSON). What it prints on stdout is its
answer, which the task suite scores; logs go to stderr.
"""

from __future__ import annotations

import json
import os
import sys

import openai


def main() -> None:
    task = json.loads(os.environ["ARBORL_TASK"])
    sampling = json.loads(os.environ.get("ARBORL_SAMPLING", "{}"))
    prompt = task["prompt"]
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    client = openai.OpenAI(max_retries=0)
    reply = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=messages, **sampling)
    print(f"task {task['task_id']}: {reply.usage.completion_tokens} tokens", file=sys.stderr)
    print(reply.choices[0].message.content or "")


if __name__ == "__main__":
    main()
