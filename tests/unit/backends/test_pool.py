import pytest

from proxy.backends.pool import BackendPool
from proxy.config.backends import Backend, BackendHealth
from proxy.policies.backends import LeastUtilised
from proxy.policies.types import QueuedRequest, ScrapedLoad

HEALTH = BackendHealth(
    stale_after_s=2.0,
    max_backend_waiting=1,
    unhealthy_after=2,
    ramp_s=4.0,
    eject_base_s=1.0,
    eject_max_s=8.0,
)


def _pool(*caps: int) -> BackendPool:
    return BackendPool(
        [Backend(url=f"http://b{i}:80", max_inflight=c) for i, c in enumerate(caps)],
        HEALTH,
        LeastUtilised(),
    )


def _fill(pool: BackendPool, n: int, now: float = 0.0) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _ in range(n):
        b = pool.choose(None, 10, now)
        if b is None:
            break
        pool.acquire(b, 10)
        counts[b.cfg.url] = counts.get(b.cfg.url, 0) + 1
    return counts


def test_spreads_evenly_and_in_proportion_to_room() -> None:
    assert _fill(_pool(8, 8), 16) == {"http://b0:80": 8, "http://b1:80": 8}
    assert _fill(_pool(4, 12), 100) == {"http://b0:80": 4, "http://b1:80": 12}
    pool = _pool(4, 12)
    counts = _fill(pool, 8)  # half full: both at 50%
    assert counts == {"http://b0:80": 2, "http://b1:80": 6}


def test_no_room_means_none_and_release_gives_it_back() -> None:
    pool = _pool(1)
    b = pool.choose(None, 1, 0)
    assert b is not None
    pool.acquire(b, 1)
    assert pool.choose(None, 1, 0) is None and not pool.any_room(0)
    pool.release(b, 1)
    assert pool.choose(None, 1, 0) is b


def test_fresh_waiting_queue_shrinks_room_stale_is_ignored() -> None:
    pool = _pool(8)
    b = pool.all()[0]
    for _ in range(6):
        pool.acquire(b, 1)
    # vLLM queues 3 of its own beyond the allowance of 1: room shrinks by the excess of 2.
    b.load = ScrapedLoad(waiting=3, running=4, kv_usage=0.5, at=10.0)
    assert pool.room(b, now=10.5) == pytest.approx(0.0)
    assert pool.choose(None, 1, now=10.5) is None  # hold the backlog here
    assert pool.room(b, now=12.5) == pytest.approx(2.0)  # stale: own counts decide
    # A request or two waiting between steps is no signal: the room stays.
    b.load = ScrapedLoad(waiting=1, running=5, kv_usage=0.5, at=20.0)
    assert pool.room(b, now=20.1) == pytest.approx(2.0)
    # A completion frees a slot at once, without waiting for the next scrape.
    b.load = ScrapedLoad(waiting=3, running=4, kv_usage=0.5, at=30.0)
    pool.release(b, 1)
    assert pool.choose(None, 1, now=30.1) is b
    # Never stall an idle backend on a queue that is not ours.
    for _ in range(5):
        pool.release(b, 1)
    b.load = ScrapedLoad(waiting=50, running=8, kv_usage=0.9, at=40.0)
    assert pool.choose(None, 1, now=40.1) is b


def test_passive_ejection_backoff_and_ramp_on_return() -> None:
    pool = _pool(8, 8)
    bad, _good = pool.all()
    pool.record_failure(bad, now=0.0)
    assert bad.available(0.0)  # one reset or 5xx can be one request's bad luck
    pool.record_failure(bad, now=0.0)
    assert not bad.available(1.5) and bad.available(2.0)  # two in a row: ejected
    pool.record_failure(bad, now=2.0, definitive=True)
    assert not bad.available(5.5) and bad.available(6.0)  # backoff doubled
    assert _fill(pool, 4, now=0.5) == {"http://b1:80": 4}
    pool.record_success(bad, now=6.0)
    assert pool.room(bad, 6.0) == pytest.approx(2.0)  # 25% of 8 right after return
    small = _pool(1).all()[0]
    pool.probe_result(small, True, 0.0)
    small.reinstated_at = 6.0
    assert pool.room(small, 6.0) == pytest.approx(1.0)  # but always at least one
    assert pool.room(bad, 10.0) == pytest.approx(8.0)


def test_a_good_probe_between_request_failures_does_not_forgive_them() -> None:
    # A wedged engine answers /health: a good probe between its failed requests (another
    # backend's came between them) set its count back to zero, and it was never ejected.
    pool = _pool(8, 8)
    bad, _good = pool.all()
    pool.record_failure(bad, now=0.0)
    pool.probe_result(bad, True, 1.0)
    pool.record_failure(bad, now=2.0)
    assert not bad.available(2.5)  # two in a row: ejected
    pool.probe_result(bad, True, 3.0)  # during the ejection: nothing changes
    assert not bad.available(3.5) and bad.failures == 2
    pool.probe_result(bad, True, 4.5)  # after it: back, its count forgiven
    assert bad.available(4.5) and bad.failures == 0 and bad.reinstated_at == 4.5
    pool.record_failure(bad, now=5.0)
    assert bad.available(5.5)  # one failure again: not ejected at once


