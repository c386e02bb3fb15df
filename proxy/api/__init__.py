"""The OpenAI surface's vocabulary — ground floor: error shapes (``errors``), the routes and
their traits (``routes``), request outcomes (``outcome``), the headers every answer carries
(``reply_headers``) and the per-request ids and metric children (``hotpath``); the quota
refusals (``quota_errors``).

Imports nothing of the proxy: every other floor may import it.
"""
