"""Make a tiny, deterministic LlamaForCausalLM that stock vLLM can serve on a CPU.

Random weights, a byte-level BPE tokenizer trained here on a built-in corpus and a chat
template: no network, a few seconds. Generated text is gibberish; lengths are steered with
``max_tokens`` and ``ignore_eos``.
"""

from __future__ import annotations

import json
from pathlib import Path

# CPU attention in vLLM supports head sizes 32, 64, 80, ... only: 128 hidden / 2 heads = 64.
HIDDEN_SIZE = 128
NUM_LAYERS = 2
NUM_HEADS = 2
NUM_KV_HEADS = 1
VOCAB_SIZE = 1024
# Long enough that a generation of a whole context holds a vLLM slot for many seconds even on a
# fast machine (tests and benchmarks need work that is still running when they probe it).
MAX_POSITIONS = 16384
SEED = 1234

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while tenants ask short questions and a batch "
    "job floods the queue with long documents to summarise; priority tiers keep interactive "
    "latency low. hello world what is the capital of france please summarise this page in one "
    "line, explain the result, count to ten, tell me a story about servers and queues. "
    "0 1 2 3 4 5 6 7 8 9 a b c d e f g h i j k l m n o p q r s t u v w x y z"
)

MARKER_FILE = ".tierproxy-tiny-model"
# Written into the marker: a model made by an older recipe is made again.
RECIPE = f"tiny model made by tierproxy: positions={MAX_POSITIONS} layers={NUM_LAYERS}\n"


def _corpus() -> list[str]:
    words = _CORPUS_WORDS.split()
    # Deterministic variety: rotations of the word list.
    return [" ".join(words[i:] + words[:i]) for i in range(len(words))]


def is_tiny_model(path: Path) -> bool:
    marker = path / MARKER_FILE
    return marker.exists() and marker.read_text() == RECIPE and (path / "config.json").exists()


def make_tiny_model(out_dir: str | Path) -> Path:
    """Write the model to ``out_dir`` (idempotent: an existing complete model is kept)."""
    out = Path(out_dir)
    if is_tiny_model(out):
        return out
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)

    special = ["<unk>", "<s>", "</s>", "<pad>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = MAX_POSITIONS
    fast.save_pretrained(out)

    torch.manual_seed(SEED)
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=4 * HIDDEN_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=False,
        dtype="float32",
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out, safe_serialization=True)
    # Some transformers versions omit generation_config's eos; vLLM reads it.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": fast.bos_token_id, "eos_token_id": fast.eos_token_id})
    )
    (out / MARKER_FILE).write_text(RECIPE)
    return out
