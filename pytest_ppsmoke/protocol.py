"""What both sides of the wire agree on: actor names, stage names, and how a phase fails.

The orchestrator (``harness``, ``cloud``) and the nodes (``stage``) import this module, never
each other. Names (the SWIM registry): stage 0 registers ``pp-entry`` and ``pp-stage-0``, the
last stage ``pp-exit`` and ``pp-stage-{N-1}``, every stage ``pp-stage-i``. Next and previous
stage names are computed locally from the stage index and the stage count.
"""

from __future__ import annotations

ENTRY = "pp-entry"
EXIT = "pp-exit"

STAGE_ACTOR = "stage"  # a node's pipeline stage: StageActivation, NextToken, InferenceRequest
STATUS_ACTOR = "status"  # a node's health: NodeStatusQuery
ORCHESTRATOR_ACTOR = "orchestrator"  # the seed's collector of FirstToken and InferenceResponse

# the spec's lifecycle deadlines: the settings table's defaults, and harness.runconfig.RunConfig's
BOOT_POLLS = 60  # status polls until an instance is running
BOOT_POLL_INTERVAL = 3.0  # seconds between them, on vast.ai
CONVERGE_TIMEOUT = 120.0  # SWIM: every member alive in every view
RESOLVE_TIMEOUT = 60.0  # every stage name
BUDGET = 300.0  # the spec's verdict within 5 minutes: a run's wall clock, teardown included
DIRECT_PORT = 7000  # the UDP port each create asks vast.ai to forward, and its node binds

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
# the intervals vast.ai's documentation gives, in seconds: (threshold between calls, penalty once exceeded)
VAST_DOCUMENTED_LIMITS: dict[str, tuple[float, float]] = {"create": (4.5, 12.0), "show": (2.0, 0.0)}


def setting(name: str) -> str:
    """A run's setting as a lower layer names it in a message, by its field name: the face that
    shows the message writes its own flag there (``harness.settings.in_face``: ``--gpu-ram`` for
    ``pp-smoke-run``, ``--ppsmoke-gpu-ram`` for pytest). Lower layers name no flag themselves."""
    return f"<setting:{name}>"


def reap_advice(run_id: str) -> str:
    """How a lower layer tells the user to sweep what a run may have left: the face writes the command."""
    return f"<reap:{run_id}>"


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


class PhaseError(RuntimeError):
    """A lifecycle phase failed; ``phase`` names it (rent, boot, converge, load, resolve, ...)."""

    def __init__(self, phase: str, message: str) -> None:
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
