"""Sessions: one agent episode each, with its own key.

A session *is* an episode of the data pool (``session_id == episode_id``). Its key (``sk-arborl-...``)
is the only credential that can call the model in it or read and write it; keys are kept as
SHA-256 digests. A session has a second key, the harness key, for the code that runs the episode (a
white-box agent loop, a rollout worker, the task's scorer): only it (or the admin key) posts process
rewards, unless the session trusts its agent (``rollout.trust_agent_rewards``): the agent key is what
a black-box or sandboxed agent program holds, and an untrusted program must not reward itself. Everything here is guarded by locks, so the HTTP server's event loop and
in-process (white-box) callers on other threads may use the same sessions.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from arborl.gateway.errors import AuthenticationError, ConflictError, NotFoundError, PermissionDeniedError
from arborl.gateway.stitching import SessionHistory
from arborl.types import Call, Episode, EpisodeStatus


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "sk-arborl-" + secrets.token_urlsafe(24)


@dataclass(eq=False)
class Session:
    episode: Episode  # the in-memory episode row (status, meta, interactions); calls live in the data pool
    stitching: bool
    engine_index: int | None = None  # session affinity: the engine its calls go to
    history: SessionHistory = field(default_factory=SessionHistory)
    lock: threading.Lock = field(default_factory=threading.Lock)
    write_lock: threading.Lock = field(default_factory=threading.Lock)  # orders episode-row writes
    calls: int = 0  # calls recorded
    in_flight: int = 0  # requests being served
    last_call_id: str | None = None
    trust_rewards: bool = False  # its agent key may post rewards (rollout.trust_agent_rewards)
    replay: list[Call] = field(default_factory=list)  # recorded calls to serve again, in order (Gateway.create_session)

    def replayed(self, prompt: list[int]) -> Call | None:
        """The next recorded call to serve again when ``prompt`` is exactly its prompt; else None, and the
        rest of the replay is dropped (the conversation went another way)."""
        with self.lock:
            if self.replay and list(self.replay[0].prompt_token_ids) == list(prompt):
                return self.replay.pop(0)
            self.replay.clear()
            return None

    @property
    def session_id(self) -> str:
        return self.episode.episode_id

    @property
    def finished(self) -> bool:
        return self.episode.status != EpisodeStatus.RUNNING

    def check_open(self) -> None:
        if self.finished:
            raise ConflictError(
                f"session {self.session_id} is {self.episode.status.value}: it takes no more model calls "
                "(create a new session for a new episode)"
            )


@dataclass
class SessionInfo:
    """An open session and the keys handed out for it."""

    session: Session
    api_key: str  # the agent's key (what a black-box or sandboxed agent program is given)
    harness_key: str | None = None  # the harness's key: rewards too, whatever the agent is trusted with

    @property
    def session_id(self) -> str:
        return self.session.session_id


class SessionStore:
    def __init__(self, admin_key: str) -> None:
        if not admin_key:
            raise ValueError("the admin key must be a non-empty string")
        self._admin = _digest(admin_key)
        self._lock = threading.Lock()
        self._sessions: dict[str, Session] = {}
        self._by_key: dict[str, str] = {}  # key digest -> session id
        self._harness: set[str] = set()  # digests of harness keys

    def add(self, session: Session, key: str, harness_key: str | None = None) -> None:
        with self._lock:
            if session.session_id in self._sessions:
                raise ConflictError(f"session {session.session_id} already exists")
            self._sessions[session.session_id] = session
            self._by_key[_digest(key)] = session.session_id
            if harness_key is not None:
                self._by_key[_digest(harness_key)] = session.session_id
                self._harness.add(_digest(harness_key))

    def get(self, session_id: str) -> Session | None:
        with self._lock:
            return self._sessions.get(session_id)

    def all(self) -> list[Session]:
        with self._lock:
            return list(self._sessions.values())

    def is_admin(self, key: str | None) -> bool:
        return bool(key) and hmac.compare_digest(_digest(key), self._admin)  # type: ignore[arg-type]

    def check_admin(self, key: str | None) -> None:
        if not self.is_admin(key):
            raise AuthenticationError(
                "this endpoint needs the admin key (Authorization: Bearer <ARBORL_ADMIN_KEY>)"
                if key
                else "missing key: send Authorization: Bearer <admin key>"
            )

    def by_key(self, key: str | None) -> Session:
        """The session ``key`` belongs to, or AuthenticationError."""
        if not key:
            raise AuthenticationError("missing key: send Authorization: Bearer <session api_key> (from POST /v1/sessions)")
        with self._lock:
            sid = self._by_key.get(_digest(key))
            session = self._sessions.get(sid) if sid else None
        if session is None:
            hint = " (the admin key creates sessions; model calls need a session key)" if self.is_admin(key) else ""
            raise AuthenticationError("invalid API key: use the api_key of a session from POST /v1/sessions" + hint)
        return session

    def for_reward(self, key: str | None, session_id: str) -> Session:
        """The session a reward is posted to: with the admin key (the task's scorer) or the session's harness
        key, always; with its agent key, only if the session trusts its agent; 401/403/404 otherwise."""
        if self.is_admin(key):
            session = self.get(session_id)
            if session is None:
                raise NotFoundError(f"no session {session_id!r}")
            return session
        session = self.for_path(key, session_id)
        if _digest(key) in self._harness or session.trust_rewards:  # type: ignore[arg-type]
            return session
        raise PermissionDeniedError(
            "this session's agent may not post rewards on its own session (rollout.trust_agent_rewards=false): "
            "rewards come from the harness (its harness key or the admin key); set rollout.trust_agent_rewards=true "
            "only for an agent program you trust"
        )

    def for_path(self, key: str | None, session_id: str) -> Session:
        """The session named in a URL path, if ``key`` is its key; 401 otherwise (whether or not it exists)."""
        session = self.by_key(key)
        if session.session_id != session_id:
            raise AuthenticationError("this key does not belong to that session")
        return session


def episode_meta(metadata: dict[str, Any], stitching: bool) -> dict[str, Any]:
    return {**metadata, "gateway": {"stitching": stitching, "created_at": time.time()}}
