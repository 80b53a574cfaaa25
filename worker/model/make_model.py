"""Write a random-initialised Hugging Face checkpoint (config, safetensors, BPE tokenizer) from a preset.

No model hub is reachable here, so every test, benchmark and demo runs on checkpoints made by this
module. They are laid out exactly like real ones (HF parameter names, sharding with an index,
`tokenizer.json`), so they exercise the same loading path and `transformers` can load them as a
reference. Weights are drawn with a spread large enough that greedy decoding produces varied
tokens (HF's std-0.02 init makes every prompt decode to one repeated token, which hides bugs).
Everything is deterministic per seed.

For GPU checks a checkpoint must be made in seconds, not minutes: weights can be drawn on the GPU
(`device="cuda"`), the layer count can be cut while every layer keeps the preset's exact shapes
(`num_layers`), and the tokenizer can be built without training (`tokenizer="synthetic"`).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm

from chariot.contracts.errors import ConfigError
from chariot.kernels import AttentionMetadata
from chariot.worker.config import DTYPES, to_torch_dtype
from chariot.worker.model.llama import LlamaStage, allocate_kv_caches

DEFAULT_MAX_SHARD_BYTES = 100 * 1024 * 1024
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>")
BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = SPECIAL_TOKENS[:3]
CHAT_FORMAT = {"message": "<|{role}|>\n{content}\n", "generation_prompt": "<|assistant|>\n"}
CHAT_TEMPLATE_JINJA = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LOGIT_STD = 4.0  # target spread of the random model's logits
TOKENIZER_KINDS = ("trained", "synthetic")


@dataclass(frozen=True)
class Preset:
    """The shape of a generated model."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    dtype: str
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


PRESETS: dict[str, Preset] = {
    "tiny": Preset(64, 2, 4, 2, 128, 512, "float32", 2048),
    "small": Preset(256, 4, 8, 2, 688, 2048, "float32", 4096),
    "100m": Preset(1024, 8, 16, 4, 2816, 8192, "bfloat16", 8192, rope_theta=500000.0),
    # Llama-3-8B's shape (16 GB of bf16 weights): GPU benchmarks without downloading a checkpoint.
    "llama3-8b": Preset(4096, 32, 32, 8, 14336, 128256, "bfloat16", 8192, rope_theta=500000.0),
}
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
}


def make_model(
    out_dir: str | Path,
    preset: str,
    seed: int = 0,
    arch: str = "llama",
    max_shard_bytes: int | None = None,
    dtype: str | None = None,
    *,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
    progress: bool = True,
    num_layers: int | None = None,
    device: str = "cpu",
    tokenizer: str = "trained",
    weights: bool = True,
) -> Path:
    """Write the checkpoint into `out_dir` (created if needed) and return its path.

    `tie_word_embeddings=None` ties for qwen2 only; `rope_scaling` is written verbatim (e.g. a
    llama3 dict); shards are split at `max_shard_bytes` (default 100 MiB) with an index file.
    `num_layers` overrides the preset's layer count (same layer shapes); `device` is where the
    weights are drawn (other values than on the CPU for the same seed); `tokenizer` is "trained"
    (BPE trained on a synthetic corpus) or "synthetic" (`synthetic_tokenizer`: no training).
    `weights=False` writes the config and tokenizer files only (what a router reads: the same files as
    with weights, for the same seed).
    """
    if tokenizer not in TOKENIZER_KINDS:
        raise ConfigError("tokenizer", f"must be one of {', '.join(TOKENIZER_KINDS)}, got {tokenizer!r}")
    config = build_config(preset, arch, dtype, tie_word_embeddings, rope_scaling)
    if num_layers is not None:
        _set_num_layers(config, num_layers)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", _generation_config(config))
    make_tokenizer = train_tokenizer if tokenizer == "trained" else synthetic_tokenizer
    make_tokenizer(config["vocab_size"], seed).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(config))
    if not weights:
        return out
    tensors = random_weights(config, seed, progress, device)
    save_sharded(out, tensors, max_shard_bytes or DEFAULT_MAX_SHARD_BYTES, progress)
    return out


