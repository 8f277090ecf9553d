"""Build a tiny random-weight Llama model plus a locally trained tokenizer.

No model hub is reachable from the machines this project runs on, so tests, the demo
and benchmarks use a model made here::

    python scripts/tiny_model.py DIR [--layers N --hidden H --heads A --kv-heads K
                                      --vocab V --seed S --intermediate I --max-pos P]

A test and benchmark tool, kept out of the ``connector`` package that vLLM imports.

The output directory is a normal Hugging Face checkpoint that vLLM loads like any other:
``config.json``, ``generation_config.json``, ``model.safetensors`` (bfloat16),
``tokenizer.json``, ``tokenizer_config.json`` (with a simple chat template),
``special_tokens_map.json`` and ``kvlens_tiny_model.json`` (the arguments it was built with).

The result is deterministic: the same arguments produce byte-identical weight and tokenizer
files. Weights are drawn from a seeded ``torch.Generator`` (not from transformers' own
initialisation, which changes between versions), and the byte-level BPE tokenizer is trained on
the fixed English text embedded below, so ordinary English prompts split into many tokens
(roughly one token per 2-4 characters).

This module must stay cheap to import: transformers, tokenizers and torch are imported inside
the functions that need them, and vLLM is never imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# Head sizes accepted by vLLM's CPU attention backend
# (vllm/v1/attention/backends/cpu_attn.py: CPUAttentionBackend.get_supported_head_sizes).
CPU_ATTN_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

DEFAULTS = {
    "layers": 4,
    "hidden": 256,
    "heads": 4,
    "kv_heads": 2,
    "vocab": 2000,
    "seed": 0,
    "intermediate": 512,
    "max_pos": 4096,
}

BOS, EOS, UNK, PAD = "<s>", "</s>", "<unk>", "<pad>"
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD]  # ids 0, 1, 2, 3

# A deliberately simple chat template: one header line per message, BOS at the start.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Fixed English training text for the tokenizer (written for this project).
CORPUS = """\
The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a
single step. Every morning the small town woke up to the sound of the bakery opening its
doors, and the smell of fresh bread drifted along the narrow streets toward the river.

Large language models generate text one token at a time. For every new token the model
attends to all of the tokens that came before it, so it keeps the keys and values of earlier
tokens in a key-value cache. When many requests share the same long prefix, such as a system
prompt, a document or the history of a conversation, the cache for that prefix can be computed
once and reused. Reusing it saves time to first token and frees the processor for other work.

A cache is a place where a computer keeps a copy of data so that it can find it again quickly.
Memory is fast but small; disks are large but slow; a network store sits somewhere in between.
A good cache keeps the data that will be needed soon and evicts the data that will not. The
least recently used policy removes the entry that has gone untouched for the longest time.
Hit rate, miss rate, latency and throughput are the numbers that tell whether a cache works.

The weather this week will be mild, with clouds in the morning and sunshine in the afternoon.
There is a chance of rain on Thursday evening, and the wind will turn to the north by Friday.
Farmers hope for rain because the fields are dry, while the children hope for a warm weekend
at the lake, where they can swim, fish, build sand castles and watch the boats sail past.

History is the study of what people did, what they thought, and why things changed. Ancient
cities grew along rivers because water meant food, trade and travel. Writing began as a way to
count grain and cattle, and only later was it used to record laws, stories, letters and poems.
Libraries collected books so that knowledge would survive fires, wars and the passing of time.

Please answer the following question clearly and briefly. What is the capital of France? How
many days are there in a leap year? Why is the sky blue during the day and red at sunset? Which
planet is the largest in our solar system? Who wrote the play about a prince of Denmark? When
did people first travel to the moon, and how long did the journey take them?

You are a helpful assistant. You answer questions honestly, you explain your reasoning step by
step when it helps, and you say when you do not know something. You keep your answers short
unless the user asks for more detail. You never make up facts, names, numbers or quotations.

Software engineers measure before they optimise. They write tests that describe how the system
should behave, they run those tests on every change, and they read the logs and metrics when
something goes wrong. A dashboard shows counters, gauges and histograms over time, so that a
person can see at a glance whether the service is healthy and where the time is being spent.

