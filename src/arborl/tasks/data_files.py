"""Prompt files -> tasks: JSONL / JSON (``.jsonl``, ``.json``) and Parquet (``.parquet``) files read
with Hugging Face ``datasets``, one task per row.

A row's ``prompt_key`` column is the prompt: a string (one user message) or a list of chat messages
(``{"role", "content"}``, keys that are null in a row are dropped). Every other column is copied
into ``task.metadata`` as it is (the answer included). Task ids are ``data-<split>-<i>``, ``i`` the
row's index in the split's files read in order. Every problem (a missing file, an unknown format,
a missing column, a bad prompt, no rows at all) is a ``DatasetError`` naming the file and the knob.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from arborl.config import ConfigError
from arborl.types import Task

_FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ROLES = ("system", "user", "assistant", "tool")


class DatasetError(ConfigError):
    """A prompt file, or a column of it, is missing or malformed; the message names the file and the knob."""


def read_rows(path: Path, knob: str) -> list[dict[str, Any]]:
    """The rows of one JSONL / JSON / Parquet file, as Python dicts (``knob`` names it in errors)."""
    if not path.is_file():
        raise DatasetError(f"{knob}: {path} does not exist")
    builder = _FORMATS.get(path.suffix.lower())
    if builder is None:
        raise DatasetError(f"{knob}: {path} is not a .jsonl, .json or .parquet file")
    if path.stat().st_size == 0:
        return []
    import datasets  # imported here: it takes a second, and only the dataset suite needs it
    from datasets.utils.logging import set_verbosity_error

    datasets.disable_progress_bars()
    set_verbosity_error()
    try:
        ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds; the cause says what is wrong
        cause = e.__cause__ or e.__context__
        detail = f"{e}" + (f" ({cause})" if cause is not None else "")
        raise DatasetError(f"{knob}: cannot read {path} as {builder}: {detail}") from e
    return ds.to_list()


def _prompt(value: Any, where: str, key: str) -> str | list[dict[str, Any]]:
    if isinstance(value, str):
        if not value.strip():
            raise DatasetError(f"{where}: column {key!r} is an empty string")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for j, m in enumerate(value):
            if not isinstance(m, dict):
                raise DatasetError(f"{where}: {key}[{j}] is {type(m).__name__}, not a chat message {{role, content}}")
            m = {k: v for k, v in m.items() if v is not None}
            if m.get("role") not in _ROLES:
                raise DatasetError(f"{where}: {key}[{j}] has role {m.get('role')!r}; use one of {', '.join(_ROLES)}")
            if not isinstance(m.get("content"), str):
                raise DatasetError(f"{where}: {key}[{j}] needs a string 'content'")
            messages.append(m)
        return messages
    raise DatasetError(
        f"{where}: column {key!r} must be a string or a non-empty list of chat messages, got {type(value).__name__}"
    )


def load_tasks(
    files: Sequence[str], split: str, *, prompt_key: str, answer_key: str | None, knob: str
) -> list[Task]:
    """Every row of ``files`` (in order) as a task of ``split``; ``knob`` is the config key of ``files``."""
    tasks: list[Task] = []
    for name in files:
        path = Path(name).expanduser().absolute()  # errors name the path as resolved
        rows = read_rows(path, knob)
        if rows:
            columns = list(rows[0])
            if prompt_key not in columns:
                raise DatasetError(f"{path}: no column {prompt_key!r} (rollout.data.prompt_key); its columns: "
                                   f"{', '.join(columns)}")
            if answer_key is not None and answer_key not in columns:
                raise DatasetError(f"{path}: no column {answer_key!r} (rollout.data.answer_key); its columns: "
                                   f"{', '.join(columns)}; set rollout.data.answer_key=null if the data has no answer")
        for r, row in enumerate(rows):
            prompt = _prompt(row[prompt_key], f"{path} row {r}", prompt_key)
            meta = {k: v for k, v in row.items() if k != prompt_key}
            tasks.append(Task(task_id=f"data-{split}-{len(tasks)}", prompt=prompt, metadata=meta, split=split))
    if not tasks:
        where = ", ".join(str(Path(f).expanduser().absolute()) for f in files)
        raise DatasetError(f"{knob}: no rows in {where or '(no files given)'}")
    return tasks
