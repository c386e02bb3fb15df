"""Real vLLM servers for the suite, one per setting, started ahead of the tests that use them.

The farm follows the run's plan (each test's settings, in run order: tests/helpers/engineplan.py).
Before each test it stops the engines no later test uses, and starts the next settings the plan
needs (at most ``capacity`` live, and only with memory for one more): their ~25 s starts
overlap the tests before them. Before a test that uses engines, what it needs starts (all at
once) and is waited for; a start runs on any core and moves onto the engine cores once ready
(proxy.tools.engine.EngineProcess), so it may run beside a test that uses engines — except one
marked ``quiet_engines`` (it measures its engines: every start under way is waited for, and
nothing starts beside it). Each start is recorded: its setting, whether it started ahead,
seconds from start to ready, seconds a test waited for it.

Each test that uses engines starts from idle ones: before it, the farm waits (in polls, bounded)
until its live engines run and queue no request. Work an earlier test left in vLLM (a
generation whose client left, still decoding) otherwise shrank the room a later test's proxy saw
and moved its picks. What was found is recorded (``leftovers.tsv``: the test before, the
engine, what it still ran and queued, how long it took to idle) and counted in the summary.
"""

from __future__ import annotations

import re
import time
import urllib.request
from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from proxy.tools.engine import EngineProcess, EngineSpec

if TYPE_CHECKING:  # the settings import the proxy's app: only the engine tests need it loaded
    from tests.helpers.engines import EngineSetting

ENGINE_GIB = 3.0  # one CPU engine with the tiny model and its 1 GiB KV cache, measured ~3 GB
MEMORY_MARGIN_GIB = 1.0
IDLE_POLLS = 1200  # 0.1 s apart: past the longest generation a test leaves (1,600 tokens)
_QUEUE = re.compile(r"^vllm:num_requests_(running|waiting)\{[^}]*\} (\S+)$", re.M)


@dataclass
class Leftover:
    before: str | None  # the last test that used engines
    test: str
    setting: str
    running: float
    waiting: float
    idle_after_s: float | None  # None: never idle within IDLE_POLLS


@dataclass
class Start:
    setting: str
    ahead: bool  # started before a test asked for it
    started_at: float
    ready_s: float | None = None  # start to ready (seen ready: to the nearest test boundary)
    waited_s: float = 0.0  # time tests spent blocked on it


