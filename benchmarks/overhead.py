"""The proxy's own cost, side by side: a null OpenAI backend reached directly, through nginx as
a reverse proxy, through tierproxy and (``--litellm VENV``) through LiteLLM's proxy.

    python benchmarks/overhead.py [--duration 5] [--litellm /path/to/litellm-venv]

The null backend is nginx (Debian's nginx-light) returning fixed answers when it is installed,
else the built-in one (benchmarks/nullserver.py); the *paced* stream mode always uses the
built-in one (one event per tick to every open stream, as vLLM's decode steps write). The load
generator is ``wrk``, pinned with the backend to one core (``--load-cpu``), each proxy alone
on another (``--proxy-cpu``). Rows: non-stream at 1 and 32 connections, stream *burst* (the
whole answer in one write) and *paced*, 32 connections each (``--paced-connections``).

Printed per row: req/s, SSE events/s (answers/s x the 60 token events of one answer), p50/p99
and what the proxy adds to the direct ones, CPU time of the proxy process(es) per request, and
any non-2xx answers or socket errors (a row with errors measured something else).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import orjson
import yaml

from proxy.bench.vllm_answers import NULL_EVENTS as EVENTS
from proxy.bench.vllm_answers import NULL_MODEL as MODEL
from proxy.bench.vllm_answers import models_list
from proxy.bench.vllm_answers import null_completion as completion
from proxy.bench.vllm_answers import null_stream_events as stream_events
from proxy.config.tenants import hash_key

MODELS = models_list(MODEL)

ROOT = Path(__file__).resolve().parent.parent
KEY = "overhead-bench-key"
SECRET = "overhead-bench-secret-of-at-least-32-bytes"
PORTS = {"null": 18100, "paced": 18101, "nginx": 18200, "tierproxy": 18300, "litellm": 18400}


@dataclass(frozen=True)
class Row:
    name: str
    stream: bool
    paced: bool
    connections: int


@dataclass
class Result:
    target: str
    row: Row
    rps: float
    p50_us: float
    p99_us: float
    cpu_us_per_req: float | None
    errors: int

    @property
    def events_per_s(self) -> float:
        return self.rps * EVENTS if self.row.stream else 0.0


# -- wrk ---------------------------------------------------------------------------------------


def wrk_script(path: Path, *, stream: bool, model: str = MODEL) -> None:
    body: dict[str, object] = {
        "model": model,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": EVENTS,
    }
    if stream:
        body["stream"] = True
    lines = [
        'wrk.method = "POST"',
        f"wrk.body = '{orjson.dumps(body).decode()}'",
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {KEY}"',
    ]
    if stream:  # the nginx null backend cannot read the body: it answers by this header
        lines.append('wrk.headers["X-Null-Stream"] = "1"')
    path.write_text("\n".join(lines) + "\n")


_UNITS = {"us": 1.0, "ms": 1e3, "s": 1e6, "m": 60e6}


def _micros(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    assert match, text
    return float(match.group(1)) * _UNITS[match.group(2)]


def parse_wrk(out: str) -> tuple[float, float, float, int]:
    rps = float(re.search(r"Requests/sec:\s*([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = _micros(re.search(r"\s50%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    p99 = _micros(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = sum(int(n) for n in re.findall(r"Non-2xx or 3xx responses:\s*(\d+)", out))
    if m := re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out):
        errors += sum(int(g) for g in m.groups())
    return rps, p50, p99, errors


def run_wrk(
    url: str, script: Path, conns: int, seconds: float, cpu: str, timeout_s: float = 10.0
) -> str:
    cmd = [
        "taskset",
        "-c",
        cpu,
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{max(1, round(seconds))}s",
        "--latency",
        f"--timeout={timeout_s:g}s",
    ]
    cmd += ["-s", str(script), url]
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


# -- processes ---------------------------------------------------------------------------------


def _tree(pid: int) -> list[int]:
    pids = [pid]
    with contextlib.suppress(OSError):
        for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
            pids += _tree(int(child))
    return pids


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process and its children that still run (nginx's workers)."""
    ticks = 0
    for p in _tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout_s: float = 60.0, *, post: bytes | None = None) -> None:
    end = time.monotonic() + timeout_s
    while True:
        try:
            req = urllib.request.Request(url, data=post, headers=_json_auth())
            with urllib.request.urlopen(req, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > end:
            raise RuntimeError(f"{url} did not answer 200 within {timeout_s} s")
        time.sleep(0.2)


def _json_auth() -> dict[str, str]:
    return {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def process(cmd: list[str], cpu: str, log: Path, **kw: object) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(["taskset", "-c", cpu, *cmd], stdout=out, stderr=out, **kw)  # type: ignore[call-overload]
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def nginx_conf(tmp: Path, name: str, port: int, body: str) -> Path:
    prefix = tmp / f"nginx-{name}"
    prefix.mkdir(exist_ok=True)
    temps = " ".join(
        f"{kind}_temp_path {prefix}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    conf = prefix / "nginx.conf"
    conf.write_text(
        f"worker_processes 1; daemon off; pid {prefix}/nginx.pid; error_log {prefix}/error.log;\n"
        "events { worker_connections 4096; }\n"
        f"http {{ access_log off; keepalive_requests 10000000; {temps}\n"
        f"  server {{ listen 127.0.0.1:{port} backlog=4096;\n{body}\n  }}\n}}\n"
    )
    return conf


def null_locations(tmp: Path) -> str:
    """Static files (a ``return`` string is limited to 4 KB); a POST to a static file is a 405,
    turned into the file by ``error_page`` (an internal redirect as GET)."""
    files = tmp / "null-files"
    files.mkdir(exist_ok=True)
    (files / "stream").write_bytes(b"".join(stream_events()))
    (files / "completion").write_bytes(completion())
    (files / "models").write_bytes(MODELS)
    return f"""
    root {files};
    location = /v1/chat/completions {{
      if ($http_x_null_stream) {{ rewrite ^ /stream last; }}
      rewrite ^ /completion last;
    }}
    location = /stream {{ internal; default_type text/event-stream; error_page 405 =200 $uri; }}
    location = /completion {{ internal; default_type application/json; error_page 405 =200 $uri; }}
    location = /v1/models {{ default_type application/json; alias {files}/models; }}
    location / {{ default_type text/plain; return 200 ''; }}
"""


def proxy_locations(upstream_port: int) -> str:
    return f"""
    location / {{ proxy_pass http://127.0.0.1:{upstream_port}; proxy_http_version 1.1;
      proxy_set_header Connection ""; proxy_buffering off; }}
"""


def nginx_upstream_block(port: int) -> str:
    # nginx wants keep-alive to its upstream named in an upstream block.
    return f"upstream null_{port} {{ server 127.0.0.1:{port}; keepalive 64; }}"


def tierproxy_config(
    tmp: Path, backend_port: int, *, name: str = "tierproxy", sample_ratio: float | None = None
) -> Path:
    """``sample_ratio``: tracing on at that ratio, its spans exported over OTLP/HTTP to the
    null backend (nginx answers any POST with an empty 200: a sink that costs the proxy
    nothing beyond its own encoding and sending)."""
    cfg: dict[str, object] = {
        "listen": {"host": "127.0.0.1", "port": PORTS["tierproxy"]},
        "tiers": {
            "bench": {
                "priority": 0,
                "weight": 1,
                "max_queue": 100000,
                "queue_timeout_s": 60,
                "request_timeout_s": 60,
            }
        },
        "tenants": [{"name": "bench", "tier": "bench", "keys": [{"sha256": hash_key(KEY)}]}],
        "backends": [
            {
                "url": f"http://127.0.0.1:{backend_port}",
                "max_inflight": 4096,
                "send_priority": False,
            }
        ],
    }
    if sample_ratio is not None:
        cfg["tracing"] = {
            "endpoint": f"http://127.0.0.1:{PORTS['null']}/v1/traces",
            "protocol": "http/protobuf",
            "sample_ratio": sample_ratio,
        }
    path = tmp / f"{name}-{backend_port}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def litellm_config(tmp: Path, backend_port: int) -> Path:
    cfg = {
        "model_list": [
            {
                "model_name": MODEL,
                "litellm_params": {
                    "model": f"openai/{MODEL}",
                    "api_base": f"http://127.0.0.1:{backend_port}/v1",
                    "api_key": "none",
                },
            }
        ],
        "litellm_settings": {"set_verbose": False, "json_logs": False},
    }
    path = tmp / "litellm.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def profile_top(raw: Path, top: int) -> str:
    """The functions with the most samples of py-spy's collapsed stacks: on the stack
    (inclusive) and on top of it (self)."""
    inclusive: dict[str, int] = {}
    own: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        n = int(count)
        total += n
        # one entry per function: "name (file.py)", line numbers dropped
        frames = [re.sub(r" \((?:.*/)?([^/]+?):\d+\)$", r" (\1)", f) for f in stack.split(";")]
        for frame in set(frames):
            inclusive[frame] = inclusive.get(frame, 0) + n
        own[frames[-1]] = own.get(frames[-1], 0) + n
    lines = [f"profile {raw} ({total} samples)", "self%  total%  function"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{100 * n / total:5.1f}  {100 * inclusive[frame] / total:5.1f}  {frame}")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------


ROWS = [
    Row("non-stream", False, False, 1),
    Row("non-stream", False, False, 32),
    Row("stream burst", True, False, 32),
    Row("stream paced", True, True, 32),
]


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.scripts = {}
        for stream in (False, True):
            path = tmp / f"wrk-{'stream' if stream else 'json'}.lua"
            wrk_script(path, stream=stream)
            self.scripts[stream] = path
        self.results: list[Result] = []

    def measure(self, target: str, base: str, pid: int | None, rows: list[Row]) -> None:
        a = self.args
        for row in rows:
            conns = a.paced_connections if row.paced else row.connections
            url = base + "/v1/chat/completions"
            script = self.scripts[row.stream]
            # LiteLLM's streams take seconds each at 32 connections: a longer run counts some.
            seconds = max(a.duration, 20) if target == "litellm" else a.duration
            run_wrk(url, script, conns, a.warmup, a.load_cpu)
            cpu0 = cpu_seconds(pid) if pid else 0.0
            out = run_wrk(url, script, conns, seconds, a.load_cpu, a.wrk_timeout)
            cpu1 = cpu_seconds(pid) if pid else 0.0
            rps, p50, p99, errors = parse_wrk(out)
            requests = rps * seconds
            cpu = (cpu1 - cpu0) / requests * 1e6 if pid and requests else None
            result = Result(target, row, rps, p50, p99, cpu, errors)
            self.results.append(result)
            print(self.line(result), flush=True)

    def direct_of(self, row: Row) -> Result | None:
        return next((r for r in self.results if r.target == "direct" and r.row == row), None)

    def line(self, r: Result) -> str:
        conns = self.args.paced_connections if r.row.paced else r.row.connections
        direct = self.direct_of(r.row)
        added = (
            f"{(r.p50_us - direct.p50_us) / 1e3:.3f} | {(r.p99_us - direct.p99_us) / 1e3:.3f}"
            if direct and r.target != "direct"
            else "- | -"
        )
        events = f"{r.events_per_s:,.0f}" if r.row.stream else "-"
        cpu = f"{r.cpu_us_per_req:,.0f}" if r.cpu_us_per_req is not None else "-"
        return (
            f"| {r.target} | {r.row.name} | {conns} | {r.rps:,.0f} | {events} | "
            f"{r.p50_us / 1e3:.3f} | {r.p99_us / 1e3:.3f} | {added} | {cpu} | {r.errors} |"
        )


HEADER = (
    "| target | mode | conns | req/s | events/s | p50 ms | p99 ms | added p50 ms | added p99 ms "
    "| proxy CPU µs/req | errors |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def run(args: argparse.Namespace) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="overhead-"))
    tmp.chmod(0o755)  # nginx workers run as nobody
    bench = Bench(args, tmp)
    nginx = shutil.which("nginx") if not args.builtin_null else None
    py = sys.executable
    null_cmd = [py, str(ROOT / "benchmarks/nullserver.py")]
    rows = [r for r in ROWS if not args.modes or r.name in args.modes.split(",")]
    burst_rows = [r for r in rows if not r.paced]
    paced_rows = [r for r in rows if r.paced] if not args.no_paced else []
    print(
        f"null backend: {'nginx ' + nginx if nginx else 'built-in'}; paced: built-in, "
        f"gap {args.paced_gap_ms} ms; {args.duration} s per row; wrk on cpu {args.load_cpu}, "
        f"proxies on cpu {args.proxy_cpu}\n"
    )
    print(HEADER, flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TIERPROXY_TICKET_SECRET": SECRET}
    with contextlib.ExitStack() as stack:
        if nginx:
            conf = nginx_conf(tmp, "null", PORTS["null"], null_locations(tmp))
            stack.enter_context(process([nginx, "-c", str(conf)], args.load_cpu, tmp / "null.log"))
        else:
            stack.enter_context(
                process(
                    [*null_cmd, "--port", str(PORTS["null"])],
                    args.load_cpu,
                    tmp / "null.log",
                    env=env,
                )
            )
        stack.enter_context(
            process(
                [
                    *null_cmd,
                    "--port",
                    str(PORTS["paced"]),
                    "--paced-gap-ms",
                    str(args.paced_gap_ms),
                ],
                args.load_cpu,
                tmp / "paced.log",
                env=env,
            )
        )
        for port in (PORTS["null"], PORTS["paced"]):
            wait_http(f"http://127.0.0.1:{port}/v1/models")
        for rows, port in ((burst_rows, PORTS["null"]), (paced_rows, PORTS["paced"])):
            if "direct" in args.targets:
                bench.measure("direct", f"http://127.0.0.1:{port}", None, rows)
        if nginx and "nginx" in args.targets:
            for rows, port in ((burst_rows, PORTS["null"]), (paced_rows, PORTS["paced"])):
                if not rows:
                    continue
                body = proxy_locations(port).replace(
                    f"http://127.0.0.1:{port}", f"http://null_{port}"
                )
                conf = nginx_conf(tmp, f"proxy-{port}", PORTS["nginx"], body)
                text = conf.read_text().replace("http { ", "http { " + nginx_upstream_block(port))
                conf.write_text(text)
                with process([nginx, "-c", str(conf)], args.proxy_cpu, tmp / "nginx.log") as p:
                    wait_http(f"http://127.0.0.1:{PORTS['nginx']}/v1/models")
                    bench.measure("nginx", f"http://127.0.0.1:{PORTS['nginx']}", p.pid, rows)
        proxies: list[tuple[str, Path, float | None]] = (
            [("tierproxy", ROOT, None)] if "tierproxy" in args.targets else []
        )
        if args.before:  # another checkout of tierproxy, measured in the same run
            proxies.insert(0, ("tierproxy-before", Path(args.before).resolve(), None))
        for share in (float(r) for r in args.tracing.split(",")) if args.tracing else ():
            proxies.append((f"tierproxy-trace-{share:.0%}", ROOT, share))
        for (name, root, ratio), (rows, port) in itertools.product(
            proxies, ((burst_rows, PORTS["null"]), (paced_rows, PORTS["paced"]))
        ):
            if not rows:
                continue
            cfg = tierproxy_config(tmp, port, name=name, sample_ratio=ratio)
            cmd = [py, "-m", "proxy.cli", "serve", "-c", str(cfg)]
            log = tmp / f"{name}-{port}.log"
            run_env = {**env, "PYTHONPATH": str(root)}
            with process(cmd, args.proxy_cpu, log, env=run_env, cwd=str(root)) as p:
                base = f"http://127.0.0.1:{PORTS['tierproxy']}"
                wait_http(
                    base + "/v1/chat/completions",
                    post=orjson.dumps(
                        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                    ),
                )
                if args.profile:
                    spy = tmp / f"profile-{name}-{port}.txt"
                    prof = subprocess.Popen(
                        [
                            str(Path(sys.executable).parent / "py-spy"),
                            "record",
                            "-p",
                            str(p.pid),
                            "-f",
                            "raw",
                            "-o",
                            str(spy),
                            "-d",
                            str(int((args.duration + args.warmup) * len(rows) + 3)),
                            "--nonblocking",
                        ],
                        stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL,
                    )
                bench.measure(name, base, p.pid, rows)
                if args.profile:
                    prof.wait()
                    print(profile_top(spy, args.profile_top))
        if args.litellm:
            # LiteLLM does not pass the X-Null-Stream header on: the built-in null answers it.
            builtin = PORTS["null"] + 2
            stack.enter_context(
                process(
                    [*null_cmd, "--port", str(builtin)],
                    args.load_cpu,
                    tmp / "null2.log",
                    env=env,
                )
            )
            wait_http(f"http://127.0.0.1:{builtin}/v1/models")
            for rows, port in ((burst_rows, builtin), (paced_rows, PORTS["paced"])):
                if not rows:
                    continue
                exe = str(Path(args.litellm) / "bin" / "litellm")
                cmd = [
                    exe,
                    "--config",
                    str(litellm_config(tmp, port)),
                    "--port",
                    str(PORTS["litellm"]),
                    "--num_workers",
                    "1",
                ]
                with process(cmd, args.proxy_cpu, tmp / f"litellm-{port}.log") as p:
                    base = f"http://127.0.0.1:{PORTS['litellm']}"
                    wait_http(
                        base + "/v1/chat/completions",
                        180,
                        post=orjson.dumps(
                            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
                        ),
                    )
                    bench.measure("litellm", base, p.pid, rows)
    print(f"\nlogs and configs: {tmp}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=int, default=5, help="seconds per row")
    parser.add_argument("--warmup", type=int, default=1, help="seconds before each row")
    parser.add_argument("--load-cpu", default="0", help="cpu list of wrk and the null backend")
    parser.add_argument("--proxy-cpu", default="1", help="cpu list of the proxy")
    parser.add_argument("--paced-gap-ms", type=float, default=1.0)
    parser.add_argument("--paced-connections", type=int, default=128)
    parser.add_argument(
        "--before", metavar="ROOT", help="also run the tierproxy checkout at ROOT, first"
    )
    parser.add_argument("--targets", default="direct,nginx,tierproxy,litellm")
    parser.add_argument("--no-paced", action="store_true")
    parser.add_argument("--wrk-timeout", type=float, default=10.0, help="wrk's --timeout, s")
    parser.add_argument("--modes", help='e.g. "stream burst,stream paced" (default: all rows)')
    parser.add_argument("--builtin-null", action="store_true", help="never nginx as the backend")
    parser.add_argument("--litellm", metavar="VENV", help="a venv with litellm[proxy] installed")
    parser.add_argument("--profile", action="store_true", help="py-spy the tierproxy process")
    parser.add_argument("--profile-top", type=int, default=25)
    parser.add_argument(
        "--tracing",
        metavar="RATIOS",
        help='also tierproxy with tracing on at these sample ratios, e.g. "0.01,1" (needs nginx:'
        " the spans go to it over OTLP/HTTP)",
    )
    parser.add_argument(
        "--port-offset",
        type=int,
        default=0,
        help="added to every port the run listens on (two runs on one machine at once)",
    )
    args = parser.parse_args()
    for name in PORTS:
        PORTS[name] += args.port_offset
    if not shutil.which("wrk"):
        sys.exit("needs wrk: apt-get install -y wrk (and nginx-light for the nginx rows)")
    run(args)


if __name__ == "__main__":
    main()
