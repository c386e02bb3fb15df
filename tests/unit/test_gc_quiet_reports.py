"""A failing test whose report pytest must still print on CPython 3.11.7, although finalizers
that parse source run during the report (tests/helpers/gc_quiet_reports.py)."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.paths import REPO

# Cyclic garbage whose finalizers call ast.parse, collected often, and a failure in a long
# module: pytest parses that module to show the failing line while the GC runs finalizers.
FAILING = """
import ast, gc

class Bomb:
    def __del__(self):
        def deep(n):
            return deep(n - 1) if n else ast.parse("x = 1")
        deep(30)

def test_fails():
    gc.set_threshold(20)
    for _ in range(2000):
        bomb = Bomb()
        bomb.cycle = bomb
    assert 1 == 2, "the failure pytest must report"
""" + "\n".join(f"v{i} = [{i}, ({i}, {i})]" for i in range(20000))


def _run(tmp_path: Path, *plugin: str) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_bomb.py").write_text(FAILING)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *plugin]
    return subprocess.run(
        [*command, "test_bomb.py"],
        cwd=tmp_path,
        # No installed plugin: whether the GC runs a finalizer mid-parse hangs on what else is
        # loaded (coverage 7.18 under pytest-cov hid the crash that 7.17 showed).
        env={
            "PYTHONPATH": str(REPO),
            "PATH": sysconfig.get_path("scripts"),
            "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        },
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_failure_is_reported_whatever_the_finalizers_parse(tmp_path: Path) -> None:
    run = _run(tmp_path, "-p", "tests.helpers.gc_quiet_reports")
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    assert "the failure pytest must report" in run.stdout
    assert "INTERNALERROR" not in run.stdout + run.stderr


@pytest.mark.skipif(sys.version_info >= (3, 11, 8), reason="the bug is fixed in CPython 3.11.8")
def test_without_the_plugin_this_python_loses_the_failure(tmp_path: Path) -> None:
    """The plugin's reason to be: this interpreter, left alone, crashes on that report."""
    run = _run(tmp_path)
    assert "AST constructor recursion depth mismatch" in run.stdout + run.stderr
