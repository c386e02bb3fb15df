"""Random rank-8 LoRA adapters for the tiny model (``proxy.tools.tiny_model``), written directly as
PEFT's files (``adapter_config.json`` + ``adapter_model.safetensors``): no download, no ``peft``.

vLLM loads them with ``--enable-lora --max-lora-rank 8`` (``--lora-modules NAME=DIR`` or
``POST /v1/load_lora_adapter``). Both LoRA matrices are random (PEFT zeroes B, which would
leave the adapter equal to the base model): each adapter's tokens differ from the base's.
"""

from __future__ import annotations

import json
from pathlib import Path

from proxy.tools.tiny_model import HIDDEN_SIZE, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS

RANK = 8
ALPHA = 16
# The attention projections' (input, output) sizes in the tiny model.
_HEAD_DIM = HIDDEN_SIZE // NUM_HEADS
_MODULES = {
    "q_proj": (HIDDEN_SIZE, HIDDEN_SIZE),
    "k_proj": (HIDDEN_SIZE, NUM_KV_HEADS * _HEAD_DIM),
    "v_proj": (HIDDEN_SIZE, NUM_KV_HEADS * _HEAD_DIM),
    "o_proj": (HIDDEN_SIZE, HIDDEN_SIZE),
}
# Large enough that the adapter changes the greedy tokens of the random model.
_SCALE = 0.5
DEFAULT_NAMES = ("tiny-lora-a", "tiny-lora-b", "tiny-lora-c")
MARKER_FILE = ".tierproxy-tiny-adapter"
RECIPE = f"tiny adapter made by tierproxy: rank={RANK} modules={','.join(_MODULES)}\n"


def adapter_config(base_model: str) -> dict[str, object]:
    """PEFT's ``adapter_config.json`` as vLLM reads it."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": RANK,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(_MODULES),
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def make_tiny_adapter(out_dir: str | Path, base_model: str | Path, seed: int) -> Path:
    """One adapter in ``out_dir`` from ``seed`` (idempotent: a complete one is kept)."""
    out = Path(out_dir)
    marker = out / MARKER_FILE
    if marker.exists() and marker.read_text() == RECIPE + f"seed={seed}\n":
        return out
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(NUM_LAYERS):
        for module, (fan_in, fan_out) in _MODULES.items():
            key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(RANK, fan_in, generator=gen) * _SCALE
            b = torch.randn(fan_out, RANK, generator=gen) * _SCALE
            tensors[f"{key}.lora_A.weight"] = a.contiguous()
            tensors[f"{key}.lora_B.weight"] = b.contiguous()
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(adapter_config(str(base_model)), indent=2))
    marker.write_text(RECIPE + f"seed={seed}\n")
    return out


def make_tiny_adapters(
    out_dir: str | Path, base_model: str | Path, names: tuple[str, ...] = DEFAULT_NAMES
) -> dict[str, Path]:
    """One adapter per name under ``out_dir`` (``out_dir/NAME``), each from its own seed."""
    root = Path(out_dir)
    return {
        name: make_tiny_adapter(root / name, base_model, seed=1000 + i)
        for i, name in enumerate(names)
    }


# Where `tierproxy up` and the example config keep them (beside the tiny model).
TINY_ADAPTERS_DIR = Path(".tierproxy/tiny-adapters")
# vLLM's --max-lora-rank for engines that serve `adapters:` (`tierproxy up`): its default.
MAX_LORA_RANK = 16
# A CPU engine with LoRA on runs the tiny model in float32: a second guard against vLLM's CPU
# attention using AMX tiles without Linux's permission (a fresh engine's first small batch died of
# SIGILL, red team E1); the plugin now asks for it (proxy.vllm_plugin.cpu_tiles).
LORA_CPU_ARGS = ("--dtype", "float32")


def lora_engine_settings(
    max_loras: int | None, load_adapters: bool, has_adapters: bool
) -> tuple[tuple[str, ...], dict[str, str]]:
    """vLLM's arguments and environment for a backend of a config with `adapters:` (its
    `max_loras`; runtime loading when `load_adapters`); nothing for any other."""
    if max_loras is None or not has_adapters:
        return (), {}
    args = (
        *("--enable-lora", "--max-lora-rank", str(MAX_LORA_RANK), "--max-loras", str(max_loras)),
        *LORA_CPU_ARGS,
    )
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"} if load_adapters else {}
    return args, env


def ensure_tiny_adapters(paths: list[str], base_model: str | Path) -> None:
    """Writes the tiny adapters a config names under ``TINY_ADAPTERS_DIR`` (relative paths, as
    the example's) that are not there yet."""
    root = TINY_ADAPTERS_DIR.resolve()
    names = tuple(Path(p).name for p in paths if Path(p).resolve().parent == root and Path(p).name)
    if names:
        make_tiny_adapters(TINY_ADAPTERS_DIR, base_model, names)
