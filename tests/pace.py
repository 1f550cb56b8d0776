"""``ARBORL_TEST_PACE``: run the suite with the engine made artificially slow or fast, to prove that no
test races the clock (a faster or slower machine, or a GPU, must not change a verdict).

* ``slow``: every step of an in-process engine (``LLMEngine.step``) first sleeps
  ``ARBORL_TEST_PACE_STEP_S`` seconds (default 0.02): decoding is 10-50x slower than here.
* ``fast``: the tests' own waits (``time.sleep`` and ``asyncio.sleep`` as test modules and their helpers
  see them) last ``ARBORL_TEST_PACE_FACTOR`` times longer (default 20): during any wait a test makes,
  the engine gets that many times more steps, as on a machine that many times faster.

Product code is untouched in both modes; engines in subprocesses and Ray actors keep their own pace.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
import types

MODE = os.environ.get("ARBORL_TEST_PACE", "")
if MODE not in ("", "slow", "fast"):
    raise SystemExit(f"ARBORL_TEST_PACE must be slow or fast, got {MODE!r}")


def install_slow_engine() -> None:
    from arborl.engine.engine import LLMEngine

    delay = float(os.environ.get("ARBORL_TEST_PACE_STEP_S", "0.02"))
    step = LLMEngine.step

    def slow_step(self):
        time.sleep(delay)
        return step(self)

    LLMEngine.step = slow_step


def _stretched(real: types.ModuleType, factor: float) -> types.ModuleType:
    """A copy of ``real`` (time or asyncio) whose ``sleep`` lasts ``factor`` times longer."""
    mod = types.ModuleType(real.__name__, real.__doc__)
    mod.__dict__.update({k: v for k, v in real.__dict__.items() if k not in ("__name__", "__doc__")})
    if real is asyncio:
        async def sleep(delay, result=None):
            return await asyncio.sleep(delay * factor, result)
    else:
        def sleep(seconds):
            time.sleep(seconds * factor)
    mod.sleep = sleep
    return mod


def stretch_test_waits(module: types.ModuleType) -> None:
    """Give ``module`` (a test file or a helper) stretched ``time`` and ``asyncio`` modules."""
    factor = float(os.environ.get("ARBORL_TEST_PACE_FACTOR", "20"))
    for name, real in (("time", time), ("asyncio", asyncio)):
        if module.__dict__.get(name) is real:
            setattr(module, name, _stretched(real, factor))


def stretch_loaded_helpers() -> None:
    for name, module in list(sys.modules.items()):
        if name.startswith("helpers.") and module is not None:
            stretch_test_waits(module)
