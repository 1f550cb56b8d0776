"""A scripted black-box CLI agent for the sandboxed-command test: the official openai client, one model
call, then it acts on its current directory (the sandboxed workspace), tries to reward itself on its own
session (POST /v1/sessions/<own>/reward with its key) and reports what it saw."""

import json
import os
import socket
import subprocess

import httpx
import openai

client = openai.OpenAI(max_retries=0)
r = client.chat.completions.create(model=os.environ["OPENAI_MODEL"], messages=[{"role": "user", "content": "fix it"}],
                                   **json.loads(os.environ["ARBORL_SAMPLING"]))
with open("fixed.txt", "w") as f:
    f.write(r.choices[0].message.content or "")
try:  # the host's network is not there: only the gateway, through the forwarder
    socket.create_connection(("8.8.8.8", 53), timeout=1)
    net = "reachable"
except OSError:
    net = "unreachable"
reward = httpx.post(f"{os.environ['OPENAI_BASE_URL']}/sessions/{os.environ['ARBORL_SESSION_ID']}/reward",
                    json={"value": 100.0, "name": "self"}, headers={"Authorization": f"Bearer {os.environ['OPENAI_API_KEY']}"})
print(json.dumps({"reward_status": reward.status_code, "uid": os.getuid(), "cwd": os.getcwd(), "net": net, "base_url": os.environ["OPENAI_BASE_URL"],
                  "listing": sorted(os.listdir(".")), "shell": subprocess.run(["id", "-u"], capture_output=True,
                                                                              text=True).stdout.strip()}))
