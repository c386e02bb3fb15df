"""The one home of what tests share: the fake clock, the pipeline rig, the plugin's middleware
harness, a stall of redis-server, the dashboard's metric names, where the repo and the tiny
model are, the vLLM engine settings the suite starts (``engines``), their farm and the order of
the run (``enginefarm``, ``engineplan``). The fake vLLM server, the in-process proxy, the
redis-server and the served-process kit are in ``proxy.bench`` (benchmarks use them too):
import them from there. Test modules import from here (or from conftest fixtures), never from
one another."""
