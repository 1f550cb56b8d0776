from pathlib import Path

import pytest
from pydantic import BaseModel

from arborl.config import Config, ConfigError, Section, dump_config, load_config
from docs_knobs import render
from arborl.train.policy_losses import POLICY_LOSSES


def test_defaults_file_and_overrides(tmp_path: Path):
    f = tmp_path / "c.yaml"
    f.write_text("name: exp1\nengine:\n  max_batch_size: 4\n")
    cfg = load_config(f, ["engine.max_seq_len=128", "engine.prefix_cache=false", "model.source=tiny"])
    assert cfg.name == "exp1" and cfg.engine.max_batch_size == 4 and cfg.engine.max_seq_len == 128
    assert cfg.engine.prefix_cache is False and cfg.model.source == "tiny"
    assert cfg.run_dir == Path("runs/exp1")
    # a dumped config loads back to the same tree, its relative paths (the working directory's) made absolute
    g = tmp_path / "d.yaml"
    g.write_text(dump_config(cfg))
    assert load_config(g) == cfg.model_copy(update={"runs_dir": str(Path.cwd() / "runs")})


@pytest.mark.parametrize(
    "overrides, expect",
    [
        (["engine.max_batch_sise=4"], r"engine\.max_batch_sise: unknown key"),
        (["engine.max_batch_size=many"], r"engine\.max_batch_size: .*integer"),
        (["engine.max_batch_size=0"], r"engine\.max_batch_size: .*greater than or equal to 1"),
        (["model.source=gguf"], r"model\.source: .*'smollm2', 'hf' or 'tiny'"),
        (["engine"], r"must look like key\.path=value"),
        (["engine..x=1"], r"empty component"),
        (["name=a", "name.x=1"], r"name is a value, not a section"),
    ],
)
def test_bad_keys_and_values_name_the_path(overrides, expect):
    with pytest.raises(ConfigError, match=expect):
        load_config(None, overrides)


def test_bad_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(bad)
    bad.write_text("engine: {max_batch_size: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_every_knob_is_documented_and_knobs_md_is_fresh():
    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, Section):
                yield from walk(sub, prefix + name + ".")
            else:
                yield prefix + name, field

    for key, field in walk(Config):
        assert field.description, f"{key} has no description"
    for kind in POLICY_LOSSES.names():  # each loss kind's own settings (train.loss.settings)
        model = getattr(POLICY_LOSSES.get(kind), "Settings", None)
        for name, field in (model.model_fields.items() if model is not None else ()):
            assert field.description, f"train.loss.settings.{name} of kind {kind} has no description"
    knobs = Path(__file__).resolve().parents[1] / "docs" / "knobs.md"
    assert knobs.read_text() == render(), "docs/knobs.md is stale: run `make knobs`"


def test_each_section_model_sits_in_the_module_named_after_its_key():
    """A reader finds a knob next to what it configures: ``engine.*`` in config/engine.py, and so on; the
    sections nested in one (train.loss, rollout.envs, ...) live in their parent's module."""
    from arborl.config import known_keys

    def walk(model, module):
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                assert sub.__module__ == module, f"{sub.__name__} belongs in {module}"
                walk(sub, module)

    for key, field in Config.model_fields.items():
        sub = field.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            assert sub.__module__ == f"arborl.config.{key}", f"{key}: {sub.__name__} is in {sub.__module__}"
            walk(sub, f"arborl.config.{key}")
    assert "engine.spec.drafter" in known_keys() and "train.loss.settings" in known_keys()