def available_gib() -> float:
    """MemAvailable of the machine (infinite where /proc/meminfo is missing)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / (1024 * 1024)
    except OSError:
        pass
    return float("inf")


class EngineFarm:
    """Starts, shares and stops real vLLM servers keyed by their setting."""

    def __init__(
        self,
        log_dir: Path,
        model_dir: Callable[[], Path],
        capacity: int,
        memory_gib: Callable[[], float] = available_gib,
        launch: Callable[[EngineSpec, Path], EngineProcess] = EngineProcess,
        queue_of: Callable[[EngineProcess], tuple[float, float]] | None = None,
        pause: Callable[[float], None] = time.sleep,
        ahead: bool = True,
    ) -> None:
        self.log_dir = log_dir
        self.model_dir = model_dir
        self.capacity = capacity
        self.memory_gib = memory_gib
        self.launch = launch
        self.live: OrderedDict[EngineSetting, EngineProcess] = OrderedDict()
        self.pending: dict[EngineSetting, Start] = {}  # started, not yet seen ready
        self.starts: list[Start] = []
        self.used_by_current_test: list[EngineProcess] = []
        self.plan: Sequence[frozenset[EngineSetting]] = ()
        self.quiet: list[bool] = []
        self.later: list[frozenset[EngineSetting]] = []  # later[i]: used by plan[i:]
        self.position: int | None = None
        self.queue_of = queue_of or _queue  # vLLM's (running, waiting)
        self.pause = pause
        # Whether engines start ahead of the tests that need them. Not on a pytest-xdist
        # worker: it collects every test but runs those the controller sends it, and each of
        # three workers had started a LoRA engine ahead for a module one of them ran.
        self.ahead = ahead
        self.leftovers: list[Leftover] = []
        self._last_test: str | None = None

    def follow(self, plan: Sequence[frozenset[EngineSetting]], quiet: Sequence[bool] = ()) -> None:
        """``plan[i]``: the settings the i-th test uses; ``quiet[i]``: it measures its engines,
        so nothing starts beside them while it runs."""
        self.plan = plan
        self.quiet = list(quiet) or [False] * len(plan)
        self.later = [frozenset()] * (len(plan) + 1)
        for i in range(len(plan) - 1, -1, -1):
            self.later[i] = self.later[i + 1] | plan[i]

    def advance(self, position: int) -> None:
        """Before the test at ``position`` of the plan: stop what no later test uses; start
        ahead what is coming while this test needs no engine."""
        self.position = position
        for setting in [s for s in self.live if s not in self.later[position]]:
            self._stop(setting)
        self._note_ready()
        if self.plan[position]:
            # What this test needs and is not live starts now, all at once, and is waited for.
            # Before a quiet test every other start under way is waited for too: a start shares
            # the engine cores with the engines it measures (a plugin test lost its tokens to
            # one). Others run beside starts: waiting for each cost the suite ~200 s of 500.
            for setting in sorted(self.plan[position] - self.live.keys(), key=lambda s: s.name):
                self._make_room(self.plan[position])
                self._start(setting, ahead=False)
            quiet = self.quiet[position]
            for setting in [s for s in self.pending if quiet or s in self.plan[position]]:
                self._wait_ready(setting)
            if quiet:
                return
        # Starts go on any core and move onto the engine cores once ready (EngineProcess): they
        # may run beside a test that uses engines, which would otherwise wait ~25 s for each.
        for setting in self._coming(position) if self.ahead else ():
            if len(self.live) >= self.capacity:
                break
            if self.memory_gib() < ENGINE_GIB + MEMORY_MARGIN_GIB:
                break
            self._start(setting, ahead=True)

    def get(self, setting: EngineSetting) -> EngineProcess:
        """The live engine of ``setting``, started (and waited for) if need be."""
        if self.position is not None and setting not in self.plan[self.position]:
            raise RuntimeError(
                f"engine {setting.name!r} is not declared: add it to the test module's "
                "pytest.mark.engines(...) so that the run is planned around it"
            )
        engine = self.live.get(setting)
        if engine is not None and not engine.alive():
            self._stop(setting)
            engine = None
        if engine is None:
            self._make_room(self.plan[self.position] if self.position is not None else {setting})
            engine = self._start(setting, ahead=False)
        self._wait_ready(setting)
        self.live.move_to_end(setting)
        self.used_by_current_test.append(engine)
        return engine

    def until_idle(self, test: str) -> None:
        """Before ``test`` (which uses engines): its live, ready engines run and queue nothing
        (``leftovers.tsv``)."""
        if self.position is None or not self.plan[self.position]:
            return
        for setting in sorted(self.plan[self.position] & self.live.keys(), key=lambda s: s.name):
            if setting in self.pending:
                continue  # starting: idle
            running, waiting = self.queue_of(self.live[setting])
            if running + waiting == 0:
                continue
            t0, idle_after = time.monotonic(), None
            for _ in range(IDLE_POLLS):  # and a deadline: a poll may take its timeout
                self.pause(0.1)
                if sum(self.queue_of(self.live[setting])) == 0:
                    idle_after = time.monotonic() - t0
                    break
                if time.monotonic() - t0 > IDLE_POLLS * 0.15:
                    break
            found = Leftover(self._last_test, test, setting.name, running, waiting, idle_after)
            self.leftovers.append(found)
        self._last_test = test

    def stop_all(self) -> None:
        for setting in list(self.live):
            self._stop(setting)

    def summary(self) -> str:
        waited = sum(s.waited_s for s in self.starts)
        ahead = sum(s.ahead for s in self.starts)
        left = f"; {len(self.leftovers)} found work left in vLLM" if self.leftovers else ""
        if never := sum(f.idle_after_s is None for f in self.leftovers):
            left += f" ({never} never idle: see leftovers.tsv)"
        return (
            f"vLLM engine starts: {len(self.starts)} ({ahead} ahead of their tests); "
            f"tests waited {waited:.0f} s for engines{left}"
        )

    def leftovers_report(self) -> str:
        lines = ["test before\ttest\tsetting\trunning\twaiting\tidle_after_s"]
        for f in self.leftovers:
            idle = f"{f.idle_after_s:.1f}" if f.idle_after_s is not None else "never"
            lines.append(f"{f.before}\t{f.test}\t{f.setting}\t{f.running:g}\t{f.waiting:g}\t{idle}")
        return "\n".join([*lines, ""])

    def report(self) -> str:
        lines = ["setting\tahead\tready_s\twaited_s"]
        for s in self.starts:
            ready = f"{s.ready_s:.1f}" if s.ready_s is not None else "-"
            lines.append(f"{s.setting}\t{s.ahead}\t{ready}\t{s.waited_s:.1f}")
        return "\n".join([*lines, self.summary(), ""])

    def _coming(self, position: int) -> list[EngineSetting]:
        """Settings not live, in the order the plan first needs them from ``position``."""
        wanted = self.later[position] - self.live.keys()
        seen: dict[EngineSetting, None] = {}
        for need in self.plan[position:]:
            for setting in sorted(need & wanted, key=lambda s: s.name):
                seen.setdefault(setting, None)
            if len(seen) == len(wanted):
                break
        return list(seen)

    def _make_room(self, keep: Set[EngineSetting]) -> None:
        """Stop the least recently used engines outside ``keep`` while at the capacity."""
        while len(self.live) >= self.capacity:
            spare = next((s for s in self.live if s not in keep), None)
            if spare is None:
                return
            self._stop(spare)

    def _start(self, setting: EngineSetting, *, ahead: bool) -> EngineProcess:
        spec = setting.spec(self.model_dir(), len(self.starts))
        log = self.log_dir / f"vllm-{setting.name}-{spec.port}.log"
        # Started from this (main) thread: the engine dies with the thread that started it.
        engine = self.launch(spec, log).start()
        self.live[setting] = engine
        record = Start(setting.name, ahead, time.monotonic())
        self.starts.append(record)
        self.pending[setting] = record
        return engine

    def _wait_ready(self, setting: EngineSetting, *, port_retries: int = 2) -> None:
        record = self.pending.pop(setting, None)
        if record is not None:
            t0 = time.monotonic()
            try:
                self.live[setting].wait_ready()
            except RuntimeError:
                # free_port() picks a port that is free now; a test beside the start (a served
                # proxy, a fake backend) can bind it first. Another port, not a failed suite.
                log = self.live[setting].log_path
                lost_port = log is not None and "Address already in use" in log.read_text(
                    errors="replace"
                )
                if not (lost_port and port_retries):
                    raise
                self._stop(setting)
                self._start(setting, ahead=False)
                self._wait_ready(setting, port_retries=port_retries - 1)
                return
            now = time.monotonic()
            record.waited_s += now - t0
            record.ready_s = now - record.started_at

    def _note_ready(self) -> None:
        for setting, record in list(self.pending.items()):
            if self.live[setting].ready():
                record.ready_s = time.monotonic() - record.started_at
                del self.pending[setting]

    def _stop(self, setting: EngineSetting) -> None:
        engine = self.live.pop(setting)
        self.pending.pop(setting, None)
        engine.stop()


def _queue(engine: EngineProcess) -> tuple[float, float]:
    """vLLM's requests running and waiting (0, 0 where its metrics do not answer)."""
    try:
        with urllib.request.urlopen(engine.spec.url + "/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except Exception:  # a dead or garbled engine: its test says why
        return 0.0, 0.0
    found = {"running": 0.0, "waiting": 0.0}
    for m in _QUEUE.finditer(text):
        found[m.group(1)] += float(m.group(2))
    return found["running"], found["waiting"]
