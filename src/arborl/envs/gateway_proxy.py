"""Inside a sandbox with no network: reach the gateway's Unix socket over TCP on the sandbox's own
loopback, so an unmodified OpenAI client (``OPENAI_BASE_URL=http://127.0.0.1:PORT/v1``) works.

Standard library only, run as ``python -c <this source> UNIX_SOCKET PORT -- AGENT ARGV...``
(``proxy_argv``): it forwards connections on 127.0.0.1:PORT to UNIX_SOCKET, runs the agent with
``OPENAI_BASE_URL`` pointing there, and exits with the agent's exit code.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from pathlib import Path


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _serve(listener: socket.socket, unix_path: str) -> None:
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(unix_path)
        except OSError:
            conn.close()
            continue
        threading.Thread(target=_pipe, args=(conn, up), daemon=True).start()
        threading.Thread(target=_pipe, args=(up, conn), daemon=True).start()


def main(argv: list[str]) -> int:
    unix_path, port, sep, *agent = argv
    if sep != "--" or not agent:
        print("usage: gateway_proxy UNIX_SOCKET PORT -- AGENT ARGV...", file=sys.stderr)
        return 2
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", int(port)))
    listener.listen(64)
    threading.Thread(target=_serve, args=(listener, unix_path), daemon=True).start()
    env = dict(os.environ, OPENAI_BASE_URL=f"http://127.0.0.1:{port}/v1")
    try:
        return subprocess.call(agent, env=env)
    except OSError as e:
        print(f"cannot start {agent[0]}: {e}", file=sys.stderr)
        return 127


def proxy_argv(python: str, unix_socket: Path, agent_argv: list[str], port: int = 8000) -> list[str]:
    """The argv that runs ``agent_argv`` in a sandbox with the gateway on 127.0.0.1:``port``."""
    return [python, "-c", Path(__file__).read_text(), str(unix_socket), str(port), "--", *agent_argv]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