def test_active_probe_down_and_up() -> None:
    pool = _pool(4)
    b = pool.all()[0]
    pool.probe_result(b, False, 0.0)
    assert pool.any_available(0.0)  # one slow or failed probe is not an outage
    pool.probe_result(b, True, 0.5)
    pool.probe_result(b, False, 0.6)
    assert pool.any_available(0.6)
    pool.probe_result(b, False, 0.7)  # two in a row are
    assert not pool.any_available(0.7) and pool.choose(None, 1, 0.7) is None
    pool.probe_result(b, True, 1.0)
    assert pool.any_available(1.0) and pool.room(b, 1.0) == pytest.approx(1.0)


def test_model_routing() -> None:
    pool = _pool(4, 4)
    a, b = pool.all()
    a.models, b.models = frozenset({"llama"}), frozenset({"qwen"})
    assert pool.choose("qwen", 1, 0) is b
    assert pool.choose("mistral", 1, 0) is None
    assert not pool.model_known("mistral") and pool.model_known("llama")


def test_token_budget() -> None:
    pool = BackendPool(
        [Backend(url="http://x:1", max_inflight=10, max_tokens_inflight=1000)],
        HEALTH,
        LeastUtilised(),
    )
    b = pool.all()[0]
    pool.acquire(pool.choose(None, 600, 0), 600)  # type: ignore[arg-type]
    assert pool.choose(None, 600, 0) is None
    assert pool.choose(None, 300, 0) is b
    pool.release(b, 600)
    assert pool.choose(None, 5000, 0) is b  # too big for the budget, but the backend is idle


def test_reconfigure_drains_removed_backend_until_idle() -> None:
    pool = _pool(4, 4)
    old, keep = pool.all()
    pool.acquire(old, 1)
    pool.reconfigure([keep.cfg], HEALTH)
    assert old.draining and pool.choose(None, 1, 0) is keep
    pool.release(old, 1)
    assert pool.all() == [keep]


def test_admin_drain() -> None:
    pool = _pool(4)
    b = pool.all()[0]
    pool.drain(b.cfg.url)
    assert pool.choose(None, 1, 0) is None
    pool.drain(b.cfg.url, False)
    assert pool.choose(None, 1, 0) is b


def _retry(failed_on: str) -> QueuedRequest:
    return QueuedRequest("normal", "t", 10, 10, 0.0, failed_on=frozenset({failed_on}))


def test_a_retry_waits_for_another_backend_rather_than_go_back_to_the_one_that_failed_it() -> None:
    pool = _pool(4, 1)
    b0, b1 = pool.all()
    pool.acquire(b1, 1)  # the other backend is full: the retry waits for it
    assert pool.choose(None, 10, 0, request=_retry(b0.cfg.url)) is None
    pool.release(b1, 1)
    assert pool.choose(None, 10, 0, request=_retry(b0.cfg.url)) is b1


def test_a_retry_goes_back_to_the_backend_that_failed_it_when_no_other_serves() -> None:
    pool = _pool(4)
    b0 = pool.all()[0]
    assert pool.choose(None, 10, 0, request=_retry(b0.cfg.url)) is b0
    pool = _pool(4, 4)
    b0, b1 = pool.all()
    pool.record_failure(b1, 0.0, definitive=True)  # ejected: not available
    assert not b1.available(0.0)
    assert pool.choose(None, 10, 0, request=_retry(b0.cfg.url)) is b0


def test_a_tokenizer_retry_passes_over_the_backend_that_failed_it() -> None:
    pool = _pool(4, 4)
    b0, b1 = pool.all()
    assert pool.acquire_cheap(None, 0.0) is b0  # all idle: the first
    pool.release_cheap(b0)
    assert pool.acquire_cheap(None, 0.0, failed_on=frozenset({b0.cfg.url})) is b1
    pool.release_cheap(b1)
    pool.record_failure(b1, 0.0, definitive=True)  # the other one gone: back to the first
    assert pool.acquire_cheap(None, 0.0, failed_on=frozenset({b0.cfg.url})) is b0


def test_failing_probes_note_when_they_began() -> None:
    pool = _pool(4)
    b = pool.all()[0]
    pool.probe_result(b, False, 1.0)
    assert b.probe_failing_since == 1.0 and b.healthy  # one failed probe: still in rotation
    pool.probe_result(b, False, 2.0)
    assert b.probe_failing_since == 1.0 and not b.healthy
    pool.probe_result(b, True, 3.0)
    assert b.probe_failing_since is None


class _RaisingChooser(LeastUtilised):
    def ended(self, state: object, request: object, ran: bool | None) -> None:
        raise KeyError("a chooser bug")


def test_a_chooser_that_raises_at_a_requests_end_still_frees_its_slot() -> None:
    # kvfit's KeyError (test_kvfit) left every request it hit counted in: one slot lost each,
    # until every backend looked full to every tenant.
    pool = BackendPool([Backend(url="http://b0:80", max_inflight=1)], HEALTH, _RaisingChooser())
    request = QueuedRequest("t", "tenant", prompt_tokens=10, expected_output=1, arrival_s=0.0)
    state = pool.choose(None, 10, 0.0, request=request)
    assert state is not None
    pool.acquire(state, 10, request=request)
    with pytest.raises(KeyError):
        pool.release(state, 10, request=request)
    assert state.inflight == 0 and pool.choose(None, 10, 0.0, request=request) is state
