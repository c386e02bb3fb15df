"""The bytes back — above config, beside ``policies``: opening the upstream call and
relaying its answer (``forward``, ``responses`` for /v1/responses), the SSE reader and relay
(``sse``, ``sserelay``), the client sender with its send deadlines (``clientsend``), buffered
answers (``held``) and the memory budget they draw on (``budget``).

May import ``config``, ``api``, ``ticket``, ``tasks``; never ``policies``.
"""
