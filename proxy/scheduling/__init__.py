"""The mechanism that decides who runs where — above telemetry: the tier queues
(``queue``), the dispatcher that hands out backend slots (``dispatch``), the backends and
their room (``pool``, ``backend``), outlier detection (``health``), the metrics monitor
(``monitor``, with each backend's clock offset: ``clock_offset``), tenant rate limits
(``limits``), early refusal, and ``build``, the composition that turns the config's policy
names into objects; tenant quotas per UTC day and month (``quotas``).

May import ``telemetry``, ``policies``, ``relay``, ``config`` and the ground floor.
"""
