"""The simulator's batch scheduler (proxy.bench.kvsim.engine), hand-checked on small cases."""

from __future__ import annotations

from proxy.bench.kvsim.engine import EngineCosts, EngineRequest, SimEngine


def _engine(blocks: int = 64, seqs: int = 4, budget: int = 64) -> SimEngine:
    return SimEngine(
        num_blocks=blocks,
        block_size=4,
        max_num_seqs=seqs,
        max_batched_tokens=budget,
        costs=EngineCosts(step=0.01, prefill_token=0.001, decode_seq=0.002),
    )


def _request(
    prompt: int, out: int, hashes: tuple[int, ...], log: list[str], name: str
) -> EngineRequest:
    return EngineRequest(
        prompt,
        hashes,
        out,
        on_first_token=lambda t: log.append(f"{name} first {t:g}"),
        on_done=lambda t: log.append(f"{name} done {t:g}"),
        output_hash_base=-(1000 * (len(log) + 1)),
    )


def _run(engine: SimEngine, until: int = 100) -> float:
    now = 0.0
    for _ in range(until):
        planned = engine.schedule()
        if not planned:
            break
        now += engine.step_s(planned)
        engine.finish_step(planned, now)
    return now


def test_a_prompt_is_prefilled_in_chunks_then_decoded_and_its_blocks_cached() -> None:
    engine = _engine(budget=8)
    log: list[str] = []
    engine.add(_request(10, 2, (1, 2), log, "a"))  # 10 tokens: 2 full blocks
    planned = engine.schedule()
    assert list(planned.values()) == [8]  # chunked: the budget
    assert engine.step_s(planned) == 0.01 + 8 * 0.001
    engine.finish_step(planned, 1.0)
    assert log == []
    planned = engine.schedule()
    assert list(planned.values()) == [2]
    engine.finish_step(planned, 2.0)
    assert log == ["a first 2"]
    planned = engine.schedule()
    assert list(planned.values()) == [1] and engine.step_s(planned) == 0.01 + 0.002
    engine.finish_step(planned, 3.0)
    assert log == ["a first 2", "a done 3"] and engine.idle
    assert engine.cache.hit([1, 2], 2) == 2  # both full prompt blocks stay cached


def test_a_hit_saves_its_blocks_and_is_counted_once() -> None:
    engine = _engine()
    log: list[str] = []
    engine.add(_request(9, 1, (1, 2), log, "a"))
    _run(engine)
    engine.add(_request(13, 1, (1, 2, 3), log, "b"))  # shares a's two blocks
    planned = engine.schedule()
    assert list(planned.values()) == [13 - 8]
    _run(engine)
    assert engine.counts.prompt == 22 and engine.counts.hits == 8
    # A prompt of exactly its full blocks recomputes the last block (vLLM computes the last
    # token): 8 tokens, 2 blocks cached, at most 1 may hit.
    engine.add(_request(8, 1, (1, 2), log, "c"))
    assert list(engine.schedule().values()) == [4]


def test_max_num_seqs_bounds_the_running_requests() -> None:
    engine = _engine(seqs=2)
    log: list[str] = []
    for name in "abc":
        engine.add(_request(3, 5, (), log, name))
    planned = engine.schedule()
    assert len(planned) == 2 and len(engine.waiting) == 1


def test_the_newest_running_request_is_preempted_when_blocks_run_out_and_recomputed() -> None:
    engine = _engine(blocks=5, budget=64)  # 4 usable blocks of 4 tokens
    log: list[str] = []
    engine.add(_request(7, 6, (), log, "a"))  # 2 blocks now, a third at its 9th token
    engine.add(_request(7, 6, (), log, "b"))  # 2 blocks: the pool is full
    planned = engine.schedule()
    assert len(planned) == 2 and engine.cache.free == 0
    engine.finish_step(planned, 1.0)  # both have their first token
    planned = engine.schedule()
    assert len(planned) == 2  # each computes its 8th token: still two blocks each
    engine.finish_step(planned, 2.0)
    planned = engine.schedule()  # a's 9th token needs a block: b, the newest, goes
    assert list(planned) == [engine.running[0]] and engine.counts.preemptions == 1
    assert [len(engine.waiting), len(engine.running)] == [1, 1]
    _run(engine)
    assert log[:2] == ["a first 1", "b first 1"]
    assert engine.idle and "b done" in log[-1]
    # b came back with its prompt and its two tokens to compute again; its hits uncounted
    assert engine.counts.recomputed == 9 and engine.counts.hits == 0


def test_a_prompt_admitted_behind_another_in_its_step_hits_the_blocks_that_step_computes() -> None:
    # vLLM caches a request's full blocks when it schedules them (allocate_slots), not when
    # the step ends: two requests of one 1,500-token prompt sent together to vLLM 0.32 (CPU,
    # 512-token budget) gave the second 1,408 tokens of hits, more than the 1,024 its first
    # two steps had computed, and its first token one step after the first's.
    engine = _engine(blocks=128, budget=20)
    log: list[str] = []
    prompt = tuple(range(1, 9))  # 8 full blocks of 4 tokens, then 2 more tokens
    engine.add(_request(34, 1, prompt, log, "a"))
    engine.add(_request(34, 1, prompt, log, "b"))
    first = engine.schedule()  # a: 20 tokens (blocks 1-5); the budget is spent: b waits
    assert list(first.values()) == [20]
    engine.finish_step(first, 1.0)
    second = engine.schedule()  # a: its last 14 (blocks 6-8, cached as scheduled), then b
    assert list(second.values()) == [14, 2]  # b hits all 8 blocks: its last 2 tokens only
    engine.finish_step(second, 2.0)
    assert "a first 2" in log and "b first 2" in log
    assert engine.counts.hits == 32
