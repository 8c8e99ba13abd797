"""What both sides of the wire agree on: actor names, stage names, and how a phase fails.

The orchestrator (``harness``, ``cloud``) and the nodes (``stage``) import this module, never
each other. Names (the SWIM registry): stage 0 registers ``pp-entry`` and ``pp-stage-0``, the
last stage ``pp-exit`` and ``pp-stage-{N-1}``, every stage ``pp-stage-i``. Next and previous
stage names are computed locally from the stage index and the stage count.
"""

from __future__ import annotations

import enum

ENTRY = "pp-entry"
EXIT = "pp-exit"

STAGE_ACTOR = "stage"  # a node's pipeline stage: StageActivation, NextToken, InferenceRequest
STATUS_ACTOR = "status"  # a node's health: NodeStatusQuery
REFERENCE_ACTOR = "reference"  # stage 0's reference loaded beside: ReferenceQuery, from the node's join
ORCHESTRATOR_ACTOR = "orchestrator"  # the seed's collector of FirstToken and InferenceResponse

# the spec's lifecycle deadlines: the settings table's defaults, and harness.runconfig.RunConfig's
BOOT_POLLS = 60  # status polls until an instance is running
BOOT_POLL_INTERVAL = 3.0  # seconds between them, on vast.ai
CONVERGE_TIMEOUT = 120.0  # SWIM: every member alive in every view
RESOLVE_TIMEOUT = 60.0  # every stage name
BUDGET = 300.0  # the spec's verdict within 5 minutes: a run's wall clock, teardown included
DIRECT_PORT = 7000  # the UDP port each create asks vast.ai to forward, and its node binds
# the least disk (GB) vast.ai takes for a create: its description's (x-input-validation), which
# tests/test_createlimits.py holds this to; here so that the settings can refuse less up front
LEAST_DISK_GB = 8.0

# the GPUs the node image can run: the compute capabilities (vast.ai's ``compute_cap``, x100) of
# the GPUs vast.ai rents that the image's NVRTC (12.4: sm_50 to sm_90) compiles tinygrad's f16 and
# bf16 kernels for, each checked inside the built image (tests/test_image.py). Blackwell (10.0,
# 12.0: B200, RTX 50xx) is refused by that NVRTC; every offer search asks for this range.
COMPUTE_CAPS = (600, 610, 700, 750, 800, 860, 890, 900)

# the dtypes of hidden states on the wire, the spec's default first: the one list (the settings,
# the node's environment and ``messages.WireDtype`` take it from here; stdlib only, so that the
# pytest plugin can read it without numpy)
WIRE_DTYPES = ("bf16", "f16", "f32")


# vast.ai's endpoints, by the names its rate limits are given in (``vast.rate_limit``) and the
# client's figures are counted under: (method, route) -> name. A route's ``{id}`` is any number.
VAST_ENDPOINTS: dict[tuple[str, str], str] = {
    ("POST", "/api/v0/bundles/"): "search",
    ("PUT", "/api/v0/asks/{id}/"): "create",
    ("GET", "/api/v0/instances/{id}/"): "show",
    ("PUT", "/api/v0/instances/{id}/"): "label",
    ("DELETE", "/api/v0/instances/{id}/"): "destroy",
    ("GET", "/api/v1/instances/"): "list",
    ("DELETE", "/api/v0/instances/"): "destroy_many",
    ("GET", "/api/v0/users/current"): "user",
    ("PUT", "/api/v0/instances/request_logs/{id}/"): "logs",
}
# (their rate and input limits are read from vast.ai's OpenAPI files: cloud/vastdoc.py)


class Names:
    """How the face that shows a message names the run's settings: lower layers write
    ``names.setting("gpu_ram")`` (or ``{gpu_ram}`` in a template formatted with ``names``) and
    get the face's own flag (``--gpu-ram`` for ``pp-smoke-run``, ``--ppsmoke-gpu-ram`` for
    pytest), so that no layer below the faces names a flag itself. Built by the face
    (``harness.settings.face_names``); the default names each setting by its field name."""

    def __init__(self, flags: dict[str, str] | None = None, reap: str = "pp-smoke-run --reap") -> None:
        self._flags = dict(flags or {})
        self._reap = reap

    def setting(self, name: str) -> str:
        """Setting ``name`` (a field of the settings table) as the face writes it."""
        return self._flags.get(name, name)

    __getitem__ = setting  # str.format_map's lookup

    def reap(self, run_id: str) -> str:
        """The command that sweeps what run ``run_id`` may have left."""
        return f"{self._reap} --run-id {run_id}"

    def __repr__(self) -> str:
        return f"Names({len(self._flags)} flags)"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Names) and (self._flags, self._reap) == (other._flags, other._reap)

    def __hash__(self) -> int:
        return hash((tuple(sorted(self._flags.items())), self._reap))


def stage_name(stage: int | None) -> str:
    """The name stage ``stage`` registers, ``pp-stage-<stage>``; a report's stage that was never
    set (None) is named ``pp-stage-None``."""
    return f"pp-stage-{stage}"


