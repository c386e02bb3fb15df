"""Linux's permission for AMX tiles, asked for in every vLLM process.

Linux hands a process the AMX tile state only after it asks (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``); an AMX instruction before that is a SIGILL. oneDNN asks when it first
picks AMX for a matmul, but vLLM 0.32's CPU attention (``cpu_attention_with_kv_cache``) uses the
tiles in bfloat16 without asking: on a CPU with AMX, a fresh engine whose first batch is too small
for oneDNN to choose AMX (a two-token prompt) lost its worker to a SIGILL, and every later
request got a 500. Asking changes no computation; where the CPU or kernel has no AMX it fails
harmlessly.
"""

from __future__ import annotations

import ctypes
import platform
import sys

ARCH_GET_XCOMP_PERM = 0x1022
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18
SYS_ARCH_PRCTL = 158  # x86_64


def _on_linux_x86_64() -> bool:
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")


def allow_amx_tiles() -> bool:
    """Asks for the tile permission; True when this process holds it afterwards."""
    if not _on_linux_x86_64():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return amx_tiles_allowed()


def amx_tiles_allowed() -> bool:
    """Whether this process may use AMX tiles now."""
    if not _on_linux_x86_64():
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_uint64(0)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_GET_XCOMP_PERM, ctypes.byref(features)) != 0:
        return False
    return bool(features.value & (1 << XFEATURE_XTILEDATA))
