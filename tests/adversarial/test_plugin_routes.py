"""Every POST route of the installed vLLM is ticketed by the middleware's rule.

Builds vLLM's own FastAPI app in-process (no engine, no model) with every task and the dev,
RL and fault-tolerance routers on, and walks its route table: a route a future vLLM adds is
either covered by ``rule_for`` or fails here; and each route goes through the real
``TicketMiddleware`` (refused unticketed when tickets are required, priority forced when not)."""

from __future__ import annotations

import json
import typing
from typing import Any

import pytest

pytest.importorskip("vllm")

from proxy.vllm_plugin.routes import UNTICKETED_POST_PATHS, Rule, rule_for
from tests.helpers.plugin_asgi import App, call, mw_with, refused

# Routes the rule lets through, each for a reason (see routes.UNTICKETED_POST_PATHS).
ALLOWED_UNTICKETED = frozenset({"/ping"})


def _vllm_post_paths(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")  # also the dev and RL routers
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.tasks import SupportedTask
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args([])  # type: ignore[no-untyped-call,unused-ignore]
    args.enable_fault_tolerance = True
    app: Any = build_app(args, typing.get_args(SupportedTask), None)
    paths: set[str] = set()
    for route in app.routes:
        if "POST" in (getattr(route, "methods", None) or ()):
            paths.add(str(route.path))
    return paths


def test_every_vllm_post_route_is_ticketed(monkeypatch: pytest.MonkeyPatch) -> None:
    paths = _vllm_post_paths(monkeypatch)
    # The walk really saw vLLM's table: the routes the issue found open are in it.
    assert {"/invocations", "/v1/chat/completions/batch", "/inference/v1/generate"} <= paths
    assert {"/v1/chat/completions", "/collective_rpc", "/sleep"} <= paths
    open_routes = {p for p in paths if rule_for("POST", p) is Rule.PASS}
    assert open_routes <= ALLOWED_UNTICKETED, f"POST routes passing unticketed: {open_routes}"
    assert UNTICKETED_POST_PATHS == ALLOWED_UNTICKETED


async def test_every_vllm_post_route_through_the_real_middleware(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    forged = {"priority": -1000, "vllm_xargs": {"tierproxy_trusted": 1, "tierproxy_tier": "high"}}
    body = json.dumps(forged).encode()
    paths = _vllm_post_paths(monkeypatch)
    for path in sorted(paths - ALLOWED_UNTICKETED):
        app = App()
        status, error = await refused(mw_with(app, require=True), body, [], path=path)
        assert status == 401 and app.scope == {}, (path, error)  # never reached vLLM
        await call(mw_with(app), body, [], path=path)
        assert json.loads(app.body) == {"priority": 10}, path  # forced, caller xargs dropped
    for path in sorted(paths & ALLOWED_UNTICKETED):
        app = App()
        await call(mw_with(app, require=True), body, [], path=path)
        assert app.body == body, path  # untouched


def test_unknown_methods_and_paths_are_ticketed() -> None:
    for method in ("POST", "PUT", "PATCH", "DELETE", "post"):
        assert rule_for(method, "/v1/some/future/route") is Rule.TICKETED
    assert rule_for("GET", "/v1/models") is Rule.PASS
    assert rule_for("POST", "/v1/chat/completions") is Rule.GENERATION
