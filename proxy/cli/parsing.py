"""What every command module shares: the subparsers' type and the pointer to the reference."""

from __future__ import annotations

import argparse
from typing import TypeAlias

# What add_subparsers returns (a string: the class is not subscriptable at run time).
Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

REFERENCE_POINTER = (
    "Every field, its type, default and meaning: docs/configuration.md"
    " (or `tierproxy config-reference`)"
)
