"""``pp-synth-gguf``: a llama-architecture GGUF of any shape with random weights.

    pp-synth-gguf /tmp/llama-1b.gguf --shape llama-3.2-1b      # 16 blocks, dim 2048: 2.5 GB in f16
    pp-synth-gguf /tmp/tiny.gguf --shape tiny                  # 4 blocks, dim 64: for tests

Real weights do not travel where a benchmark runs (the llama-3.2-1B file is 2.5 GB; a device
call carries 64 MiB), but the speed of a forward pass depends on the shape, not the values. The
file has what tinygrad 0.12's ``Transformer.from_gguf`` and our ``Tokenizer`` read: the llama
hyperparameters, an output head of its own, and a byte-level tokenizer with Llama 3's chat
tokens (every byte is a token, no merges), so that any text tokenizes and any id decodes, and as
many special tokens as Llama 3 has (256; the rest of the vocabulary is normal tokens). The
weights are N(0, 0.02) (norms 1), small enough that activations stay finite through any depth.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

RANDOM_WEIGHTS = "random weights"  # in every file's general.name: its text is noise by design
CHAT_TOKENS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
# Llama 3 has 256 special tokens (128000-128255) among 128256. tinygrad's tokenizer compiles one
# pattern of all the special tokens in each process that loads the model: 128000 of them (this
# file's vocabulary all special, as it once was) cost every worker 15 s that a real Llama 3 does
# not pay, and made "the rest" of every GPU load figure
SPECIAL_TOKENS = 256


@dataclass(frozen=True)
class Shape:
    blocks: int
    dim: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    context: int = 8192
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"dim {self.dim} must split into {self.heads} heads, in groups of {self.kv_heads}")
        if (self.dim // self.heads) % 2:
            raise ValueError(f"head dim {self.dim // self.heads} must be even (RoPE)")
        if self.vocab < 256 + len(CHAT_TOKENS):
            raise ValueError(f"vocab {self.vocab} must hold the 256 bytes and {len(CHAT_TOKENS)} chat tokens")

    @property
    def parameters(self) -> int:
        head = self.dim // self.heads
        attn = self.dim * self.dim * 2 + self.dim * head * self.kv_heads * 2
        return 2 * self.vocab * self.dim + self.blocks * (attn + 3 * self.dim * self.ffn + 2 * self.dim) + self.dim


SHAPES = {
    # meta-llama/Llama-3.2-1B: its config.json
    "llama-3.2-1b": Shape(blocks=16, dim=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256),
    "tiny": Shape(blocks=4, dim=64, heads=4, kv_heads=2, ffn=128, vocab=512, context=1024),
}


def byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode table: the string that stands for each byte in a BPE vocabulary."""
    bs = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    table = {b: chr(b) for b in bs} | {b: chr(next(extra)) for b in range(256) if b not in bs}
    return [table[b] for b in range(256)]


def write(path: Path, shape: Shape, seed: int = 0) -> None:
    import gguf  # only here: the rest of the package does not need it

    rng = np.random.default_rng(seed)

    def weight(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims, dtype=np.float32) * 0.02).astype(np.float16)

    tokens = byte_tokens() + CHAT_TOKENS
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(shape.vocab - len(tokens))]
    # as in Llama 3, SPECIAL_TOKENS of them are special (control), the chat tokens among them; the
    # rest of the vocabulary is normal tokens, which no text of ours merges into
    special = min(SPECIAL_TOKENS, shape.vocab - 256)
    normal = int(gguf.TokenType.NORMAL)
    types = [normal] * 256 + [int(gguf.TokenType.CONTROL)] * special + [normal] * (shape.vocab - 256 - special)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name(f"synthetic llama {shape.blocks}x{shape.dim} ({RANDOM_WEIGHTS}, seed {seed})")
    w.add_block_count(shape.blocks)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_dimension_count(shape.dim // shape.heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_bos_token_id(256)  # <|begin_of_text|>
    w.add_eos_token_id(256 + CHAT_TOKENS.index("<|eot_id|>"))

    kv_dim = shape.dim // shape.heads * shape.kv_heads
    w.add_tensor("token_embd.weight", weight(shape.vocab, shape.dim))
    for i in range(shape.blocks):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", np.ones(shape.dim, dtype=np.float32))
        w.add_tensor(b + "attn_q.weight", weight(shape.dim, shape.dim))
        w.add_tensor(b + "attn_k.weight", weight(kv_dim, shape.dim))
        w.add_tensor(b + "attn_v.weight", weight(kv_dim, shape.dim))
        w.add_tensor(b + "attn_output.weight", weight(shape.dim, shape.dim))
        w.add_tensor(b + "ffn_norm.weight", np.ones(shape.dim, dtype=np.float32))
        w.add_tensor(b + "ffn_gate.weight", weight(shape.ffn, shape.dim))
        w.add_tensor(b + "ffn_up.weight", weight(shape.ffn, shape.dim))
        w.add_tensor(b + "ffn_down.weight", weight(shape.dim, shape.ffn))
    w.add_tensor("output_norm.weight", np.ones(shape.dim, dtype=np.float32))
    # untied, unlike Llama 3.2: with random weights a tied head mostly echoes the input token;
    # the compute is the same matrix product either way
    w.add_tensor("output.weight", weight(shape.vocab, shape.dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pp-synth-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES), help="a named shape")
    for name in ("blocks", "dim", "heads", "kv_heads", "ffn", "vocab", "context"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override the shape's {name}")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    changes = {k: v for k, v in vars(args).items() if k in asdict(SHAPES[args.shape]) and v is not None}
    try:
        shape = replace(SHAPES[args.shape], **changes)
    except ValueError as e:
        p.error(str(e))
    if args.out.suffix != ".gguf":
        p.error(f"the output must be a .gguf file, got {str(args.out)!r}")
    write(args.out, shape, args.seed)
    size = args.out.stat().st_size
    print(f"{args.out}: {shape.parameters / 1e6:.1f} M parameters, {size / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
