"""The one home of what tests share: the fake clock, the pipeline rig, the plugin's middleware
harness, the in-process proxy and redis-server, the dashboard's metric names, where the repo
and the tiny model are, the vLLM engine settings the suite starts (``engines``), their farm and
the order of the run (``enginefarm``, ``engineplan``). The fake vLLM server is
``proxy.bench.fake_vllm`` (benchmarks use it too). Test modules import from here (or from
conftest fixtures), never from one another."""
