"""One Harbor task folder, read: ``task.toml``, ``instruction.md``, ``environment/``, ``tests/``, ``solution/``.

Harbor builds ``environment/`` as a container image; arborl has no container engine, so a task runs
in a bubblewrap workspace where its Dockerfile needs nothing an image would give. Read line by line:

* ``FROM <image>``: accepted when the image's name is in ``rollout.harbor.host_images`` (python, debian,
  ubuntu, ...): the sandbox stands in for it with this host's system and Python;
* ``WORKDIR <dir>``: where the workspace appears in the sandbox (the agent's cwd; Harbor's ``/app``
  when none is given);
* ``COPY`` / ``ADD <src>... <dst>`` of files of ``environment/`` to a place inside the workdir: copied
  into the workspace template;
* ``ENV``: environment variables of the agent's commands and of the tests;
* ``RUN mkdir -p <dirs inside the workdir>``: made in the template;
* ``LABEL``, ``EXPOSE``, ``CMD``, ``ENTRYPOINT``, ``USER``, ``ARG``, ``SHELL``, ``HEALTHCHECK``: no
  effect on a workspace.

Anything else (another ``RUN``, an ``ADD`` from a URL, ``COPY --from``, a copy outside the workdir, a
``docker-compose.yaml``, a prebuilt ``docker_image`` that is not a host image) needs a container: the
task is *refused*, with the line that needs it, and never drawn.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from arborl.envs.base import EnvError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

DEFAULT_WORKDIR = "/app"
_IGNORED = {"LABEL", "EXPOSE", "CMD", "ENTRYPOINT", "USER", "ARG", "SHELL", "HEALTHCHECK", "STOPSIGNAL",
            "VOLUME", "MAINTAINER", "ONBUILD"}


class HarborTaskError(EnvError):
    """A task folder is malformed (a missing file, a task.toml that does not parse)."""


@dataclass
class HarborTask:
    name: str
    path: Path
    instruction: str
    config: dict[str, Any]  # task.toml
    workdir: str = DEFAULT_WORKDIR
    env: dict[str, str] = field(default_factory=dict)
    copies: list[tuple[Path, str]] = field(default_factory=list)  # (file or dir in environment/, path in workdir)
    dirs: list[str] = field(default_factory=list)  # made in the workspace (RUN mkdir -p)
    refusal: str | None = None  # why it cannot run without a container image

    @property
    def tests_dir(self) -> Path:
        return self.path / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.path / "solution"

    @property
    def verifier_timeout_s(self) -> float | None:
        t = self.config.get("verifier", {}).get("timeout_sec")
        return float(t) if isinstance(t, (int, float)) else None

    @property
    def agent_timeout_s(self) -> float | None:
        t = self.config.get("agent", {}).get("timeout_sec")
        return float(t) if isinstance(t, (int, float)) else None

    def split(self, eval_fraction: float) -> str:
        """``[metadata] split`` when given, else a draw fixed by the task's name."""
        given = self.config.get("metadata", {}).get("split")
        if given in ("train", "eval"):
            return given
        h = int(hashlib.sha256(self.name.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
        return "eval" if h < eval_fraction else "train"

    def digest(self) -> str:
        """A hash of the folder's files: a changed task is a new task (template cache, validation)."""
        h = hashlib.sha256()
        for p in sorted(self.path.rglob("*")):
            if p.is_file() and not p.is_symlink():
                h.update(str(p.relative_to(self.path)).encode() + b"\0" + p.read_bytes() + b"\0")
        return h.hexdigest()[:16]


def read_task(path: Path, host_images: list[str]) -> HarborTask:
    """The task folder at ``path``; a folder that cannot run here comes back with its ``refusal``."""
    path = Path(path)
    for need in ("task.toml", "instruction.md"):
        if not (path / need).is_file():
            raise HarborTaskError(f"{path}: no {need} (a Harbor task folder has task.toml and instruction.md)")
    try:
        config = tomllib.loads((path / "task.toml").read_text())
    except tomllib.TOMLDecodeError as e:
        raise HarborTaskError(f"{path / 'task.toml'}: {e}") from None
    name = str(config.get("task", {}).get("name") or path.name)
    task = HarborTask(name=name, path=path, instruction=(path / "instruction.md").read_text(), config=config)
    if not (path / "tests" / "test.sh").is_file():
        task.refusal = "no tests/test.sh: nothing can verify an episode"
        return task
    image = config.get("environment", {}).get("docker_image")
    if image and not _host_image(image, host_images):
        task.refusal = f"task.toml [environment] docker_image = {image!r} is a prebuilt image (not one of rollout.harbor.host_images)"
        return task
    env_dir = path / "environment"
    if (env_dir / "docker-compose.yaml").exists() or (env_dir / "docker-compose.yml").exists():
        task.refusal = "environment/docker-compose.yaml starts services: it needs a container engine"
        return task
    dockerfile = env_dir / "Dockerfile"
    if dockerfile.is_file():
        task.refusal = _read_dockerfile(task, dockerfile, host_images)
    return task


def _host_image(image: str, host_images: list[str]) -> bool:
    repo = image.split("@", 1)[0].rsplit(":", 1)[0] if ":" in image.rsplit("/", 1)[-1] else image.split("@", 1)[0]
    base = repo.rsplit("/", 1)[-1]
    return base in host_images or repo in host_images


def dockerfile_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments dropped."""
    out, buf, start = [], "", 0
    for i, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if not buf:
            start = i
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((start, word.upper(), rest.strip()))
        buf = ""
    if buf:
        word, _, rest = buf.strip().partition(" ")
        out.append((start, word.upper(), rest.strip()))
    return out


def _read_dockerfile(task: HarborTask, dockerfile: Path, host_images: list[str]) -> str | None:
    """Fill ``task`` from its Dockerfile; the refusal, or None when a workspace can stand in for the image."""
    where = lambda n: f"environment/Dockerfile line {n}"  # noqa: E731
    workdir = PurePosixPath(DEFAULT_WORKDIR)
    for n, word, args in dockerfile_lines(dockerfile.read_text()):
        if word == "FROM":
            image = args.split()[0] if args else ""
            if not _host_image(image, host_images):
                return f"{where(n)}: FROM {image} is not one of rollout.harbor.host_images ({', '.join(host_images)})"
        elif word == "WORKDIR":
            workdir = workdir / args  # a relative WORKDIR is relative to the previous one
            task.workdir = str(workdir)
        elif word == "ENV":
            task.env.update(_env_pairs(args))
        elif word in ("COPY", "ADD"):
            parts = _args(args)
            flags = [p for p in parts if p.startswith("--")]
            if any(f.startswith("--from") for f in flags):
                return f"{where(n)}: COPY --from copies out of another image"
            srcs, dst = [p for p in parts if not p.startswith("--")][:-1], parts[-1] if parts else ""
            if not srcs:
                return f"{where(n)}: {word} needs a source and a destination"
            target = PurePosixPath(dst) if dst.startswith("/") else workdir / dst
            try:
                rel = target.relative_to(workdir)
            except ValueError:
                return f"{where(n)}: {word} to {target} writes outside the workdir {workdir}: it needs an image"
            for src in srcs:
                if re.match(r"^[a-z]+://", src):
                    return f"{where(n)}: ADD {src} downloads: the sandbox has no network"
                found = sorted(dockerfile.parent.glob(src)) if any(c in src for c in "*?[") else [dockerfile.parent / src]
                for f in found:
                    if not f.exists() or not f.resolve().is_relative_to(dockerfile.parent.resolve()):
                        return f"{where(n)}: {word} source {src} is not a file of environment/"
                    into = str(rel / f.name) if (dst.endswith("/") or len(found) > 1 or len(srcs) > 1) and f.is_file() \
                        else str(rel)
                    task.copies.append((f, into))
        elif word == "RUN":
            made = _mkdirs(args, workdir)
            if made is None:
                return f"{where(n)}: RUN {args[:80]} changes the image: it needs a container build"
            task.dirs += made
        elif word not in _IGNORED:
            return f"{where(n)}: {word} is not understood"
    return None


def _args(args: str) -> list[str]:
    if args.startswith("["):
        try:
            return [str(a) for a in json.loads(args)]
        except json.JSONDecodeError:
            pass
    return shlex.split(args)


def _env_pairs(args: str) -> dict[str, str]:
    parts = shlex.split(args)
    if parts and "=" not in parts[0]:  # ENV KEY value with spaces
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts if "=" in p)


def _mkdirs(args: str, workdir: PurePosixPath) -> list[str] | None:
    """The workdir-relative directories of ``mkdir [-p] dir...`` (joined by &&), or None for anything else."""
    out = []
    for cmd in args.split("&&"):
        parts = shlex.split(cmd)
        if not parts or parts[0] != "mkdir":
            return None
        for p in parts[1:]:
            if p.startswith("-"):
                if p != "-p":
                    return None
                continue
            target = PurePosixPath(p) if p.startswith("/") else workdir / p
            try:
                out.append(str(target.relative_to(workdir)))
            except ValueError:
                return None
    return out


def build_template(task: HarborTask, dest: Path) -> Path:
    """The workspace template of ``task`` (its COPY'd files and made directories) at ``dest``."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for d in task.dirs:
        if d != ".":
            (dest / d).mkdir(parents=True, exist_ok=True)
    for src, rel in task.copies:
        target = dest / rel
        if src.is_dir():
            shutil.copytree(src, target, dirs_exist_ok=True, symlinks=True)
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return dest


def read_tasks(root: Path, host_images: list[str]) -> list[HarborTask]:
    """Every task folder under ``root`` (a folder holding task.toml), by name."""
    root = Path(root)
    if not root.is_dir():
        raise HarborTaskError(f"rollout.harbor.tasks_dir: {root} is not a directory")
    tasks = [read_task(p.parent, host_images) for p in sorted(root.glob("*/task.toml"))]
    if not tasks:
        raise HarborTaskError(f"rollout.harbor.tasks_dir: no task folders (*/task.toml) in {root}")
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise HarborTaskError(f"rollout.harbor.tasks_dir: task names used twice in {root}: {', '.join(dup)}")
    return tasks
