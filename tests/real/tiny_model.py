"""A tiny random Llama, its tokenizer and two LoRA adapters, built here with no model hub.

vLLM needs a model directory it can load: a `config.json`, safetensors weights and a
tokenizer with a chat template. Everything is made locally from fixed seeds (a word-level
tokenizer over a small vocabulary, a 2-layer Llama with head size 64, which vLLM's CPU
attention supports, and adapters `a` and `b` of rank 8 with random, non-zero weights so
they change the output). The result is cached in `root` under a key of this file's
content: a change here builds afresh, a rerun reuses it.

Run inside `.venv-real` (torch, transformers and peft are vLLM's dependencies there).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ADAPTERS", "LORA_RANK", "TinyModel", "build_tiny_model"]

ADAPTERS = ("a", "b")
LORA_RANK = 8

_WORDS = (
    "hello there how are you the a an of to in is it you that he was for on are with as "
    "I his they be at one have this from or had by hot word but what some we can out other "
    "were all there when up use your how said an each she which do their time if will way "
    "about many then them write would like so these her long make thing see him two has "
    "look more day could go come did number sound no most people my over know water than "
    "call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn cause "
    "much mean before move right boy old too same tell does set three want air well also "
    "play small end put home read hand port large spell add even land here must big high "
    "such follow act why ask men change went light kind off need house picture try us again "
    "animal point mother world near build self earth father head stand own page should "
    "country found answer school grow study still learn plant cover food sun four between "
    "state keep eye never last let thought city tree cross farm hard start might story saw "
    "far sea draw left late run while press close night real life few north"
).split()

_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


@dataclass(frozen=True)
class TinyModel:
    """Where the built model and its adapters are."""

    model: Path
    adapters: dict[str, Path]


def _key() -> str:
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def build_tiny_model(root: Path) -> TinyModel:
    """The tiny model under `root/<key>`, built if absent (atomically: a half-built
    directory from an interrupted run is never used)."""
    home = root / _key()
    built = TinyModel(
        model=home / "model", adapters={name: home / f"lora-{name}" for name in ADAPTERS}
    )
    if (home / "done").exists():
        return built
    partial = root / f"{_key()}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    _build(partial)
    (partial / "done").write_text("built\n")
    shutil.rmtree(home, ignore_errors=True)
    partial.rename(home)
    return built


def _build(home: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {word: i for i, word in enumerate(dict.fromkeys([*specials, *_WORDS, ":", "\n"]))}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(home / "model")
    tokenizer.save_pretrained(home / "model")
    generation = home / "model" / "generation_config.json"
    generation.write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    for seed, name in enumerate(ADAPTERS, start=1):
        torch.manual_seed(seed)
        lora = LoraConfig(
            r=LORA_RANK,
            lora_alpha=16,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,  # random B too: an adapter that changes the output
        )
        get_peft_model(LlamaForCausalLM(config), lora).save_pretrained(home / f"lora-{name}")
