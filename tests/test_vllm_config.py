"""engine.backend / engine.vllm knobs without a server (fast): each knob reaches vLLM's command line,
environment or request body, and bad values are errors that say what to fix."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from arborl.config import ConfigError, load_config
from arborl.engine.backends import ENGINE_BACKENDS, BackendError
from arborl.engine.backends.remote import Segment
from arborl.engine.backends.vllm import VLLM_VENV_PYTHON, REPO_ROOT, request_body, server_argv, server_env, vllm_python
from arborl.registry import RegistryError
from arborl.types import SamplingParams


def argv(*overrides: str) -> list[str]:
    return server_argv(load_config(None, list(overrides)), python="py", model_dir=Path("/m"), port=1234, seed=5)


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def test_backend_names_are_registered_and_unknown_ones_say_which_exist():
    assert {"builtin", "vllm", "sglang"} <= set(ENGINE_BACKENDS.names())
    with pytest.raises(RegistryError, match="builtin"):
        ENGINE_BACKENDS.get("vlm")
    assert load_config(None, ["engine.backend=vllm"]).engine.backend == "vllm"


def test_engine_limits_dtype_and_logprobs_mode_reach_the_command_line():
    a = argv("engine.max_seq_len=777", "engine.max_batch_size=9", "model.dtype=bfloat16")
    assert flag(a, "--max-model-len") == "777" and flag(a, "--max-num-seqs") == "9" and flag(a, "--dtype") == "bfloat16"
    assert flag(a, "--logprobs-mode") == "processed_logprobs" and "--skip-tokenizer-init" in a
    assert flag(argv("engine.vllm.logprobs_mode=raw_logprobs"), "--logprobs-mode") == "raw_logprobs"
    with pytest.raises(ConfigError, match="logprobs_mode"):
        load_config(None, ["engine.vllm.logprobs_mode=logits"])


def test_prefix_caching_speculative_config_and_extra_args_pass_through():
    assert "--enable-prefix-caching" in argv() and "--no-enable-prefix-caching" in argv("engine.vllm.prefix_caching=false")
    spec = '{method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}'
    a = argv(f"engine.vllm.speculative_config={spec}", "engine.vllm.extra_args=[--enforce-eager]",
             "engine.vllm.enforce_eager=false")
    assert json.loads(flag(a, "--speculative-config")) == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    assert a[-1] == "--enforce-eager" and "--speculative-config" not in argv()
    assert "--enforce-eager" in argv() and "--enforce-eager" not in argv("engine.vllm.enforce_eager=false")


def test_cpu_environment_knobs():
    env = server_env(load_config(None, ["engine.vllm.kv_cache_gib=1.5", "engine.vllm.cpu_threads_bind=0-1"]), {})
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1.5" and env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "VLLM_CPU_OMP_THREADS_BIND" not in server_env(load_config(None, ["engine.vllm.cpu_threads_bind=auto"]), {})
    cuda = server_env(load_config(None, ["model.device=cuda:1"]), {})
    assert cuda["CUDA_VISIBLE_DEVICES"] == "1" and "VLLM_CPU_KVCACHE_SPACE" not in cuda


def test_request_body_is_token_ids_with_our_eos_as_stop_ids():
    seg = Segment("r", [5, 6, 7], 9, SamplingParams(temperature=0.5, top_k=4, seed=3), [2, 99], 3)
    b = request_body(seg)
    assert b["prompt"] == [5, 6, 7] and b["max_tokens"] == 9 and b["return_token_ids"] and b["logprobs"] == 0
    assert b["ignore_eos"] is True and b["stop_token_ids"] == [2, 99] and b["top_k"] == 4 and b["seed"] == 3
    assert "top_k" not in request_body(Segment("r", [1], 1, SamplingParams(), [], None))


def test_a_missing_vllm_install_says_how_to_get_it(tmp_path):
    with pytest.raises(BackendError, match="make vllm"):
        vllm_python(str(tmp_path / "nope/bin/python"))
    assert vllm_python(sys.executable) == sys.executable


@pytest.mark.skipif(not (REPO_ROOT / VLLM_VENV_PYTHON).is_file(), reason="no .venv-vllm here (make vllm makes it)")
def test_python_auto_is_the_make_vllm_venv():
    assert vllm_python("auto") == str(REPO_ROOT / VLLM_VENV_PYTHON)


def test_host_and_port_reach_the_command_line():
    a = argv("engine.vllm.host=0.0.0.0")
    assert flag(a, "--host") == "0.0.0.0" and flag(a, "--port") == "1234"
