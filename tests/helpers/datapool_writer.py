"""Writer process for the data pool crash test (tests/test_datapool.py).

Usage: python datapool_writer.py DB_PATH [MAX_EPISODES]

Writes episodes in a tight loop, each through several transactions (put_episode with its first
calls, add_call for the rest, update_episode to finish it), and prints the episode id to stdout
(flushed) only after the last of those commits has returned. Content is a pure function of the
episode index (``make_episode``), so the test can rebuild and compare it exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    from arborl.datapool import DataPool
    from arborl.types import Call, Episode, EpisodeStatus
except ImportError:  # run from a checkout without an installed arborl
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from arborl.datapool import DataPool
    from arborl.types import Call, Episode, EpisodeStatus

N_CALLS = 4
N_PUT = 2  # calls written with put_episode; the rest go through add_call


def episode_id(i: int) -> str:
    return f"crash-ep-{i:06d}"


def make_call(i: int, j: int) -> Call:
    """Call j of episode i; logprobs are exact float32 values so they round-trip exactly."""
    n_prompt = 50 + (i * 7 + j) % 40
    n_out = 100 + (i * 13 + j * 5) % 120
    base = i * 1000 + j * 100
    return Call(
        episode_id=episode_id(i),
        prompt_token_ids=[(base + k) % 49152 for k in range(n_prompt)],
        completion_token_ids=[(base * 3 + k * 11) % 49152 for k in range(n_out)],
        logprobs=[-((k % 97) + 1) / 64.0 for k in range(n_out)],
        sample_logprobs=[-((k % 89) + 1) / 32.0 for k in range(n_out)],
        versions=[i // 10 + (k * 3) // n_out for k in range(n_out)],
        finish_reason="stop" if j % 2 == 0 else "length",
        call_id=f"crash-call-{i:06d}-{j}",
        engine_id=f"engine-{j % 2}",
        created_at=1_700_000_000.0 + i + j / 10,
        latency_s=0.25 * j,
        cached_prompt_tokens=j * 3,
        meta={"i": i, "j": j},
    )


def make_episode(i: int, finished: bool = True) -> Episode:
    return Episode(
        task_id=f"task-{i % 5}",
        group_id=f"group-{i // 4}",
        status=EpisodeStatus.FINISHED if finished else EpisodeStatus.RUNNING,
        episode_id=episode_id(i),
        calls=[make_call(i, j) for j in range(N_CALLS)],
        interactions=[{"step": k, "obs": f"o{i}-{k}"} for k in range(2)],
        reward_components={"correct": float(i % 2)} if finished else {},
        reward=float(i % 2) if finished else None,
        started_at=1_700_000_000.0 + i,
        finished_at=1_700_000_000.0 + i + 5 if finished else None,
        meta={"writer": True, "i": i},
    )


def main() -> None:
    path = sys.argv[1]
    max_episodes = int(sys.argv[2]) if len(sys.argv) > 2 else 1_000_000
    with DataPool(path) as pool:
        for i in range(max_episodes):
            ep = make_episode(i, finished=False)
            ep.calls = ep.calls[:N_PUT]
            pool.put_episode(ep)
            for j in range(N_PUT, N_CALLS):
                pool.add_call(make_call(i, j))
            done = make_episode(i)
            pool.update_episode(
                done.episode_id,
                status=done.status,
                reward=done.reward,
                reward_components=done.reward_components,
                finished_at=done.finished_at,
            )
            sys.stdout.write(done.episode_id + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
