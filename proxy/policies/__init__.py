"""Scheduling policies, one seam per module, each a Protocol with its implementations:

- ``tiers``: which tier goes next (stride by weight, strict priority);
- ``tenants``: which tenant of a tier goes next (virtual token counter, earliest deadline);
- ``order``: which request of a tenant goes next (short first with aging, FCFS);
- ``displacement``: what a full tier does with a newcomer (largest share loses one, tail drop);
- ``backends``: which backend takes a request, and a backend's room (least utilised, prefix
  affinity).

``registry`` names them for the config; ``build`` assembles the queue, pool and dispatcher.
The queue, the pool and the dispatcher know only the Protocols.
"""
