"""A dispatch policy takes an instance back (``restore_instance``, what the dispatcher calls when a
restarted Ray engine actor rejoins): pinned dispatch pins new groups there again; groups moved away
while it was gone stay where they are. (The Ray end to end case is in test_cluster_ray.py.)"""

from __future__ import annotations

from arborl.scheduling.dispatch import PinnedDispatch
from arborl.scheduling.policies import RequestSpec


def test_pinned_dispatch_pins_new_groups_on_a_restored_instance():
    p = PinnedDispatch(2)
    p.submit(RequestSpec("a", "g-a", 8), 0.0)
    assert p.instance_of("g-a") == 0
    p.remove_instance(0)
    assert p.instance_of("g-a") == 1  # re-pinned while instance 0 is gone
    p.submit(RequestSpec("b", "g-b", 8), 0.0)
    assert p.instance_of("g-b") == 1
    p.restore_instance(0)
    p.submit(RequestSpec("c", "g-c", 8), 0.0)
    assert p.instance_of("g-c") == 0  # the least loaded instance is the restored one
    assert p.instance_of("g-a") == 1  # moved groups stay
    assert p.next_for(0, 0.0).request_id == "c"
