"""A pytest plugin: no garbage collection while a test's report is made.

CPython 3.11.7 keeps the AST constructor's recursion count per interpreter (gh-106905, fixed
in 3.11.8): a finalizer that the GC runs while pytest parses a failing test's source to show it
(a destroyed asyncio task logs a traceback, and 3.11 parses its lines for the carets) parses
too and leaves the count off. pytest then raises ``SystemError: AST constructor recursion depth
mismatch``, xdist's worker dies, and the failure itself is never reported (seen in full runs).
"""

from __future__ import annotations

import gc
from collections.abc import Generator

import pytest


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    collecting = gc.isenabled()
    gc.disable()
    try:
        return (yield)
    finally:
        if collecting:
            gc.enable()
