"""Several proxies acting as one through Redis (issue #15): shared tenant limits, shared
fairness counters and the client that talks to Redis. Absent ``shared_state:`` none of it runs.
"""
