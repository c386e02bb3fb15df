"""Scheduling policies — above config, beside ``relay`` — one seam per module, each a
Protocol with its implementations:

- ``tiers``: which tier goes next (stride by weight, strict priority);
- ``tenants``: which tenant of a tier goes next (virtual token counter, earliest deadline);
- ``order``: which request of a tenant goes next (short first with aging, FCFS);
- ``displacement``: what a full tier does with a newcomer (largest share loses one, tail drop);
- ``backends``: which backend takes a request, and a backend's room (least utilised, prefix
  affinity); ``room``: how many requests a backend may hold (fixed or learned).

``types`` holds what the mechanism shows them (queued requests, tier limits, scraped load, a
read-only ``BackendView``); ``registry`` names them for the config. Pure: they may import
``config``, ``api``, ``ticket`` and ``tasks``, never the queue or the pool that use them
(``proxy.scheduling.build`` assembles those).
"""
