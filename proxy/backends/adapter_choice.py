"""Which backends may take a request for an adapter of the catalogue (``adapters:``): those
that hold it and have a slot for it, else those where the proxy can load it. The chooser
policy picks among them as for any request."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from proxy.backends.backend import BackendState


def adapter_able(
    states: Iterable[BackendState], adapters: Mapping[str, str], model: str | None
) -> tuple[set[str], set[str]] | None:
    """For an adapter of the catalogue (``adapters``: name -> base model): the urls of the
    backends that may take it now, those that hold it and those that can load it; None for
    any other model."""
    base = adapters.get(model) if model is not None else None
    if base is None or model is None:
        return None
    has: set[str] = set()
    load: set[str] = set()
    for state in states:
        max_loras = state.cfg.max_loras
        if max_loras is None or not state.serves(base):
            continue
        fit = state.adapters.fit(model, max_loras, state.cfg.load_adapters)
        if fit == "has":
            has.add(state.cfg.url)
        elif fit == "load":
            load.add(state.cfg.url)
    return has, load


def serves_adapter(states: Iterable[BackendState], adapters: Mapping[str, str], model: str) -> bool:
    """Some backend could ever serve this adapter: its base model, LoRA on, and the adapter
    either held there or loadable."""
    base = adapters.get(model)
    return base is not None and any(
        s.cfg.max_loras is not None
        and s.serves(base)
        and (s.cfg.load_adapters or model in s.adapters.held)
        for s in states
    )
