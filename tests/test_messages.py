"""The pipeline's messages sit above the runtime: the runtime imports neither them nor numpy, they
keep their wire type codes, and a process without them refuses their frames by code."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pytest_ppsmoke import messages, protocol
from pytest_ppsmoke.runtime import codec
from pytest_ppsmoke.stage import pipe

pytestmark = pytest.mark.local

# the type codes on the wire, as they were when these messages lived in runtime/codec.py
PIPELINE_CODES = {
    "InferenceRequest": 1,
    "StageActivation": 2,
    "NextToken": 3,
    "InferenceResponse": 4,
    "KvInfoQuery": 40,
    "KvInfo": 41,
    "StageStatsQuery": 42,
    "StageStats": 43,
    "Accepted": 44,
    "NodeStatusQuery": 45,
    "NodeStatus": 46,
    "FirstToken": 47,
    "Progress": 59,
    "RelayProbe": 48,
    "ProbeReport": 49,
    "ReferenceQuery": 55,
    "ReferenceResult": 56,
    "LogTailQuery": 57,
    "LogTail": 58,
}

_LOADED = """
import sys
import pytest_ppsmoke.runtime.node, pytest_ppsmoke.runtime.cluster, pytest_ppsmoke.runtime.member
unwanted = ("numpy", "tinygrad", "pytest_ppsmoke.messages")
print(" ".join(sorted(m for m in sys.modules if m in unwanted or m.split(".")[0] in unwanted)))
"""


def test_the_runtime_imports_no_numpy_no_tinygrad_and_no_pipeline_messages() -> None:
    out = subprocess.run([sys.executable, "-c", _LOADED], capture_output=True, text=True, timeout=60, check=True)
    loaded = out.stdout.split()
    assert loaded == [], f"importing the runtime loaded {loaded[:5]}"


def test_the_pipeline_messages_keep_their_wire_type_codes() -> None:
    mine = {
        name: cls.type_code
        for name, cls in vars(messages).items()
        if isinstance(cls, type) and issubclass(cls, codec.Message) and cls is not codec.Message
    }
    assert mine == PIPELINE_CODES
    assert all(codec.MESSAGE_TYPES[code] is getattr(messages, name) for name, code in PIPELINE_CODES.items())


def test_a_process_without_the_pipeline_messages_refuses_their_frames_by_code() -> None:
    frame = codec.encode_frame(codec.Envelope("stage", "", 0, False), messages.NextToken(1, 2, 3, True))
    script = f"""
from pytest_ppsmoke.runtime import codec
try:
    codec.decode_frame({bytes(frame)!r})
except codec.UnknownMessageType as e:
    print(e.code, e.envelope.to_actor, e)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "3 stage unknown message type 3"


def test_a_type_code_taken_twice_is_refused_naming_both() -> None:
    with pytest.raises(TypeError, match="message type code 2 used by StageActivation and Impostor"):

        @codec.message(2)
        class Impostor(codec.Message):
            pass


def test_wire_dtype_covers_exactly_the_one_list() -> None:
    assert tuple(d.name for d in messages.WireDtype) == protocol.WIRE_DTYPES
    assert messages.WireDtype.parse(protocol.WIRE_DTYPES[0]) is messages.WireDtype.bf16  # the spec's default
    with pytest.raises(ValueError, match="expected one of bf16, f16, f32"):
        messages.WireDtype.parse("f8")


def test_a_workers_load_figures_come_from_its_ready_line_and_make_one_line_for_people() -> None:
    weights = {"source": "cache", "seconds": 0.984, "nbytes": 9, "path": "/c/x.weights", "note": "", "dtype": "f16"}
    programs = {"hits": 41, "misses": 0, "seconds": 0.2, "errors": []}
    base = {"status": "ready", "pid": 1, "stage": 0, "model": "m", "wire_dtype": "bf16", "max_context": 8, "load_s": 1}
    load = pipe.decode_ready({**base, "weights": weights, "programs": programs}).load_figures()
    assert load.weights == messages.WeightLoad("cache", 0.984, 9, "/c/x.weights", "", "f16", 1)
    assert load.programs == messages.ProgramCounts(41, 0)
    assert load.describe() == "weights from the cache in 0.98 s, f16; programs: 41 cached, 0 generated, 0 compiled"
    # a worker that compiled binaries the program cache lacked says how many
    compiled = pipe.decode_ready({**base, "programs": {**programs, "compiled": 3}}).load_figures()
    assert compiled.programs == messages.ProgramCounts(41, 0, 3) and compiled.describe().endswith("3 compiled")
    native = messages.LoadFigures(
        messages.WeightLoad("gguf", 2.0, 9, note="weight cache not used", dtype="f32", half=0)
    )
    assert native.describe() == "weights from the GGUF in 2.00 s, f32 (HALF=0) (weight cache not used)"
    assert pipe.decode_ready({**base, "programs": None}).load_figures() == messages.LoadFigures()
    with pytest.raises(ValueError, match=r"weights\.seconds"):
        pipe.decode_ready({**base, "weights": {**weights, "seconds": "0.98"}})