def stage_names(stage: int, num_stages: int) -> list[str]:
    """The names stage ``stage`` registers: its own, plus entry or exit."""
    if not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} is outside 0..{num_stages - 1}")
    names = [stage_name(stage)]
    if stage == 0:
        names.insert(0, ENTRY)
    if stage == num_stages - 1:
        names.insert(0, EXIT)
    return names


def cluster_names(num_stages: int) -> list[str]:
    """Every name a cluster of ``num_stages`` stages registers, entry and exit first."""
    return [ENTRY, EXIT, *(stage_name(i) for i in range(num_stages))]


def reference_method(wire_dtype: str) -> str:
    """How the token-exact reference is made for a wire dtype: with f32, tinygrad's own unsplit
    ``generate``; with bf16 or f16, the same, its hidden state rounded to the wire dtype after
    each stage's last block (rounding can change a greedy token, so the pipeline must match that)."""
    return "unsplit" if wire_dtype == "f32" else f"unsplit, boundaries rounded to {wire_dtype}"


class Phase(enum.StrEnum):
    """The run's phases, in order: the one table of them. ``PhaseError``, the progress lines, the
    report's ``failed_phase`` and ``timings``, the JUnit properties and docs/lifecycle.md's table
    of phases all name a phase by its value. Each member carries its ``hint`` (what to do when it
    fails, where the failure's own message does not say), the driver ``step`` that runs it, and
    the instance step (``RentedInstance.timeline``) it waits for on every instance, if it does.
    A ``StrEnum``: a phase is its name wherever a string is written (JSON, a line, a key)."""

    PREFLIGHT = (
        "preflight",
        "rent",
        None,
        "nothing was rented",
    )
    RENT = (
        "rent",
        "rent",
        "rented",
        ("check the API key, the network and {vast_url}; if too few offers match, relax the offer constraints"),
    )
    BOOT = (
        "boot",
        "boot",
        "running",
        "the hosts did not start the node image; run again (other offers are picked) or check {image}",
    )
    CONVERGE = (
        "converge",
        "converge",
        "joined",
        (
            "the orchestrator and a node could not reach each other over iroh (UDP); check the port it forwards, "
            "the firewall and the node's log"
        ),
    )
    LOAD = (
        "load",
        "load",
        "loaded",
        "a worker did not load its layers; check {model} and the instances' disk and GPU RAM",
    )
    RESOLVE = "resolve", "resolve", None, "a stage did not register its names; the node's log says why"
    PREFILL = (
        "prefill",
        "infer",
        None,
        "a stage failed on the prompt; run again with -v for the stage and membership events",
    )
    DECODE = (
        "decode",
        "infer",
        None,
        "a stage failed while generating; run again with -v for the stage and membership events",
    )
    REFERENCE = "reference", "reference", None, ""
    TEARDOWN = "teardown", "", None, ""

    step: str
    waits_for: str | None
    hint: str

    def __new__(cls, value: str, step: str, waits_for: str | None, hint: str) -> Phase:
        member = str.__new__(cls, value)
        member._value_ = value
        member.step, member.waits_for, member.hint = step, waits_for, hint
        return member

    def advice(self, names: Names) -> str:
        """The phase's hint, each setting it names as ``names`` writes it ("" for none)."""
        return self.hint.format_map(names)

    @property
    def next(self) -> Phase:
        """The phase after this one (teardown: itself)."""
        order = list(Phase)
        return order[min(order.index(self) + 1, len(order) - 1)]


class PhaseError(RuntimeError):
    """A lifecycle phase failed; ``phase`` names it."""

    def __init__(self, phase: Phase, message: str) -> None:
        if not isinstance(phase, Phase):
            raise TypeError(f"PhaseError's phase must be a Phase, got {phase!r}")
        super().__init__(f"{phase}: {message}")
        self.phase = phase
        self.reason = message


def layer_range(total: int, stage: int, num_stages: int) -> tuple[int, int]:
    """The spec's split, for any number of stages: ``total // num_stages`` blocks a stage, the
    last stage takes the rest. Here, with no tinygrad, so that the orchestrator's side (the layout
    model, the weight cache's key check) and the stages agree on one formula."""
    if num_stages < 1 or not 0 <= stage < num_stages:
        raise ValueError(f"stage {stage} of {num_stages} is not a valid stage")
    if num_stages > total:
        raise ValueError(f"{num_stages} stages need at least as many blocks; the model has {total}")
    k = total // num_stages
    return stage * k, (stage + 1) * k if stage < num_stages - 1 else total


# A stage worker's load, said before its ready line in progress lines (``stage/pipe.py``):
# ``step`` (the step of LOAD_STEPS it has begun, n of them), ``blocks`` (its blocks realized, of
# its part's) and ``programs`` (tinygrad programs read from the program cache or generated so far;
# their total is not known ahead: 0). The node's ``NodeStatus`` carries the latest of each.
LOAD_STEPS = ("opening the device", "loading weights", "building the stage", "warming up")
