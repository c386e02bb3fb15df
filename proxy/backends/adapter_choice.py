"""Which backends may take a request for an adapter of the catalogue (``adapters:``): those
that hold it and have a slot for it, else those where the proxy can load it, as the slot rules
allow for the request's tier and tenant (``proxy.backends.adapter_rules``). The chooser policy
picks among them as for any request. A request that finds no slot anywhere is noted on the
backends it waits for, for the rest of the dispatch pass (``AdapterSlots.waiting``); one that
waits only to spare an adapter a waiting request wants is not (it holds back no join), and its
patience's end is noted for the dispatcher (``AdapterSlots.patience_ends``). With
shared state, a backend whose rules let the request in but where this replica has not claimed
the adapter notes it as wanted (``AdapterSlots.may_run``) and is not a candidate yet."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.backends.adapter_rules import AdapterPolicy, begin, fit, waits_for_slot
from proxy.backends.adapter_slots import LoadPlan, SlotUser
from proxy.backends.backend import BackendState


def adapter_able(
    states: Iterable[BackendState],
    adapters: Mapping[str, str],
    model: str | None,
    policy: AdapterPolicy,
    user: SlotUser,
    now: float,
) -> tuple[set[str], set[str]] | None:
    """For an adapter of the catalogue (``adapters``: name -> base model): the urls of the
    backends that may take ``user``'s request for it now, those that hold it and those that
    can load it; None for any other model."""
    base = adapters.get(model) if model is not None else None
    if base is None or model is None:
        return None
    has: set[str] = set()
    load: set[str] = set()
    refused: list[BackendState] = []
    for state in states:
        rules = policy.rules(state.cfg, base)
        if rules is None or not state.serves(base):
            continue
        found = fit(state.adapters, model, user, rules, now)
        if found is not None and not state.adapters.may_run(model):
            continue  # it waits for this replica's claim (proxy.replicas.adapter_claims)
        if found == "has":
            has.add(state.cfg.url)
        elif found == "load":
            load.add(state.cfg.url)
            if user.due:  # the slot it may take is its own: nobody restarts an idle one there
                state.adapters.due_waiting.add(user.tenant)
        elif fit(state.adapters, model, user, rules, now, patient=False) == "load":
            state.adapters.patient(user.patient_until)  # not a wait for a slot: no join held
        elif waits_for_slot(state.adapters, model, user, rules, now):
            refused.append(state)
    if not has and not load:  # no slot anywhere: it waits for one of these
        for state in refused:
            state.adapters.waiting.add((user.tenant, user.best))
            if user.due:
                state.adapters.due_waiting.add(user.tenant)
    return has, load


def adapter_begin(
    state: BackendState,
    adapters: Mapping[str, str],
    model: str | None,
    policy: AdapterPolicy,
    user: SlotUser,
    now: float,
) -> LoadPlan | None:
    """Count ``user``'s request for ``model`` in on ``state`` when it is an adapter there; the
    load it must do first, if any."""
    base = adapters.get(model) if model is not None else None
    rules = policy.rules(state.cfg, base) if base is not None else None
    if model is None or rules is None:
        return None
    return begin(state.adapters, model, user, rules, now)


def serves_adapter(states: Iterable[BackendState], adapters: Mapping[str, str], model: str) -> bool:
    """Some backend could ever serve this adapter: one the configuration still names (not
    one a reload removed, draining), its base model, LoRA on, and the adapter either held
    there or loadable."""
    base = adapters.get(model)
    return base is not None and any(
        not s.removed
        and s.cfg.max_loras is not None
        and s.serves(base)
        and (s.cfg.load_adapters or model in s.adapters.held)
        for s in states
    )
