"""The one Prometheus text parser: vLLM's load gauges, labelled samples, sums."""

from __future__ import annotations

from proxy.policies.types import ScrapedLoad
from proxy.telemetry import prometheus
from proxy.telemetry.prometheus import Sample, parse_vllm_load

VLLM_TEXT = """# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="1",model_name="tiny"} 1.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 7.0
vllm:num_requests_running{engine="0",model_name="tiny"} 4.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75
vllm:num_preemptions_total{engine="0",model_name="tiny"} 9.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 2.0
"""


def test_parse_vllm_metrics_text() -> None:
    load = parse_vllm_load(VLLM_TEXT, now=5.0)
    assert load == ScrapedLoad(waiting=4.0, running=4.0, kv_usage=0.5, at=5.0, preemptions=9.0)
    assert parse_vllm_load("process_cpu_seconds_total 1.0\n", 0.0) is None


def test_the_engines_kv_cache_size_comes_from_its_cache_config_info() -> None:
    info = 'vllm:cache_config_info{block_size="16",engine="%s",num_gpu_blocks="%s"} 1.0\n'
    text = VLLM_TEXT + info % ("0", "4096") + info % ("1", "2048")
    load = parse_vllm_load(text, now=5.0)
    assert load is not None and load.kv_blocks == 2048.0  # the smaller engine bounds a request
    unset = parse_vllm_load(VLLM_TEXT + info % ("0", "None"), now=5.0)
    assert unset is not None and unset.kv_blocks is None
    assert parse_vllm_load(info % ("0", "64"), now=5.0) is None  # no load gauge: not a load


def test_a_metric_whose_name_extends_a_wanted_one_is_not_it() -> None:
    # vllm:num_requests_waiting_by_reason starts with vllm:num_requests_waiting.
    assert prometheus.total(VLLM_TEXT, prometheus.VLLM_WAITING) == 4.0
    assert prometheus.vllm_busy(VLLM_TEXT) == 8.0


def test_labels_values_and_sums() -> None:
    assert prometheus.sum_by(VLLM_TEXT, "vllm:request_success_total", "finished_reason") == {
        "length": 5.0,
        "abort": 2.0,
    }
    assert prometheus.sum_by(VLLM_TEXT, prometheus.VLLM_RUNNING, "missing") == {"": 4.0}
    assert prometheus.total(VLLM_TEXT, "vllm:absent") == 0.0
    assert len(list(prometheus.samples(VLLM_TEXT, "vllm:"))) == 9


def test_odd_lines_timestamps_escapes_and_labelless_samples() -> None:
    text = "\n".join(
        [
            'x{path="/a b}",note="say \\"hi\\"\\n"} 2.5 1700000000000',  # spaces, braces, escapes
            "x 1e3",  # no labels
            "x{broken 1",  # unreadable: skipped
            'x{a="1"} NaNish',  # unreadable value: skipped
            "xy 7",  # another metric
            "",
        ]
    )
    assert list(prometheus.of(text, "x")) == [
        Sample("x", {"path": "/a b}", "note": 'say "hi"\n'}, 2.5),
        Sample("x", {}, 1000.0),
    ]