def build_config(
    preset: str,
    arch: str = "llama",
    dtype: str | None = None,
    tie_word_embeddings: bool | None = None,
    rope_scaling: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The HF-compatible `config.json` content for a preset and architecture."""
    if preset not in PRESETS:
        raise ConfigError("preset", f"must be one of {', '.join(PRESETS)}, got {preset!r}")
    if arch not in ARCHITECTURES:
        raise ConfigError("arch", f"must be one of {', '.join(ARCHITECTURES)}, got {arch!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError("dtype", f"must be one of {', '.join(DTYPES)}, got {dtype!r}")
    p = PRESETS[preset]
    architecture, model_type = ARCHITECTURES[arch]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "num_hidden_layers": p.num_layers,
        "head_dim": p.hidden_size // p.num_heads,
        "vocab_size": p.vocab_size,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": p.max_position_embeddings,
        "tie_word_embeddings": arch == "qwen2" if tie_word_embeddings is None else tie_word_embeddings,
        "torch_dtype": dtype or p.dtype,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "bos_token_id": SPECIAL_TOKENS.index(BOS_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "use_cache": True,
    }
    config.update(_arch_fields(arch, p))
    return config


def _set_num_layers(config: dict[str, Any], num_layers: int) -> None:
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ConfigError("num_layers", f"must be a positive integer, got {num_layers!r}")
    config["num_hidden_layers"] = num_layers
    if "max_window_layers" in config:
        config["max_window_layers"] = num_layers


def _arch_fields(arch: str, p: Preset) -> dict[str, Any]:
    if arch == "llama":
        return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    if arch == "mistral":
        return {"sliding_window": None}
    return {"use_sliding_window": False, "sliding_window": None, "max_window_layers": p.num_layers}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
    }


def _tokenizer_config(config: dict[str, Any]) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE_JINJA,
        "chariot_chat_format": CHAT_FORMAT,
    }


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


# --- weights -----------------------------------------------------------------------------------


def weight_shapes(config: dict[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Every checkpoint tensor's HF name and shape, in a fixed order."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", (vocab, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield from ((p + f"self_attn.{n}_proj.weight", (out, h)) for n, out in (("q", q), ("k", kv), ("v", kv)))
        if config["model_type"] == "qwen2":
            yield from ((p + f"self_attn.{n}_proj.bias", (out,)) for n, out in (("q", q), ("k", kv), ("v", kv)))
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (inter, h)
        yield p + "mlp.up_proj.weight", (inter, h)
        yield p + "mlp.down_proj.weight", (h, inter)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not config["tie_word_embeddings"]:
        yield "lm_head.weight", (vocab, h)


def _init_std(name: str, shape: tuple[int, ...], config: dict[str, Any]) -> tuple[float, float]:
    """(mean, std) of a tensor's normal init: unit-variance activations, logits of std ~LOGIT_STD."""
    hidden = config["hidden_size"]
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return 1.0, 0.1
    if name.endswith(".bias"):
        return 0.0, 0.2
    if name == "lm_head.weight" or (name == "model.embed_tokens.weight" and config["tie_word_embeddings"]):
        return 0.0, LOGIT_STD / math.sqrt(hidden)
    if name == "model.embed_tokens.weight":
        return 0.0, 1.0
    return 0.0, 1.0 / math.sqrt(shape[1])


def random_weights(config: dict[str, Any], seed: int, progress: bool = True,
                   device: str = "cpu") -> dict[str, torch.Tensor]:
    """Deterministic random tensors (on the CPU) for every checkpoint name, in the config's dtype,
    drawn on `device`: a GPU draws Llama-3-8B's 16 GB in a second, the CPU takes minutes."""
    gen = torch.Generator(device=device).manual_seed(seed)
    dtype = to_torch_dtype(config["torch_dtype"])
    shapes = list(weight_shapes(config))
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in tqdm(shapes, desc="Generating weights", unit="tensor", file=sys.stderr, disable=not progress):
        mean, std = _init_std(name, shape, config)
        drawn = torch.randn(shape, generator=gen, device=device) * std + mean
        tensors[name] = drawn.to(dtype).cpu()
    return tensors


def save_sharded(out: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int, progress: bool = True) -> None:
    """One `model.safetensors`, or numbered shards plus `model.safetensors.index.json` if too big."""
    shards = _group_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save(tensors, out / "model.safetensors")
        return
    weight_map: dict[str, str] = {}
    bar = tqdm(shards, desc="Writing shards", unit="shard", file=sys.stderr, disable=not progress)
    for i, names in enumerate(bar, start=1):
        filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        _save({n: tensors[n] for n in names}, out / filename)
        weight_map.update(dict.fromkeys(names, filename))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    _write_json(out / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # safetensors creates files 0600; other users (e.g. a pod's uid) must read them


def _group_shards(tensors: dict[str, torch.Tensor], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split in name order; a tensor larger than the limit gets a shard of its own."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


# --- tokenizer ---------------------------------------------------------------------------------

_COMMON_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from or had
by hot word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only round man
year came show every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near build self
earth father head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story saw far
sea draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole
king space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat common
gold possible plane dry wonder laugh thousand ago ran check game shape miss brought heat snow tire bring
yes distant fill east paint language among model token server request cache stage layer batch
café naïve über señor 世界 你好 こんにちは Ωmega 😀
"""
_ONSETS_TEXT = "b c d f g h j k l m n p r s t v w z br ch cl dr fl gr pl pr sh st th tr"
_CODAS_TEXT = "n r s t l m nd st ng ck x"
COMMON_WORDS = _COMMON_TEXT.split()
ONSETS = ("", *_ONSETS_TEXT.split())
VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "ee", "oo", "ou", "y")
CODAS = ("", "", *_CODAS_TEXT.split())
ENDINGS = (".", ".", ".", "?", "!", ":", ";")


def synthetic_corpus(vocab_size: int, seed: int) -> list[str]:
    """Deterministic English-like sentences: common words plus syllable pseudo-words, Zipf-distributed.

    The number of pseudo-words and sentences grows with the vocabulary so BPE finds enough merges.
    """
    rng = random.Random(seed)
    size = max(2 * vocab_size, 1000)
    pseudo = sorted({_pseudo_word(rng) for _ in range(size)})
    rng.shuffle(pseudo)
    lexicon = COMMON_WORDS + pseudo
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) for rank in range(len(lexicon))))
    return [_sentence(rng, lexicon, cum_weights) for _ in range(4 * size)]


def _pseudo_word(rng: random.Random) -> str:
    syllables = rng.randint(1, 3)
    return "".join(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) for _ in range(syllables))


def _sentence(rng: random.Random, lexicon: list[str], cum_weights: list[float]) -> str:
    words = rng.choices(lexicon, cum_weights=cum_weights, k=rng.randint(4, 14))
    words[0] = words[0].capitalize()
    if rng.random() < 0.3:
        words.insert(rng.randint(1, len(words)), str(rng.randint(0, 2024)))
    text = " ".join(w + ("," if rng.random() < 0.08 else "") for w in words)
    return text + rng.choice(ENDINGS)


def train_tokenizer(vocab_size: int, seed: int = 0) -> HFTokenizer:
    """A byte-level BPE with exactly `vocab_size` tokens (special tokens included), adding BOS on encode."""
    tokenizer = _byte_level(HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = synthetic_corpus(vocab_size, seed)
    tokenizer.train_from_iterator(corpus, trainer, length=len(corpus))
    return _with_bos(tokenizer, vocab_size)


def synthetic_tokenizer(vocab_size: int, seed: int = 0) -> HFTokenizer:
    """A byte-level BPE with exactly `vocab_size` tokens, built in a second without training: after the
    special tokens and the 256 byte symbols come every two-symbol merge, then three-symbol ones, in
    a fixed order (`seed` is unused: the result is always the same). Its text is as meaningless as the
    random weights; it is for checkpoints whose vocabulary would take minutes to train (Llama-3's)."""
    del seed
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    base = [*SPECIAL_TOKENS, *alphabet]
    if vocab_size < len(base):
        raise ConfigError("vocab_size", f"a byte-level tokenizer needs at least {len(base)} tokens, got {vocab_size}")
    merges = list(itertools.islice(_synthetic_merges(alphabet), vocab_size - len(base)))
    vocab = {token: i for i, token in enumerate([*base, *(left + right for left, right in merges)])}
    tokenizer = _byte_level(HFTokenizer(models.BPE(vocab=vocab, merges=merges)))
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return _with_bos(tokenizer, vocab_size)


def _synthetic_merges(alphabet: list[str]) -> Iterator[tuple[str, str]]:
    pairs = [(a, b) for a in alphabet for b in alphabet]
    yield from pairs
    yield from ((a + b, c) for a, b in pairs for c in alphabet)


def _byte_level(tokenizer: HFTokenizer) -> HFTokenizer:
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _with_bos(tokenizer: HFTokenizer, vocab_size: int) -> HFTokenizer:
    """Add BOS on encode; check the vocabulary has exactly `vocab_size` tokens."""
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A", pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B", special_tokens=[(BOS_TOKEN, bos_id)]
    )
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the BPE has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


# --- smoke check -------------------------------------------------------------------------------


@torch.inference_mode()
def greedy_generate(stage: LlamaStage, prompt_ids: list[int], max_new_tokens: int, block_size: int = 16) -> list[int]:
    """Greedy-decode one sequence with a whole-model stage (prefill, then one token per step).

    A minimal loop for checking that a generated checkpoint decodes to varied text; the engine's
    executor is the real batched path.
    """
    if not (stage.is_first and stage.is_last):
        raise ValueError("greedy_generate needs a stage holding the whole model")
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // block_size)
    dtype = next(stage.parameters()).dtype
    caches = allocate_kv_caches(stage.config, len(stage.layers), num_blocks, block_size, dtype)
    block_table = torch.arange(num_blocks, dtype=torch.int32)
    tokens, out = list(prompt_ids), []
    start = 0
    for _ in range(max_new_tokens):
        meta = _single_sequence_meta(block_table, start, len(tokens) - start, block_size)
        positions = torch.arange(start, len(tokens))
        hidden = stage(positions, caches, meta, input_ids=torch.tensor(tokens[start:]))
        next_id = int(stage.compute_logits(hidden[-1:]).argmax(dim=-1))
        start = len(tokens)
        tokens.append(next_id)
        out.append(next_id)
    return out


def _single_sequence_meta(block_table: torch.Tensor, start: int, num_tokens: int, block_size: int) -> AttentionMetadata:
    positions = torch.arange(start, start + num_tokens)
    slots = block_table[positions // block_size].long() * block_size + positions % block_size
    seq_len = start + num_tokens
    return AttentionMetadata(
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32),
        block_tables=block_table.view(1, -1),
        slot_mapping=slots,
        query_lens=(num_tokens,),
        seq_lens_list=(seq_len,),
        num_decodes=1 if num_tokens == 1 else 0,
    )
