"""The Responses API's stored responses: the proxy keeps none, and lets no backend keep any.

vLLM (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``) stores responses in the API server's memory,
under ids that are global to the server: any caller that knows an id can read the response
(``GET /v1/responses/{id}``), continue it (``previous_response_id``) or cancel it, whoever
created it; and ``background: true`` runs the request inside vLLM after the HTTP answer, outside
the proxy's queue, tiers, deadline and usage accounting. The proxy's rule (docs/routes.md):

- ``background: true`` and ``store: true`` (sent explicitly) are refused with 400;
- ``previous_response_id`` is refused with 400 (it reads a stored response: there is none);
- every other request is sent with ``store: false``: OpenAI's default is true, and a backend
  with the store on would otherwise keep every tenant's answers where others can read them.

``GET /v1/responses/{id}``, ``/cancel`` and ``/input_items`` are not served (404).
"""

from __future__ import annotations

from typing import Any

from proxy.api.errors import ProxyError, bad_request
from proxy.request.costs import lax_bool

_WHY = (
    " tierproxy stores no responses (each tenant's would be readable by any other that knows"
    " its id, and background runs would bypass the tiers and deadlines): send the whole"
    " conversation as `input`."
)


def _refused(param: str, what: str) -> ProxyError:
    return bad_request(
        f"`{what}` is not supported.{_WHY}", param=param, code="unsupported_parameter"
    )


def no_stored_responses(body: dict[str, Any]) -> None:
    """Refuse what needs a stored response; set ``store: false`` on the rest (in place)."""
    if lax_bool(body.get("background")):
        raise _refused("background", "background: true")
    if lax_bool(body.get("store")):
        raise _refused("store", "store: true")
    if body.get("previous_response_id") is not None:
        raise _refused("previous_response_id", "previous_response_id")
    body["store"] = False
