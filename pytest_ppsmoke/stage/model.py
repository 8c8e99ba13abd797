"""One pipeline stage of a llama-style model in tinygrad 0.12: loading, splitting, compiled decode.

    model, kv = load_model("smollm2:135m", max_context=1024)   # lazy: nothing realized yet
    stage = StageModel(model, kv, stage=0, num_stages=2)       # realizes only the blocks it owns
    hidden = stage.embed_and_forward(prompt_ids, position=0)    # (seq_len, dim) float32

Layer split (the spec's formula, generalised): ``k = total // num_stages``; stage i owns blocks
``[i*k, (i+1)*k)`` and the last stage owns up to ``total`` plus ``output_norm`` and ``output``.
Blocks a stage does not own are dropped before anything is realized, so they never take memory.

Decode (one token) runs through ``TinyJit`` with a symbolic start position, so each stage
compiles its kernels once; prefill and the spec's uncompiled path (``jit=False``) run eagerly.

The token-exact reference (``reference.py``: the worker's ``reference`` op, or a reference
worker of its own) is a model of its own, run through tinygrad's ``Transformer.generate``
(:func:`unsplit_generate`), never through :class:`StageModel`.
This module imports tinygrad: the node never imports it, only the worker process does.

What the stage holds is read from tinygrad's own objects (:meth:`StageModel.kv_info`): for every
block of the model, whether a block object exists here (unowned ones are held only weakly, so
they are gone unless something else keeps them), whether its weights are realized, its KV cache's
shape, the positions whose K rows are non-zero, and a digest of the prompt's positions right
after prefill and now. A call flagged ``prefill`` begins a sequence: the caches are zeroed first
(so non-zero rows are this sequence's), and the calls' writes are recorded from there on.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import os
import re
import time
import unicodedata
import weakref
from collections.abc import Callable, Iterator, MutableMapping
from pathlib import Path
from typing import Any

import numpy as np
from tinygrad import Device, Tensor, TinyJit, UOp, dtypes, nn
from tinygrad.apps.llm import SimpleTokenizer as _SimpleTokenizer
from tinygrad.apps.llm import Transformer

from ..messages import BlockCache, KvInfo, Span, WeightLoad, digest
from ..protocol import layer_range
from .cache import CacheError, Part, WeightCache, tinygrad_key
from .catalog import ModelError, resolve_model

_DTYPES = {np.dtype(np.int32).str: "int32", np.dtype(np.float32).str: "float32"}  # decode inputs
_TINY_DTYPES = {np.dtype(np.float16).str: dtypes.float16, np.dtype(np.float32).str: dtypes.float32}  # cached tensors

# GGUF pre-tokenizer names -> the SimpleTokenizer presets of tinygrad 0.12 (SmolLM2 says "smollm",
# which tinygrad rejects; it is ChatML, which the qwen2 preset formats).
_PRESETS = {"llama3": "llama3", "llama-v3": "llama-v3", "llama-bpe": "llama-bpe", "qwen2": "qwen2", "olmo": "olmo"}
_PRESETS_CHATML = {"smollm"}


@contextlib.contextmanager
def _no_initial_weights() -> Iterator[None]:
    """Build tinygrad's layers without their random initial weights. ``nn.Linear`` and
    ``nn.Embedding`` draw them with ``Tensor.uniform``, which runs the random generator's
    kernels; every one of those tensors is replaced by a weight from the file before anything
    uses it, and the pipeline samples greedily (no random number is ever drawn), so an empty
    tensor of the same shape and dtype stands in, and the draws never run."""
    saved = Tensor.uniform, Tensor.glorot_uniform

    def empty(*shape: Any, dtype: Any = None, device: Any = None, **_: Any) -> Tensor:
        return Tensor.empty(*shape, dtype=dtype, device=device)

    Tensor.uniform = Tensor.glorot_uniform = staticmethod(empty)
    try:
        yield
    finally:
        Tensor.uniform, Tensor.glorot_uniform = saved


# ggml's quantized types: (elements, bytes) per block, as tinygrad's ``ggml_data_to_tensor`` reads them
_GGML_BLOCKS = {2: (32, 18), 3: (32, 20), 8: (32, 34), 12: (256, 144), 14: (256, 210), 39: (32, 17)}
_GGML_ITEMSIZE = {0: 4, 1: 2, 16: 1, 17: 2, 18: 4}


@contextlib.contextmanager
def _tensors_in_buffers_of_their_own(disk: Tensor) -> Iterator[None]:
    """tinygrad's ``Transformer.from_gguf`` copies the whole file to the device and dequantizes
    each tensor from a slice of it, so every tensor's kernels carry its offset in the file: one
    program per tensor (SmolLM2: 138 of a stage's 159, generated and compiled on a fresh host).
    Here tinygrad's own ``gguf_load`` reads the file where it lies (``disk``), and each tensor's
    bytes are copied into a buffer of their own before tinygrad's own ``ggml_data_to_tensor``
    dequantizes them: tensors of one type and size share their programs (and schedules), and the
    values are the same bytes (``tests/test_stages.py``). A type this table does not know goes
    to tinygrad as it is."""
    state = nn.state
    load, to_tensor = state.gguf_load, state.ggml_data_to_tensor

    def own_buffer(t: Tensor, n: int, ggml_type: int) -> Tensor:
        if ggml_type in _GGML_ITEMSIZE:
            nbytes = _GGML_ITEMSIZE[ggml_type] * n
        elif ggml_type in _GGML_BLOCKS:
            elements, size = _GGML_BLOCKS[ggml_type]
            nbytes = n // elements * size
        else:
            return to_tensor(t.to(None), n, ggml_type)
        return to_tensor(t[:nbytes].to(None), n, ggml_type)

    state.gguf_load = lambda _copied: load(disk)
    state.ggml_data_to_tensor = own_buffer
    try:
        yield
    finally:
        state.gguf_load, state.ggml_data_to_tensor = load, to_tensor


def load_model(name: str, max_context: int) -> tuple[Transformer, dict[str, Any]]:
    """Parse the GGUF and build the model lazily (weights are realized by :class:`StageModel`)."""
    source = resolve_model(name)
    gguf = Tensor.from_url(source) if isinstance(source, str) else Tensor(source)
    try:
        with _no_initial_weights(), _tensors_in_buffers_of_their_own(gguf):
            model, kv = Transformer.from_gguf(gguf, max_context, realize=False)
    except Exception as e:  # tinygrad raises assorted errors on a broken file
        raise ModelError(f"model {name!r} ({source}) is not a loadable llama GGUF: {type(e).__name__}: {e}") from None
    arch = kv.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"model {name!r} has architecture {arch!r}; this pipeline splits llama-architecture models")
    return model, kv


def model_file(name: str) -> Path:
    """The model's GGUF on this machine (a model from the table is downloaded once, into
    tinygrad's download cache)."""
    source = resolve_model(name)
    if isinstance(source, Path):
        return source
    from tinygrad.helpers import fetch

    return Path(fetch(source))


def realized_model(
    name: str,
    max_context: int,
    stage: int,
    num_stages: int,
    cache: WeightCache | None,
    on_blocks: Callable[[int, int], None] | None = None,
) -> tuple[Transformer, dict[str, Any], WeightLoad]:
    """The model with the tensors of one stage's part realized (``num_stages=1``: all of them),
    the others left lazy; from the weight cache when it holds this split of this model file,
    else from the GGUF, writing the cache for the next load (another process loading the same
    part meanwhile waits for this one, then reads it). A cache file that cannot be used is
    ignored (and replaced); the reason is in the returned ``WeightLoad.note``. ``on_blocks``
    hears the blocks realized so far, of the part's: from the GGUF a block at a time (the part's
    other tensors with its first), from the cache all at once."""
    started = time.monotonic()
    notes: list[str] = []
    usable: WeightCache | None = None  # the cache, once this file's key in it is known
    if cache is not None:
        path = model_file(name)
        try:
            key = cache.key(cache.model_digest(path), stage, num_stages)
            usable = cache
        except (CacheError, OSError) as e:
            notes.append(f"weight cache not used: {e}")
    with usable.making(key, notes.append) if usable is not None else contextlib.nullcontext():
        found = None
        if usable is not None:
            try:
                found = usable.read(key)
            except (CacheError, OSError) as e:
                notes.append(f"weight cache not used: {e}")
        if found is not None:
            kv, part, tensors, at = found
            model = _model_from_tensors(name, kv, max_context, part, tensors, stage, num_stages)
            nbytes = sum(t.nbytes for t in tensors.values() if not isinstance(t, str))
            source, written = "cache", str(at)
            if on_blocks is not None:
                on_blocks(part.hi - part.lo, part.hi - part.lo)
        else:
            model, kv = load_model(name, max_context)
            part = Part.of_stage(stage, num_stages, len(model.blk))
            owned = {k: v for k, v in nn.state.get_state_dict(model).items() if part.owns(k)}
            _realize_by_block(owned, part, on_blocks)
            nbytes = sum(t.nbytes() for t in owned.values())
            source, written = "gguf", ""
            if usable is not None:
                host = _host_tensors(owned)
                try:
                    written = str(usable.write(key, kv, part, host))
                except OSError as e:
                    notes.append(f"weight cache not written: {e}")
                else:  # the objects a warm load builds: their graphs, schedules and programs are the same
                    model = _model_from_tensors(name, kv, max_context, part, host, stage, num_stages)
    took = time.monotonic() - started
    return model, kv, WeightLoad(source, took, nbytes, written, "; ".join(notes), *_dtype(model, part.lo))


def _realize_by_block(owned: dict[str, Tensor], part: Part, on_blocks: Callable[[int, int], None] | None) -> None:
    """Realize the part's tensors a block at a time (the tensors of no block with the first),
    telling ``on_blocks`` after each: the same values as one realize of them all."""
    by_block: dict[int, list[Tensor]] = {}
    for k, t in owned.items():
        m = re.match(r"blk\.(\d+)\.", k)
        by_block.setdefault(int(m.group(1)) if m else part.lo, []).append(t)
    total = part.hi - part.lo
    for done, block in enumerate(sorted(by_block), 1):
        Tensor.realize(*by_block[block])
        if on_blocks is not None:
            on_blocks(min(done, total), total)


_WEIGHT_DTYPES = {"half": "f16", "float": "f32", "bfloat16": "bf16"}


def _dtype(model: Transformer, block: int) -> tuple[str, int]:
    """The dtype of a block's weights (``block``: one the part owns), as the grid names it, and
    the HALF setting that made it (HALF=0 keeps the GGUF's: float32 for a quantized file)."""
    name = str(model.blk[min(block, len(model.blk) - 1)].attn_q.weight.dtype.name)
    return _WEIGHT_DTYPES.get(name, name), int(tinygrad_key()["half"])


def _host_tensors(owned: dict[str, Tensor]) -> dict[str, np.ndarray | str]:
    """Realized tensors as host arrays; a tensor sharing another's buffer (tied weights) by name."""
    out: dict[str, np.ndarray | str] = {}
    seen: dict[int, str] = {}
    for k, t in owned.items():
        buf = t.uop.base.realized
        if buf is not None and id(buf) in seen:
            out[k] = seen[id(buf)]
            continue
        if buf is not None:
            seen[id(buf)] = k
        out[k] = t.numpy()
    return out


def _model_from_tensors(
    name: str,
    kv: dict[str, Any],
    max_context: int,
    part: Part,
    tensors: dict[str, np.ndarray | str],
    stage: int,
    num_stages: int,
) -> Transformer:
    """The model's objects for ``part`` (built as ``Transformer.from_gguf`` builds them, with
    blocks outside the part never made) holding the cached tensors, realized by a raw copy."""
    arch = kv.get("general.architecture")
    if arch != "llama":
        raise ModelError(f"model {name!r} has architecture {arch!r}; this pipeline splits llama-architecture models")
    total = int(kv[f"{arch}.block_count"])
    if part != Part.of_stage(stage, num_stages, total):
        raise CacheError(f"it holds {part}, but stage {stage} of {num_stages} of this model owns another range")
    n_heads, n_kv_heads = kv[f"{arch}.attention.head_count"], kv[f"{arch}.attention.head_count_kv"]
    with _no_initial_weights():
        model = Transformer(
            num_blocks=part.hi - part.lo,
            dim=kv[f"{arch}.embedding_length"],
            hidden_dim=kv.get(f"{arch}.expert_feed_forward_length", kv[f"{arch}.feed_forward_length"]),
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            norm_eps=kv[f"{arch}.attention.layer_norm_rms_epsilon"],
            vocab_size=len(kv["tokenizer.ggml.tokens"]),
            head_dim=kv.get(f"{arch}.attention.key_length", kv[f"{arch}.embedding_length"] // n_heads),
            rope_theta=kv[f"{arch}.rope.freq_base"],
            max_context=min(max_context, kv[f"{arch}.context_length"]),
        )
    model.blk = [None] * part.lo + model.blk + [None] * (total - part.hi)
    wanted = {k: v for k, v in nn.state.get_state_dict(model).items() if part.owns(k)}
    if set(wanted) != set(tensors):
        missing, extra = sorted(set(wanted) - set(tensors)), sorted(set(tensors) - set(wanted))
        raise CacheError(f"its tensors differ from the model's: missing {missing[:3]}, unexpected {extra[:3]}")
    for k, param in wanted.items():
        arr = tensors[k]
        if isinstance(arr, str):
            if arr not in wanted or isinstance(tensors[arr], str):
                raise CacheError(f"tensor {k} shares {arr!r}, which it does not hold")
            continue
        if arr.dtype.str not in _TINY_DTYPES:
            raise CacheError(f"tensor {k} has dtype {arr.dtype}; expected float16 or float32")
        if tuple(arr.shape) != param.shape:
            raise CacheError(f"tensor {k} has shape {tuple(arr.shape)}, the model expects {param.shape}")
        t = Tensor.empty(*arr.shape, dtype=_TINY_DTYPES[arr.dtype.str])
        buf = t.uop.buffer
        buf.ensure_allocated()
        buf.copyin(np.ascontiguousarray(arr).data.cast("B"))
        param.replace(t)
    for k, param in wanted.items():
        alias = tensors[k]
        if isinstance(alias, str):
            param.replace(wanted[alias])
    return model


@functools.cache
def _category_classes() -> tuple[str, str, str]:
    """The Unicode categories Z, N and L (below U+323B0, as tinygrad's tokenizer takes them) as
    bodies of regex character classes, written as ranges: the same sets as tinygrad's
    ``ucat_range``, which lists every code point one by one, so a class of 140,000 members
    that takes ``re`` half a second to compile in every worker, instead of milliseconds."""
    runs: dict[str, list[list[int]]] = {"Z": [], "N": [], "L": []}
    for cp in range(0x323B0):
        group = runs.get(unicodedata.category(chr(cp))[0])
        if group is None:
            continue
        if group and group[-1][1] == cp - 1:
            group[-1][1] = cp
        else:
            group.append([cp, cp])

    def body(group: list[list[int]]) -> str:
        return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in group)

    return body(runs["Z"]), body(runs["N"]), body(runs["L"])


class _RangedTokenizer(_SimpleTokenizer):  # type: ignore[misc]
    """tinygrad's ``SimpleTokenizer``, whose constructor is repeated here with two changes: its
    word-splitting pattern is built from ranges (:func:`_category_classes`), and what only
    encoding needs (the tokens by their bytes, both patterns) is built at the first encode, not
    with the tokenizer: the last stage only decodes, and its worker's start no longer pays for
    them. The pattern matches exactly what tinygrad's does, so every text encodes to the same
    ids, and the tables are the same (tests compare both)."""

    def __init__(self, normal_tokens: dict[str, int], special_tokens: dict[str, int], preset: str = "llama3") -> None:
        if preset not in ("llama3", "llama-v3", "llama-bpe", "qwen2", "olmo"):
            raise ValueError(f"Invalid tokenizer preset '{preset}'")
        bs = [*range(33, 127), *range(161, 173), *range(174, 256)]  # bytes that map to themselves
        self._byte_decoder = {chr(b): b for b in bs} | {
            chr(256 + i): b for i, b in enumerate(b for b in range(256) if b not in bs)
        }
        self._normal, self._special_tokens, self.preset = normal_tokens, special_tokens, preset
        table = {ord(c): b for c, b in self._byte_decoder.items()}
        if re.search(f"[^{re.escape(''.join(self._byte_decoder))}]", "".join(normal_tokens)):
            normal = {tid: bytes(self._byte_decoder[c] for c in tok) for tok, tid in normal_tokens.items()}  # KeyError
        else:  # each character to its byte at C's speed: the same bytes
            normal = {tid: tok.translate(table).encode("latin-1") for tok, tid in normal_tokens.items()}
        self._tok2bytes = normal | {tid: tok.encode() for tok, tid in special_tokens.items()}

    @functools.cached_property
    def _normal_tokens(self) -> dict[bytes, int]:
        return {self._tok2bytes[tid]: tid for tid in self._normal.values()}

    @functools.cached_property
    def _split_to_word(self) -> re.Pattern[str]:
        z, r_p_N, r_p_L = _category_classes()
        r_ws = r"\t\n\x0b\x0c\r\x85" + z
        return re.compile(
            "(?i:'s|'t|'re|'ve|'m|'ll|'d)|"
            f"[^\\r\\n{r_p_N}{r_p_L}]?[{r_p_L}]+|[{r_p_N}]{{1,3}}| ?[^{r_ws}{r_p_N}{r_p_L}]+[\\r\\n]*|"
            f"[{r_ws}]*[\\r\\n]+|[{r_ws}]+(?![^{r_ws}])|[{r_ws}]+"
        )

    @functools.cached_property
    def _split_to_sentence(self) -> re.Pattern[str]:
        specials = self._special_tokens
        return re.compile("|".join(re.escape(tok) for tok in specials) if specials else r"(?!)")

    def ready_to_encode(self) -> None:
        """Build what encoding needs now (a worker's load), not at its first request."""
        self._normal_tokens, self._split_to_word, self._split_to_sentence  # noqa: B018


class Tokenizer:
    """Chat-formatted tokenization, with the template and end ids taken from the GGUF."""

    def __init__(self, kv: dict[str, Any]) -> None:
        pre = kv.get("tokenizer.ggml.pre", "llama3")
        template = kv.get("tokenizer.chat_template") or ""
        if pre in _PRESETS:
            preset = _PRESETS[pre]
        elif pre in _PRESETS_CHATML or "<|im_start|>" in template:
            preset = "qwen2"
        else:
            raise ModelError(
                f"tokenizer pre-tokenizer {pre!r} has no tinygrad preset; "
                f"known: {', '.join([*_PRESETS, *_PRESETS_CHATML])}"
            )
        tokens, types = kv["tokenizer.ggml.tokens"], kv["tokenizer.ggml.token_type"]
        normal = {tok: idx for idx, tok in enumerate(tokens) if types[idx] == 1}
        special = {tok: idx for idx, tok in enumerate(tokens) if types[idx] != 1}
        self.tok = _RangedTokenizer(normal, special, preset)
        self.eos_id: int = kv["tokenizer.ggml.eos_token_id"]
        self.end_ids = {self.eos_id} | {kv[k] for k in ("tokenizer.ggml.eot_token_id",) if k in kv}
        self.bos_id: int | None = (
            kv.get("tokenizer.ggml.bos_token_id") if kv.get("tokenizer.ggml.add_bos_token", True) else None
        )
        # a ChatML template that adds a default system turn (SmolLM2's does) gets it here too
        m = re.search(r"<\|im_start\|>system(?:\n|\\n)(.*?)<\|im_end\|>", template, re.S)
        self.default_system = m.group(1) if m and preset == "qwen2" else None

    def chat(self, prompt: str) -> list[int]:
        ids = [self.bos_id] if self.bos_id is not None else []
        if self.default_system:
            ids += self.tok.role("system") + self.tok.encode(self.default_system) + self.tok.end_turn(self.eos_id)
        turn = (
            self.tok.role("user")
            + self.tok.encode(prompt)
            + self.tok.end_turn(self.eos_id)
            + self.tok.role("assistant")
        )
        return [int(i) for i in ids + turn]

    def decode(self, ids: list[int]) -> str:
        return str(self.tok.decode([i for i in ids if i not in self.end_ids]))

    def ready_to_encode(self) -> Tokenizer:
        """What :meth:`chat` needs, built now (a load) rather than at the first request; itself."""
        self.tok.ready_to_encode()
        return self


class StageModel:
    def __init__(self, model: Transformer, kv: dict[str, Any], stage: int, num_stages: int, jit: bool = True) -> None:
        started = time.monotonic()
        self.stage, self.num_stages, self.jit = stage, num_stages, jit
        self.total_blocks = len(model.blk)
        self.lo, self.hi = layer_range(self.total_blocks, stage, num_stages)
        self.first, self.last = stage == 0, stage == num_stages - 1
        self.blocks = model.blk[self.lo : self.hi]
        self.max_context = model.max_context
        self.dim = int(model.token_embd.weight.shape[1])
        # every block, weakly: what kv_info says of a block this stage does not own is the truth
        # about that object, which is gone unless something still holds it
        self._every_block: list[Callable[[], Any]] = [_gone if b is None else weakref.ref(b) for b in model.blk]
        # drop what this stage does not own before anything is realized
        model.blk = [b if self.lo <= i < self.hi else None for i, b in enumerate(model.blk)]
        self.token_embd = model.token_embd if self.first else None
        self.output_norm = model.output_norm if self.last else None
        self.output = model.output if self.last else None
        owned: list[Any] = [*self.blocks, self.token_embd, self.output_norm, self.output]
        params = [p for part in owned if part is not None for p in nn.state.get_parameters(part)]
        Tensor.realize(*params)
        self.param_bytes = sum(p.nbytes() for p in params)
        self.load_s = time.monotonic() - started
        self._start_pos = UOp.variable("start_pos", 1, self.max_context - 1)
        self._jit_embed = TinyJit(self._embed_blocks)
        self._jit_blocks = TinyJit(self._run_blocks)
        self._jit_sample = TinyJit(self._blocks_sample)
        self.prefill_len = 0  # P of the sequence under way (0: no prefill yet)
        self._prefill_digests: dict[int, bytes] = {}  # block -> digest of its cache's [0, P) after prefill
        self.writes: list[list[int]] = []  # [start, end) the calls wrote since the prefill, consecutive ones merged
        self._inputs: dict[tuple[tuple[int, ...], str], Tensor] = {}

    # the computations, shared by the compiled and the eager paths
    def _embed_blocks(self, tokens: Tensor, start_pos: int | UOp) -> Tensor:
        assert self.token_embd is not None
        return self._run_blocks(self.token_embd(tokens), start_pos)

    def _run_blocks(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        for block in self.blocks:
            x = block(x, start_pos)
        return x

    def _blocks_sample(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        assert self.output is not None and self.output_norm is not None
        x = self._run_blocks(x, start_pos)
        # exactly Transformer.forward's head: greedy argmax of the last position
        return self.output(self.output_norm(x))[:, -1, :].softmax(-1, dtype="float").argmax(-1, keepdim=True)

    def _call(
        self, fn: Callable[[Tensor, int | UOp], Tensor], jitted: TinyJit, x: np.ndarray, position: int, prefill: bool
    ) -> Tensor:
        """``x``: (1, seq_len) token ids or (1, seq_len, dim) hidden state, on the host.
        ``prefill``: this call begins a sequence (at position 0)."""
        seq_len = int(x.shape[1])
        self._check_position(position, seq_len)
        if prefill:
            if position != 0:
                raise ValueError(f"a prefill starts at position 0, got position {position}")
            self._begin_sequence()
        if self.jit and seq_len == 1 and position > 0:
            out = jitted(self._decode_input(x), self._start_pos.bind(position))
        else:
            out = fn(Tensor(x), position).realize()
        if self.writes and self.writes[-1][1] == position:  # the cache holds them now
            self.writes[-1][1] = position + seq_len
        else:
            self.writes.append([position, position + seq_len])
        if prefill:  # one read of the caches per request, never per token
            self.prefill_len = seq_len
            self._prefill_digests = {i: digest(self._prefix(c, seq_len)) for i, c in self._caches()}
        return out

    def warm_up(self) -> float:
        """Capture the compiled decode step before the first request, so that a request's decode
        runs compiled from its first token: two throwaway steps, then the caches zeroed and the
        record forgotten, as a prefill would. Returns the seconds it took; nothing to do with
        ``jit`` off.

        The first step, at position 0, is an eager prefill of one token: it creates the KV caches
        (tinygrad's blocks make theirs on their first call). ``TinyJit`` runs its own first call
        eagerly for the same reason, one-time work kept out of the capture, and captures on its
        second; with the caches made, that eager call would only repeat the graph, so the JIT is
        told it has had it (``cnt``, tinygrad 0.12's count of calls) and the second step, at
        position 1, is the capture. An eager pass builds the whole stage's graph in Python: a
        third step would add one more to the stage's start."""
        if not self.jit:
            return 0.0
        started = time.monotonic()
        fn, jitted = (
            (self._embed_blocks, self._jit_embed)
            if self.first
            else (self._blocks_sample, self._jit_sample)
            if self.last
            else (self._run_blocks, self._jit_blocks)
        )
        x = np.zeros((1, 1), np.int32) if self.first else np.zeros((1, 1, self.dim), np.float32)
        self._call(fn, jitted, x, 0, prefill=True)
        jitted.cnt = max(jitted.cnt, 1)  # the caches exist: the next call captures
        self._call(fn, jitted, x, 1, prefill=False)
        assert jitted.captured is not None, "the decode step was not captured"
        self._begin_sequence()
        return time.monotonic() - started

    def _begin_sequence(self) -> None:
        """Zero the caches (a raw copy into the buffers the compiled decode uses, no kernel), so
        that the rows kv_info finds filled are this sequence's; forget the last one's record."""
        for _, cache in self._caches():
            buf = cache.uop.buffer
            buf.copyin(memoryview(bytearray(buf.nbytes)))
        self.prefill_len, self._prefill_digests, self.writes = 0, {}, []

    def _caches(self) -> list[tuple[int, Tensor]]:
        """(block index, its cache) for every block object alive here that has a cache."""
        found = []
        for i, ref in enumerate(self._every_block):
            cache = getattr(ref(), "cache_kv", None)
            if cache is not None:
                found.append((i, cache))
        return found

    @staticmethod
    def _prefix(cache: Tensor | np.ndarray, n: int) -> bytes:
        """The bytes of positions [0, n) of a cache (2, batch, kv heads, context, head dim): K and V."""
        arr = cache.numpy() if isinstance(cache, Tensor) else cache
        return np.ascontiguousarray(arr[..., :n, :]).tobytes()

    def _decode_input(self, x: np.ndarray) -> Tensor:
        """A decode step's input, in a device buffer kept from step to step and written with a
        raw copy. Creating and realizing a new tensor instead costs more a step than the stage's
        own compute on a GPU (tinygrad schedules the copy in Python; bench/profile_stages.py
        measures it)."""
        key = (x.shape, x.dtype.str)
        buf = self._inputs.get(key)
        if buf is None:
            buf = self._inputs[key] = Tensor.zeros(*x.shape, dtype=_DTYPES[x.dtype.str]).contiguous().realize()
        buf.uop.buffer.copyin(np.ascontiguousarray(x).data.cast("B"))
        return buf

    def _check_position(self, position: int, seq_len: int) -> None:
        if position < 0 or seq_len < 1 or position + seq_len > self.max_context:
            raise ValueError(
                f"positions {position}..{position + seq_len - 1} do not fit the context of {self.max_context}"
            )

    # --- the stage operations ----------------------------------------------------------------

    def embed_and_forward(self, tokens: list[int], position: int, prefill: bool = False) -> np.ndarray:
        """Stage 0: embedding + its blocks; returns the hidden state (seq_len, dim) as float32.
        ``prefill`` (every operation takes it): the call begins a sequence, at position 0."""
        if not self.first:
            raise ValueError(f"stage {self.stage} has no embedding: embed_and_forward runs on stage 0")
        tokens_in = np.array([tokens], dtype=np.int32)
        out = self._call(self._embed_blocks, self._jit_embed, tokens_in, position, prefill)
        return np.asarray(out.float().numpy()[0])

    def forward(self, hidden: np.ndarray, position: int, prefill: bool = False) -> np.ndarray:
        """A middle stage: its blocks on the incoming hidden state."""
        if self.first or self.last:
            raise ValueError(f"stage {self.stage} of {self.num_stages} is not a middle stage")
        out = self._call(self._run_blocks, self._jit_blocks, self._hidden(hidden), position, prefill)
        return np.asarray(out.float().numpy()[0])

    def forward_and_sample(self, hidden: np.ndarray, position: int, prefill: bool = False) -> int:
        """The last stage: its blocks, the output norm and head, greedy sampling."""
        if not self.last:
            raise ValueError(f"stage {self.stage} has no output head: forward_and_sample runs on the last stage")
        out = self._call(self._blocks_sample, self._jit_sample, self._hidden(hidden), position, prefill)
        return int(out.item())

    def _hidden(self, hidden: np.ndarray) -> np.ndarray:
        if hidden.ndim != 2 or hidden.shape[1] != self.dim:
            raise ValueError(f"hidden state of shape {tuple(hidden.shape)} does not match (seq_len, {self.dim})")
        return np.ascontiguousarray(hidden, dtype=np.float32)[None]

    def kv_info(self) -> KvInfo:
        """Every block of the model as this stage holds it, read from tinygrad's objects: one
        device-to-host copy of each cache there is (SmolLM2: 1.5 MB a block), only when asked.
        A block's ``filled``: [start, end) spans of the positions whose K rows are non-zero."""
        blocks = []
        for i, ref in enumerate(self._every_block):
            block = ref()
            state = nn.state.get_state_dict(block) if block is not None else {}
            weights = [t for name, t in state.items() if name != "cache_kv"]
            shape: tuple[int, ...] = ()
            filled: tuple[Span, ...] = ()
            cache_digest = b""
            cache = getattr(block, "cache_kv", None)
            if cache is not None:
                arr = cache.numpy()  # (2: K and V, batch, kv heads, context, head dim)
                keys = arr[0]
                rows = np.any(keys != 0, axis=tuple(a for a in range(keys.ndim) if a != keys.ndim - 2))
                shape = tuple(int(d) for d in arr.shape)
                filled = _spans(np.flatnonzero(rows))
                if self.prefill_len:
                    cache_digest = digest(self._prefix(arr, self.prefill_len))
            blocks.append(
                BlockCache(
                    block=i,
                    owned=self.lo <= i < self.hi,
                    present=block is not None,
                    weights_realized=bool(weights) and all(t.uop.is_realized for t in weights),
                    cache_shape=shape,
                    filled=filled,
                    prefill_digest=self._prefill_digests.get(i, b""),
                    digest=cache_digest,
                )
            )
        writes = tuple(Span(a, b) for a, b in self.writes)
        return KvInfo(self.stage, self.lo, self.hi, self.prefill_len, writes, tuple(blocks))


def _gone() -> None:
    """The weak reference of a block that was never built here (a load from the weight cache)."""
    return None


def _spans(positions: np.ndarray) -> tuple[Span, ...]:
    """Sorted positions as [start, end) spans of consecutive ones."""
    if positions.size == 0:
        return ()
    breaks = np.flatnonzero(np.diff(positions) != 1) + 1
    starts = positions[np.r_[0, breaks]]
    ends = positions[np.r_[breaks - 1, positions.size - 1]] + 1
    return tuple(Span(int(a), int(b)) for a, b in zip(starts, ends, strict=True))


def unsplit_generate(
    model: Transformer,
    prompt_ids: list[int],
    max_tokens: int,
    end_ids: set[int],
    on_token: Callable[[int], None] | None = None,
) -> list[int]:
    """The reference: tinygrad's own ``Transformer.generate`` (greedy), on the whole model;
    ``on_token(n)`` after each of its tokens (how many so far)."""
    out: list[int] = []
    for tok in model.generate(list(prompt_ids)):
        out.append(tok)
        if on_token is not None:
            on_token(len(out))
        if tok in end_ids or len(out) >= max_tokens:
            break
    return out


def open_device() -> float:
    """Open tinygrad's default device (a GPU's context, its allocator, its compiler) before the
    load, so that a worker's ready line can say what that took apart from the weights; returns
    the seconds."""
    started = time.monotonic()
    Device[Device.DEFAULT].allocator  # noqa: B018 (opening the device is the point)
    return time.monotonic() - started


CPU_DEVICES = ("CPU", "LLVM", "CLANG")  # tinygrad's CPU backends (0.12 names CPU; the others are older names)


def native_weights_on_the_cpu(env: MutableMapping[str, str] | None = None) -> bool:
    """Weights in the GGUF's own dtype (tinygrad's ``HALF=0``) when the device is the CPU and the
    user has not chosen ``HALF``: a quantized file then dequantizes to float32, which this kind of
    CPU runs several times faster than tinygrad's default float16 (docs/benchmarks.md), and the
    token checks hold in either (the reference loads the same weights in the same process). A GPU
    keeps float16. Call it before anything reads ``HALF`` (tinygrad caches what it read); True
    when it set it."""
    env = os.environ if env is None else env
    if "HALF" in env or Device.DEFAULT not in CPU_DEVICES:
        return False
    env["HALF"] = "0"
    return True


def tinygrad_version() -> str:
    return importlib.metadata.version("tinygrad")