One, two, three, four, five, six, seven, eight, nine, ten. Monday, Tuesday, Wednesday, Thursday,
Friday, Saturday and Sunday. January, February, March, April, May, June, July, August,
September, October, November and December. Red, orange, yellow, green, blue, indigo, violet.
North, south, east and west. Spring, summer, autumn and winter. Water, fire, earth and air.

The scientist looked through the microscope and saw thousands of tiny cells moving in the drop
of water. She wrote down what she observed, drew a careful picture, and repeated the experiment
the next day to be sure. Good science depends on measurements that other people can repeat,
on honest reports of what went wrong, and on questions that can be answered by evidence.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

{"name": "example", "values": [1, 2, 3], "enabled": true, "ratio": 0.75}
"""


def _corpus_lines() -> list[str]:
    lines = [line for line in CORPUS.splitlines() if line.strip()]
    # Repeat so that frequent merges clearly dominate rare ones (the trainer is count based).
    return lines * 4


def build_tokenizer(vocab_size: int):
    """Train a byte-level BPE tokenizer on CORPUS; returns a ``tokenizers.Tokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_lines(), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A",
                pair=f"{BOS} $A {BOS} $B",
                special_tokens=[(BOS, bos_id)],
            ),
        ]
    )
    return tok


def _weight_std(name: str) -> float:
    if name == "model.embed_tokens.weight":
        return 1.0
    if name == "lm_head.weight":
        return 0.2
    if name.endswith(("q_proj.weight", "k_proj.weight")):
        return 0.15
    return 0.05


