"""The mechanism that decides who runs where — above ``backends``: the tier queues
(``queue``), the dispatcher that hands out backend slots (``dispatch``), tenant rate limits
(``limits``), tenant quotas per UTC day and month (``quotas``), early refusal, and ``build``,
the composition that turns the config's policy names into objects.

May import ``backends``, ``telemetry``, ``policies``, ``relay``, ``config`` and the ground floor.
"""
