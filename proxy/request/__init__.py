"""The request path — above scheduling, beside ``shared``: the pipeline an OpenAI
request goes through (``pipeline``: admit, limit, queue, dispatch, forward, settle), what it
carries (``admitted``), who sent it (``auth``: the key, its tenant, its expiry), reading and
validating its body (``body``, ``inbound``), cost
estimates (``costs``), the upstream call (``upstream``) and its answer and log line
(``answers``); a tenant's quotas and budget (``quota_gate``).

May import ``scheduling`` and every floor below; never ``shared`` (the Redis adapters plug
into the same seams from beside it).
"""