def _byte_decoder() -> dict[str, int]:
    """GPT-2 byte-level mapping (printable unicode char -> byte), as used by ByteLevel."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


def silent_token_ids(tok) -> list[int]:
    """Ids the model must never emit: special tokens and single bytes that are not printable
    ASCII (control characters, lone UTF-8 bytes that decode to U+FFFD). Merged tokens come from
    the ASCII corpus, so with these silenced every generated text is printable ASCII."""
    decoder = _byte_decoder()
    ok = set(range(0x20, 0x7F)) | {0x0A}
    ids = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    for token, idx in tok.get_vocab().items():
        if len(token) == 1 and token in decoder and decoder[token] not in ok:
            ids.append(idx)
    return sorted(set(ids))


def build_model_tensors(config, seed: int, silent_ids=()):
    """Deterministic random weights for ``LlamaForCausalLM(config)``, as a float32 state dict.

    The standard deviations are chosen (not transformers' N(0, 0.02) everywhere) so that the
    random model behaves usefully for a KV-cache project:

    * embeddings ~ N(0, 1), so the current token matters and greedy output does not collapse
      into one repeated token;
    * q/k projections ~ N(0, 0.15), so attention is peaked rather than uniform: the output then
      depends on *which* cached keys/values are present, and a wrong or missing KV block
      changes greedy text (an early one-token change alters the argmax at ~20% of later
      positions);
    * other linear layers ~ N(0, 0.05) and the LM head ~ N(0, 0.2): logits spread with a
      median top-2 margin of ~0.65, so greedy decoding is rarely decided by rounding noise;
    * LM-head rows of ``silent_ids`` are zero (their logit is 0, far below the top logits):
      with :func:`silent_token_ids` the model never emits EOS, so generations always run to
      max_tokens, and never emits control characters or broken UTF-8;
    * norm weights are 1.
    """
    import torch
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, param in sorted(skeleton.state_dict().items()):
        if name.endswith("norm.weight") or "layernorm" in name:
            t = torch.ones(param.shape, dtype=torch.float32)
        else:
            t = torch.randn(param.shape, generator=gen, dtype=torch.float32) * _weight_std(name)
            if name == "lm_head.weight" and len(silent_ids):
                t[list(silent_ids)] = 0.0
        tensors[name] = t
    return tensors


def build(
    out_dir: str | os.PathLike,
    *,
    layers: int = DEFAULTS["layers"],
    hidden: int = DEFAULTS["hidden"],
    heads: int = DEFAULTS["heads"],
    kv_heads: int = DEFAULTS["kv_heads"],
    vocab: int = DEFAULTS["vocab"],
    seed: int = DEFAULTS["seed"],
    intermediate: int = DEFAULTS["intermediate"],
    max_pos: int = DEFAULTS["max_pos"],
) -> Path:
    """Write the model and tokenizer into ``out_dir``; returns the directory."""
    if hidden % heads:
        raise ValueError(f"--hidden {hidden} is not divisible by --heads {heads}")
    if heads % kv_heads:
        raise ValueError(f"--heads {heads} is not divisible by --kv-heads {kv_heads}")
    head_dim = hidden // heads
    if head_dim not in CPU_ATTN_HEAD_SIZES:
        raise ValueError(
            f"head_dim {head_dim} (= hidden / heads) is not supported by vLLM's CPU attention "
            f"backend; choose one of {CPU_ATTN_HEAD_SIZES}"
        )
    if vocab < 300:
        raise ValueError("--vocab must be at least 300 (256 byte tokens + specials + merges)")

    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    # --- tokenizer -------------------------------------------------------------------------
    tok = build_tokenizer(vocab)
    real_vocab = tok.get_vocab_size()  # may be below `vocab`: the corpus is small
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    tok.save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "unk_token": UNK,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_pos,
        "chat_template": CHAT_TEMPLATE,
    }
    special_map = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special_map)

    # --- model -----------------------------------------------------------------------------
    config = LlamaConfig(
        vocab_size=real_vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_pos,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    config.dtype = torch.bfloat16
    config.architectures = ["LlamaForCausalLM"]

    tensors = build_model_tensors(config, seed, silent_token_ids(tok))
    # Sanity check: the names we generate are exactly the ones the HF class expects.
    with torch.device("meta"):
        expected = set(LlamaForCausalLM(config).state_dict())
    assert expected == set(tensors), sorted(expected ^ set(tensors))
    bf16 = {k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()}
    # Written directly (not via save_pretrained) so the file is byte-identical for a given seed.
    save_file(bf16, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(out)
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(out)

    _write_json(
        out / "kvlens_tiny_model.json",
        {
            "layers": layers,
            "hidden": hidden,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "vocab_requested": vocab,
            "vocab": real_vocab,
            "seed": seed,
            "intermediate": intermediate,
            "max_pos": max_pos,
            "params": sum(t.numel() for t in tensors.values()),
        },
    )
    return out


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python scripts/tiny_model.py",
        description="Write a tiny random-weight Llama model + local tokenizer for vLLM.",
    )
    p.add_argument("dir", help="output directory (created if missing)")
    p.add_argument("--layers", type=int, default=DEFAULTS["layers"])
    p.add_argument("--hidden", type=int, default=DEFAULTS["hidden"])
    p.add_argument("--heads", type=int, default=DEFAULTS["heads"])
    p.add_argument("--kv-heads", type=int, default=DEFAULTS["kv_heads"])
    p.add_argument(
        "--vocab",
        type=int,
        default=DEFAULTS["vocab"],
        help="target vocabulary size (the trained tokenizer may be slightly smaller; "
        "the model uses the tokenizer's real size)",
    )
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--intermediate", type=int, default=DEFAULTS["intermediate"], help="MLP intermediate size")
    p.add_argument("--max-pos", type=int, default=DEFAULTS["max_pos"], help="max_position_embeddings")
    args = p.parse_args(argv)
    try:
        out = build(
            args.dir,
            layers=args.layers,
            hidden=args.hidden,
            heads=args.heads,
            kv_heads=args.kv_heads,
            vocab=args.vocab,
            seed=args.seed,
            intermediate=args.intermediate,
            max_pos=args.max_pos,
        )
    except ValueError as e:
        p.error(str(e))
    info = json.loads((out / "kvlens_tiny_model.json").read_text())
    size_mb = (out / "model.safetensors").stat().st_size / 1e6
    print(
        f"tiny model written to {out}: {info['layers']} layers, hidden {info['hidden']}, "
        f"{info['heads']} heads / {info['kv_heads']} kv heads, head_dim {info['head_dim']}, "
        f"vocab {info['vocab']}, {info['params'] / 1e6:.2f}M params, {size_mb:.1f} MB"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
