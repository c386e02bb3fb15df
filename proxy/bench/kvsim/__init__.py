"""A simulator of the serving system on a simulated clock: engines with vLLM 0.32's prefix cache
and batch scheduler (``cache``, ``engine``), the proxy's real queue, dispatcher and backend
choosers in front of them (``run``), fed the workloads of a seeded family of shapes
(``workload``, ``family``); ``benchmarks/kv_sim.py`` prints the family's table."""
