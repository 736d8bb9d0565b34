"""A tiny randomly initialised Llama plus a byte-level BPE tokenizer, built locally for engine tests.

``build_tiny_model(directory)`` writes a Hugging Face model directory that vLLM (CPU or GPU),
``transformers.AutoTokenizer`` and ``tokenizers.Tokenizer.from_file`` all load. Nothing is
downloaded: the tokenizer is trained on deterministic text generated here. The weights are random
(fixed seed), so the model's output is gibberish, but it is a real transformer with a real KV cache.

Shape: hidden 128, 4 heads (head_dim 32, the smallest the vLLM CPU attention backend accepts),
2 layers, vocab 1024, context 16384 (RoPE: a long context costs no weights, and it lets one test
request hold an engine slot for many seconds on a fast machine). Building takes a few seconds; the
result is reused when the directory already holds a model with the same ``BUILD_VERSION``.

``shape="92m"`` builds the same model at a size where the engine's arithmetic, not its overhead,
sets the step time on a CPU (hidden 768, 12 heads, 12 layers, MLP 2304: ~94M parameters, ~375 MB
in float32): the model the benchmarks of the promise on a real engine use.

Depends only on torch, transformers and tokenizers.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
import warnings
from pathlib import Path

BUILD_VERSION = "sluice-tiny-llama-v3"
MARKER = ".sluice-tiny-model"

VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
NUM_HEADS = 4
NUM_LAYERS = 2
INTERMEDIATE_SIZE = 256
MAX_POSITIONS = 16384
SEED = 1234
# name → (hidden, heads, layers, MLP width)
SHAPES = {"tiny": (HIDDEN_SIZE, NUM_HEADS, NUM_LAYERS, INTERMEDIATE_SIZE), "92m": (768, 12, 12, 2304)}

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"
UNK = "<unk>"
SPECIAL_TOKENS = [PAD, BOS, EOS, UNK]  # ids 0, 1, 2, 3

# Renders role-tagged messages; generation prompts end with the assistant tag.
CHAT_TEMPLATE = (  # a hermes-family template: tools offered in <tools>, calls written in <tool_call>
    "{{ bos_token }}"
    "{% if tools %}<|system|>\nTools:{% for tool in tools %} {{ tool['function']['name'] }}{% endfor %}\n"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>\n{% endif %}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_WORDS = (
    "the a an queue job token batch model request worker tenant priority cache prefix engine "
    "stream cancel retry budget latency throughput admission reject accept window second minute "
    "small large fast slow river sluice gate water flow level high low open close read write "
    "and or but with from into over under between because while when if then else return "
    "alpha beta gamma delta one two three four five six seven eight nine ten hundred thousand "
    "red green blue yellow north south east west time space data value key list map set "
    "is are was were be been has have had do does did can could will would shall should may might"
).split()


def _corpus(lines: int = 4000) -> list[str]:
    """Deterministic English-ish text with digits and punctuation, so BPE learns common merges."""
    rng = random.Random(SEED)
    out = []
    punct = [".", ",", "!", "?", ";", ":"]
    for i in range(lines):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        sentence = " ".join(words).capitalize() + rng.choice(punct)
        if i % 7 == 0:
            sentence = f"<|user|>\n{sentence}\n<|assistant|>\n"
        out.append(sentence)
    return out


def _version(shape: str) -> str:
    return BUILD_VERSION if shape == "tiny" else f"{BUILD_VERSION}-{shape}"


def _is_complete(directory: Path, shape: str = "tiny") -> bool:
    marker = directory / MARKER
    needed = ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors")
    try:
        return marker.read_text().strip() == _version(shape) and all((directory / f).is_file() for f in needed)
    except OSError:
        return False


def _build_tokenizer(out: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    return tok


def _write_tokenizer_config(out: Path, tok) -> None:
    added = {
        str(tok.token_to_id(t)): {
            "content": t, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MAX_POSITIONS,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _build_model(out: Path, tok, shape: str) -> None:
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    vocab = tok.get_vocab_size()
    hidden, heads, layers, mlp = SHAPES[shape]
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        dtype="float32",
    )
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(SEED)
        model = LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id,
    )
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), safe_serialization=True)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def cached_model(cache: Path, shape: str = "tiny") -> Path:
    """The model of ``shape``, built once under ``cache`` (tiny-llama, llama-92m) and reused."""
    return build_tiny_model(Path(cache) / ("tiny-llama" if shape == "tiny" else f"llama-{shape}"), shape)


def build_tiny_model(directory: Path, shape: str = "tiny") -> Path:
    """Build (or reuse) the model of ``shape`` (a key of SHAPES) in ``directory``; its path.

    The model is built in a temporary sibling directory and renamed into place, so an interrupted
    build never leaves a half-written model behind. Safe to call from several processes at once:
    the loser of the rename race discards its copy and uses the winner's.
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; one of {', '.join(SHAPES)}")
    directory = Path(directory).resolve()
    if _is_complete(directory, shape):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.build-", dir=directory.parent))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # library deprecation chatter must not fail warning-strict tests
            tok = _build_tokenizer(tmp)
            _write_tokenizer_config(tmp, tok)
            _build_model(tmp, tok, shape)
        (tmp / MARKER).write_text(_version(shape) + "\n")
        for path in (tmp, *tmp.iterdir()):  # mkdtemp makes 0700; let other users (containers) read it
            path.chmod(0o755 if path.is_dir() else 0o644)
        if directory.exists() and not _is_complete(directory, shape):
            # a stale or foreign build: move it aside, then remove it
            stale = Path(tempfile.mkdtemp(prefix=f".{directory.name}.stale-", dir=directory.parent))
            os.replace(directory, stale / "old")
            shutil.rmtree(stale, ignore_errors=True)
        try:
            os.rename(tmp, directory)
        except OSError:
            if not _is_complete(directory, shape):  # someone else won only if their build is complete
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory


if __name__ == "__main__":
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--shape=")]
    shapes = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--shape=")]
    print(build_tiny_model(Path(args[0] if args else "tiny-llama"), shapes[0] if shapes else "tiny"))
