"""The token-exact reference: the model in one piece, a Transformer of its own (never a stage's),
run through tinygrad's ``Transformer.generate``, with its hidden state rounded to the wire dtype
at the stages' boundaries as the pipeline's is. This module imports tinygrad."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

from tinygrad import Device, GlobalCounters, Tensor, UOp, dtypes, nn

from ..messages import ReferenceResult, WireDtype
from ..protocol import layer_range, reference_method
from .cache import WeightCache
from .model import Tokenizer, realized_model, unsplit_generate

OnToken = Callable[[int, int], None]  # tokens sampled so far, of at most this many


def round_in_graph(x: Tensor, wire: WireDtype) -> Tensor:
    """``messages.round_to_wire`` as tinygrad operations, so that a compiled ``generate`` keeps
    running: bf16 by its bits (round to nearest, ties to even, as the codec does), f16 by a cast
    there and back (IEEE rounding on every backend). tests/test_stages.py checks both against
    the codec bit for bit."""
    if wire is WireDtype.f32:
        return x
    if wire is WireDtype.f16:
        return x.cast(dtypes.float16).cast(dtypes.float32)
    bits = x.bitcast(dtypes.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).bitcast(dtypes.float32)


class _RoundedBlock:
    """A stage's last block, its output rounded to the wire dtype: the hidden state as the next
    stage receives it. Its parameters stay reachable (``nn.state`` walks ``block``)."""

    def __init__(self, block: Any, wire: WireDtype) -> None:
        self.block, self.wire = block, wire

    def __call__(self, x: Tensor, start_pos: int | UOp) -> Tensor:
        return round_in_graph(self.block(x, start_pos), self.wire)


class ReferenceModel:
    """The model in one piece, loaded for the token-exact reference: a Transformer of its own
    (from the GGUF or from the weight cache's copy of the whole model, never a stage's tensors),
    run through tinygrad's own ``Transformer.generate``. With an f32 wire that is exactly the
    unsplit model; with bf16 or f16 its hidden state is rounded to the wire dtype after each
    stage's last block, inside the graph. No stage code runs, so a fault in :class:`StageModel`
    cannot hide in the reference.

    Two ways to use it: :func:`run_reference` loads one, generates once and drops it (a stage's
    worker, after the request); a reference worker (``PP_WORKER_ROLE=reference``) loads one
    while the stages load and keeps it for the node's life."""

    def __init__(
        self,
        name: str,
        wire: WireDtype,
        num_stages: int,
        max_context: int,
        cache: WeightCache | None = None,
        stage: int = 0,
        on_blocks: Callable[[int, int], None] | None = None,
    ) -> None:
        started = time.monotonic()
        self.stage, self.wire = stage, wire  # stage: the node whose worker runs it
        self.mem_before = GlobalCounters.mem_used
        self.model, kv, self.weights = realized_model(name, max_context, 0, 1, cache, on_blocks)
        self.tokenizer = Tokenizer(kv).ready_to_encode()
        if wire is not WireDtype.f32:
            total = len(self.model.blk)
            for boundary in range(num_stages - 1):  # not ``stage``: that names the node it runs on
                last = layer_range(total, boundary, num_stages)[1] - 1
                self.model.blk[last] = _RoundedBlock(self.model.blk[last], wire)
        Tensor.realize(*nn.state.get_parameters(self.model))
        self.load_s = time.monotonic() - started

    def generate(self, prompt: str, max_tokens: int, on_token: OnToken | None = None) -> ReferenceResult:
        """The tokens a pipeline with this split and wire must produce for ``prompt``;
        ``on_token(n, max_tokens)`` once the model is ready (n = 0) and after each token."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
        ids = self.tokenizer.chat(prompt)
        if len(ids) + max_tokens - 1 > self.model.max_context:  # the last token is never fed back
            raise ValueError(
                f"prompt of {len(ids)} tokens + max_tokens {max_tokens} exceed the context of {self.model.max_context}"
            )
        started = time.monotonic()
        if on_token is not None:
            on_token(0, max_tokens)
        counted = (lambda n: on_token(n, max_tokens)) if on_token is not None else None
        out = unsplit_generate(self.model, ids, max_tokens, self.tokenizer.end_ids, counted)
        return ReferenceResult(
            self.stage,
            reference_method(self.wire.name),
            Device.DEFAULT,
            tuple(ids),
            tuple(out),
            round(self.load_s, 4),
            round(time.monotonic() - started, 4),
            self.mem_before,
            GlobalCounters.mem_used,
            self.weights,
        )

    def drop(self) -> None:
        """Drop the model, with its KV caches and its compiled forward (a cycle through the
        JIT: collected here), and free the allocator's cache, so that its memory returns."""
        del self.model
        gc.collect()
        free_cache = getattr(Device[Device.DEFAULT].allocator, "free_cache", None)
        if free_cache is not None:
            free_cache()


def run_reference(
    name: str,
    prompt: str,
    max_tokens: int,
    wire: WireDtype,
    num_stages: int,
    max_context: int,
    cache: WeightCache | None = None,
    stage: int = 0,
    on_token: OnToken | None = None,
    on_blocks: Callable[[int, int], None] | None = None,
) -> ReferenceResult:
    """The tokens a pipeline of ``num_stages`` stages with this wire must produce, by a
    :class:`ReferenceModel` loaded afresh here and dropped before returning (so its memory
    returns: ``mem_after`` is read after the drop); ``load_s`` is this load's. ``on_blocks``
    hears its blocks realized as they come, ``on_token`` its tokens."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    ref = ReferenceModel(name, wire, num_stages, max_context, cache, stage, on_blocks)
    try:
        result = ref.generate(prompt, max_tokens, on_token)
    finally:
        ref.drop()
    return dataclasses.replace(result, mem_after=GlobalCounters.mem_used)
