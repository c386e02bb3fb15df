"""The plugin restates which routes generate (it may import only ``proxy.ticket``): this ties
its list to the proxy's route table, so a generating route added to one is not missed by the
other."""

from __future__ import annotations

from proxy.api.routes import ROUTES
from proxy.vllm_plugin.routes import GENERATION_PATHS, Rule, rule_for

# vLLM routes that generate but the proxy does not serve: the plugin still gives a request
# there the ticket's output budget (vLLM's Anthropic Messages route).
GENERATING_ONLY_IN_VLLM = frozenset({"/v1/messages"})


def test_the_plugin_generation_paths_are_the_proxy_generating_routes() -> None:
    proxy_generating = {path for route in ROUTES if route.generates for path in route.paths}
    assert proxy_generating | GENERATING_ONLY_IN_VLLM == GENERATION_PATHS


def test_every_route_the_proxy_sends_is_ticketed_by_the_plugin() -> None:
    for route in ROUTES:
        for path in route.paths:
            want = Rule.GENERATION if route.generates else Rule.TICKETED
            assert rule_for("POST", path) == want, path
