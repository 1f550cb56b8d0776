"""Named fault-injection points: ``ARBORL_FAILPOINTS="publish@2,save@1"`` makes this process SIGKILL
itself the 2nd time it reaches the ``publish`` point, or the 1st time it reaches ``save``. Off (one dict
lookup) unless the variable is set. The fault tests and ``arborl bench faults`` use them to kill a run at
a named moment, driven by the run's own progress rather than a timer:

* ``train``: a step's batch is formed, before the trainer trains it;
* ``publish``: the trainer has trained, before the engines have the new weights;
* ``step_end``: a step is done (metrics written), before its checkpoint is saved;
* ``save``: in the middle of writing a checkpoint (its temporary directory is half written).
"""

from __future__ import annotations

import os
import signal

ENV = "ARBORL_FAILPOINTS"
_hits: dict[str, int] = {}


def armed() -> dict[str, int]:
    """point -> the hit that kills, from the environment."""
    spec = os.environ.get(ENV, "")
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, n = part.partition("@")
        out[name] = int(n or 1)
    return out


def failpoint(name: str) -> None:
    if ENV not in os.environ:
        return
    _hits[name] = _hits.get(name, 0) + 1
    if armed().get(name) == _hits[name]:
        os.kill(os.getpid(), signal.SIGKILL)
