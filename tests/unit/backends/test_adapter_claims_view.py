"""The pure side of adapter slots shared across replicas (proxy.replicas.adapter_claims keeps
``AdapterSlots.claimed``): a backend where this replica does not claim the adapter is no
candidate and the adapter is noted as wanted (seen anew at each dispatch pass); counting alone
(``claimed`` None) nothing changes; a load gives up an idle adapter no other replica claims
before one another replica does."""

from __future__ import annotations

from proxy.backends.adapter_choice import adapter_able
from proxy.backends.adapter_rules import SlotRules, victim
from proxy.backends.adapter_slots import AdapterSlots, SlotUser
from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised

USER = SlotUser("tenant")
ADAPTERS = {"lora-a": "tiny", "lora-b": "tiny"}


def _pool() -> BackendPool:
    backends = [
        Backend(url=f"http://{n}:1", max_inflight=8, max_loras=2, load_adapters=True) for n in "xy"
    ]
    pool = BackendPool(backends, BackendHealth(), LeastUtilised())
    pool.adapters = ADAPTERS
    return pool


def test_an_unclaimed_adapter_is_wanted_not_sent() -> None:
    pool = _pool()
    x, y = pool.states["http://x:1"], pool.states["http://y:1"]
    x.adapters.claimed = {"lora-a"}
    y.adapters.claimed = set()
    able = adapter_able(pool.all(), ADAPTERS, "lora-a", pool.adapter_policy, USER, 0.0)
    assert able == (set(), {"http://x:1"})
    assert y.adapters.wanted == {"lora-a"} and not x.adapters.wanted
    woken: list[int] = []
    pool.on_adapter_claims = lambda: woken.append(1)
    assert pool.choose("lora-b", 1.0, 0.0) is None  # claimed nowhere: it waits, the loop is told
    assert woken and y.adapters.wanted == {"lora-a", "lora-b"}
    y.adapters.new_pass()
    assert not y.adapters.wanted


def test_counting_alone_every_backend_with_a_slot_is_a_candidate() -> None:
    pool = _pool()
    able = adapter_able(pool.all(), ADAPTERS, "lora-a", pool.adapter_policy, USER, 0.0)
    assert able == (set(), {"http://x:1", "http://y:1"})
    assert not any(s.adapters.wanted for s in pool.all())


def test_a_load_gives_up_an_adapter_no_other_replica_claims_first() -> None:
    slots = AdapterSlots()
    slots.listed(frozenset({"old", "new"}), now=0.0)
    slots.held["new"] = 5.0  # "old" is the least recently used
    slots.elsewhere = frozenset({"old"})  # but another replica claims it
    assert victim(slots, USER, SlotRules(2), 10.0) == "new"
    slots.elsewhere = frozenset({"old", "new"})  # every idle one is claimed elsewhere: LRU
    assert victim(slots, USER, SlotRules(2), 10.0) == "old"
