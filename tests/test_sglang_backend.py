"""engine.backend=sglang. SGLang serves on CUDA only: on a machine without a GPU the backend refuses
with an error that says so (tested here), and the real-server checks run in
scripts/gpu_check_backends.py on a GPU machine; the request body is checked here."""

from __future__ import annotations

import pytest
import torch

from arborl.config import load_config
from arborl.engine.backends import ENGINE_BACKENDS, BackendError
from arborl.engine.backends.remote import Segment
from arborl.engine.backends.sglang import SGLangEngine
from arborl.models import load_model
from arborl.types import SamplingParams


def test_sglang_on_a_cpu_model_says_it_needs_cuda():
    cfg = load_config(None, ["model.source=tiny", "engine.backend=sglang"])
    with pytest.raises(BackendError, match="CUDA"):
        ENGINE_BACKENDS.get("sglang")(cfg, load_model(cfg.model))


def test_sglang_request_is_input_ids_with_logprobs():
    seg = Segment("r-1", [4, 5], 7, SamplingParams(temperature=0.9, top_p=0.8, seed=11), [2], 11)
    b = SGLangEngine.body(None, seg)  # type: ignore[arg-type]
    assert b["input_ids"] == [4, 5] and b["return_logprob"] and b["stream"] and b["rid"] == "r-1"
    sp = b["sampling_params"]
    assert sp["max_new_tokens"] == 7 and sp["stop_token_ids"] == [2] and sp["ignore_eos"] and sp["top_k"] == -1
    assert sp["sampling_seed"] == 11 and sp["top_p"] == 0.8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="SGLang serves on CUDA only; this machine has no GPU "
                    "(scripts/gpu_check_backends.py runs the SGLang checks on a GPU machine)")
def test_sglang_serves_on_cuda():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "scripts/gpu_check_backends.py", "--only", "sglang", "--quick"],
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_sglang_knobs_reach_its_command_line():
    from pathlib import Path

    from arborl.engine.backends.sglang import server_argv

    cfg = load_config(None, ["engine.sglang.mem_fraction_static=0.3", "engine.sglang.host=0.0.0.0",
                             "engine.sglang.extra_args=[--tp, '2']", "engine.max_seq_len=999"])
    a = server_argv(cfg, python="py", model_dir=Path("/m"), port=77, seed=1)
    assert a[a.index("--mem-fraction-static") + 1] == "0.3" and a[a.index("--host") + 1] == "0.0.0.0"
    assert a[a.index("--context-length") + 1] == "999" and a[-2:] == ["--tp", "2"] and "--skip-tokenizer-init" in a
