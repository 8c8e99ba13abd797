"""``pp-synth-gguf``: a llama-architecture GGUF of any shape with random weights.

    pp-synth-gguf /tmp/llama-1b.gguf --shape llama-3.2-1b      # 16 blocks, dim 2048: 3.0 GB in f16
    pp-synth-gguf /tmp/tiny.gguf --shape tiny                  # 4 blocks, dim 64: for tests
    pp-synth-gguf /tmp/llama-1b-q6k.gguf --like llama3.2:1b    # the default model's shape and types

Real weights do not travel where a benchmark runs (the llama-3.2-1B file is 2.5 GB; a device
call carries 64 MiB), but the speed of a forward pass depends on the shape, not the values. The
file has what tinygrad 0.12's ``Transformer.from_gguf`` and our ``Tokenizer`` read: the llama
hyperparameters, an output head of its own (unless ``--tied``), and a byte-level tokenizer with
Llama 3's chat tokens (every byte is a token, no merges), so that any text tokenizes and any id
decodes, and as many special tokens as Llama 3 has (256; the rest of the vocabulary is normal
tokens). The weights are N(0, 0.02) (norms 1), small enough that activations stay finite
through any depth.

``--quant Q6_K`` stores every matrix as ggml's Q6_K blocks, written as bytes: per row, a block of
256 weights in 210 bytes, ``ql[128]`` (the low 4 bits of each 6-bit q), ``qh[64]`` (the high 2
bits), ``scales[16]`` (int8, one per 16 weights) and ``d`` (float16), a weight being
``d * scale * (q - 32)``. The q are uniform in 0..63, the scales of either sign, and d is chosen
so that the weights have mean 0 and a spread of 0.02, as in f16. A row's length must be a
multiple of 256. ``--tied`` writes no ``output.weight``: tinygrad's ``from_gguf`` then uses
``token_embd.weight`` as the head, as Llama 3.2 does (with random weights a tied head mostly
echoes the input token; the compute is the same matrix product either way).

``--like llama3.2:1b`` stands in for the default model, bartowski's
``Llama-3.2-1B-Instruct-Q6_K.gguf``, so that tinygrad makes the kernels a run of that file makes
(the Q6_K dequantization as the file loads, the forward pass, the tied head): the llama-3.2-1b
shape with the context length of its config.json (131072), Q6_K, tied, ``general.file_type`` 18
(mostly Q6_K) and ``general.quantization_version`` 2, as llama.cpp's quantizer marks its files,
and ``rope_freqs.weight``, the 32 (head dim / 2) F32 factors of the config's RoPE scaling
(factor 32, low and high frequency factors 1 and 4, original context 8192) that llama.cpp's
converter writes for Llama 3 and tinygrad 0.12's ``llm.py`` does not use. The tensor types are
those that llama.cpp's quantizer gives a Q6_K file (``llama_tensor_get_type`` in its
``src/llama-quant.cpp``, read in a recent form, not in the release b3821 that the file's page
says made it): every 2-D weight Q6_K, ``token_embd.weight`` included (a tied embedding takes the
output head's type, Q6_K here), and the 1-D tensors (the norms, ``rope_freqs.weight``) not
quantized, F32 as the converter writes them. The page's sizes agree: its Q6_K file is 1.02 GB,
its Q6_K_L (the embedding and head Q8_0) 1.09 GB. That the real file has no tensor of another
type, and nothing that tinygrad reads with another value, is a guess from that code and those
sizes, not read from the file. Its tokenizer is not stood in for (tinygrad's tokenizer makes no kernels),
so the tensors lie at other offsets in the file than the real one's; the load of
``stage/model.py`` dequantizes each tensor from a buffer of its own, where the offset does not
reach the kernels.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from ..ggufinfo import RANDOM_WEIGHTS  # in every file's general.name: its text is noise by design

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


# ggml's block_q6_K: 256 weights in 210 bytes, ql[128], qh[64], scales[16] (int8), d (float16)
QK_K, Q6_K_BYTES = 256, 210
QUANTS = ("F16", "Q6_K")
# A Q6_K weight is d * scale * (q - 32), q uniform in 0..63. The scales are magnitudes 64..127
# of either sign (a real file's take both signs, the largest near 128), so that the weights'
# mean is 0; each block's d is Q6_K_D times 0.5..1.5, and Q6_K_D makes the weights' spread 0.02
_SCALES = np.arange(64, 128)
_D_SPREAD = 0.5 + np.arange(256) / 255
Q6_K_D = 0.02 / float(np.sqrt(np.mean((np.arange(64) - 32.0) ** 2) * np.mean(_SCALES**2.0) * np.mean(_D_SPREAD**2)))


def q6_k(rng: np.random.Generator, name: str, rows: int, cols: int) -> np.ndarray:
    """A ``rows x cols`` matrix of random weights as Q6_K blocks, each row's blocks in turn:
    ``uint8``, ``rows x (cols / 256 * 210)``. The q are random bytes in ql and qh as drawn; the
    scales and d are made from the random bytes in their places."""
    if cols % QK_K:
        raise ValueError(f"{name}: Q6_K stores rows of a multiple of {QK_K} weights, and its rows have {cols}")
    n = rows * cols // QK_K
    raw = rng.bit_generator.random_raw(-(-n * Q6_K_BYTES // 8))  # 64 random bits a call: fast
    blocks = raw.view(np.uint8)[: n * Q6_K_BYTES].reshape(n, Q6_K_BYTES)
    drawn = blocks[:, 192:208]
    magnitude = (drawn & 0x3F | 0x40).view(np.int8)
    blocks[:, 192:208] = np.where(drawn & 0x80, -magnitude, magnitude).view(np.uint8)
    blocks[:, 208:210] = (Q6_K_D * _D_SPREAD[blocks[:, 208]]).astype("<f2")[:, None].view(np.uint8)
    return blocks.reshape(rows, cols // QK_K * Q6_K_BYTES)


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3's RoPE scaling (a config.json's ``rope_scaling`` of type llama3)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_context: int

    def factors(self, head_dim: int, theta: float) -> np.ndarray:
        """``rope_freqs.weight`` as llama.cpp's converter computes it: a factor for each of the
        head_dim / 2 frequencies, 1 for the high ones, ``factor`` for the low ones, a blend of
        the two between."""
        out = []
        for i in range(0, head_dim, 2):
            wavelength = 2 * np.pi * theta ** (i / head_dim)
            if wavelength < self.original_context / self.high_freq_factor:
                out.append(1.0)
            elif wavelength > self.original_context / self.low_freq_factor:
                out.append(self.factor)
            else:
                ratio = self.original_context / wavelength
                smooth = (ratio - self.low_freq_factor) / (self.high_freq_factor - self.low_freq_factor)
                out.append(1 / ((1 - smooth) / self.factor + smooth))
        return np.array(out, dtype=np.float32)


@dataclass(frozen=True)
class Like:
    """A file's shape, matrix type, head and extra tensors; ``LIKE`` holds those of catalogue
    models (the module's docstring says whence)."""

    shape: Shape
    quant: str
    tied: bool
    rope_scaling: RopeScaling | None


LIKE = {
    "llama3.2:1b": Like(
        replace(SHAPES["llama-3.2-1b"], context=131072), "Q6_K", True, RopeScaling(32.0, 1.0, 4.0, 8192)
    ),
}


def parameters(shape: Shape, tied: bool) -> int:
    """The weights a file of ``shape`` holds: a tied head has none of its own."""
    return shape.parameters - (shape.vocab * shape.dim if tied else 0)


def write(
    path: Path,
    shape: Shape,
    seed: int = 0,
    quant: str = "F16",
    tied: bool = False,
    rope_scaling: RopeScaling | None = None,
) -> None:
    """The GGUF of ``shape`` with random weights from ``seed``: its matrices in ``quant`` (F16 or
    Q6_K), an output head of their own unless ``tied``, and ``rope_freqs.weight`` where
    ``rope_scaling`` is given. A matrix that Q6_K cannot hold raises ValueError, naming it,
    before anything is written."""
    import gguf  # only here: the rest of the package does not need it

    if quant not in QUANTS:
        raise ValueError(f"quant {quant!r} is not one of {', '.join(QUANTS)}")
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")  # opens no file until the header is written

    def weight(name: str, rows: int, cols: int) -> None:
        if quant == "F16":
            w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))
        else:  # a uint8 array's shape is taken as bytes a row, and gguf makes it the weights' shape
            w.add_tensor(name, q6_k(rng, name, rows, cols), raw_dtype=gguf.GGMLQuantizationType.Q6_K)

    def ones(name: str) -> None:
        w.add_tensor(name, np.ones(shape.dim, dtype=np.float32))

    tokens = byte_tokens() + CHAT_TOKENS
    tokens += [f"<|reserved_special_token_{i}|>" for i in range(shape.vocab - len(tokens))]
    # as in Llama 3, SPECIAL_TOKENS of them are special (control), the chat tokens among them; the
    # rest of the vocabulary is normal tokens, which no text of ours merges into
    special = min(SPECIAL_TOKENS, shape.vocab - 256)
    normal = int(gguf.TokenType.NORMAL)
    types = [normal] * 256 + [int(gguf.TokenType.CONTROL)] * special + [normal] * (shape.vocab - 256 - special)

    kind = "" if quant == "F16" else f" {quant}"
    w.add_name(f"synthetic llama {shape.blocks}x{shape.dim}{kind} ({RANDOM_WEIGHTS}, seed {seed})")
    if quant == "Q6_K":  # as llama.cpp's quantizer marks its files
        w.add_file_type(gguf.LlamaFileType.MOSTLY_Q6_K)
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
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

    if rope_scaling is not None:  # first, as llama.cpp's converter writes it
        w.add_tensor("rope_freqs.weight", rope_scaling.factors(shape.dim // shape.heads, shape.rope_theta))
    kv_dim = shape.dim // shape.heads * shape.kv_heads
    weight("token_embd.weight", shape.vocab, shape.dim)
    for i in range(shape.blocks):
        b = f"blk.{i}."
        ones(b + "attn_norm.weight")
        weight(b + "attn_q.weight", shape.dim, shape.dim)
        weight(b + "attn_k.weight", kv_dim, shape.dim)
        weight(b + "attn_v.weight", kv_dim, shape.dim)
        weight(b + "attn_output.weight", shape.dim, shape.dim)
        ones(b + "ffn_norm.weight")
        weight(b + "ffn_gate.weight", shape.ffn, shape.dim)
        weight(b + "ffn_up.weight", shape.ffn, shape.dim)
        weight(b + "ffn_down.weight", shape.dim, shape.ffn)
    ones("output_norm.weight")
    if not tied:  # tinygrad's from_gguf makes token_embd.weight the head of a file without one
        weight("output.weight", shape.vocab, shape.dim)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="pp-synth-gguf", description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the .gguf file to write")
    p.add_argument("--shape", choices=sorted(SHAPES), help="a named shape (default llama-3.2-1b)")
    for name in ("blocks", "dim", "heads", "kv_heads", "ffn", "vocab", "context"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"override the shape's {name}")
    p.add_argument("--quant", choices=QUANTS, help="the matrices' type (default F16)")
    p.add_argument("--tied", action="store_true", help="no output.weight: the head is token_embd.weight")
    p.add_argument(
        "--like",
        choices=sorted(LIKE),
        help="a catalogue model's shape, types and extra tensors (with --blocks, ... overriding its shape)",
    )
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.like is not None:
        if args.shape is not None or args.quant is not None or args.tied:
            p.error("--like names the shape, the type and the head: not with --shape, --quant or --tied")
        like = LIKE[args.like]
    else:
        like = Like(SHAPES[args.shape or "llama-3.2-1b"], args.quant or "F16", args.tied, None)
    changes = {k: v for k, v in vars(args).items() if k in asdict(like.shape) and v is not None}
    try:
        shape = replace(like.shape, **changes)
    except ValueError as e:
        p.error(str(e))
    if args.out.suffix != ".gguf":
        p.error(f"the output must be a .gguf file, got {str(args.out)!r}")
    try:
        write(args.out, shape, args.seed, like.quant, like.tied, like.rope_scaling)
    except ValueError as e:
        p.error(str(e))
    size = args.out.stat().st_size
    n = parameters(shape, like.tied)
    print(f"{args.out}: {n / 1e6:.1f} M parameters, {size / 1e6:.1f} MB", file=sys.stderr)


if __name__ == "__main__":
    main()
