"""The parts of a run's report (``harness/report.py``'s :class:`Report`): every record of it a
dataclass here, typed with primitives, enums, these dataclasses and lists, tuples and
``dict[str, X]`` maps of them (``tests/test_typed.py`` checks it); a map is keyed by data (a
stage's, a hop's, a link's, a frame type's or a phase's name), a record with fixed keys is a
dataclass. The report's schema is generated from them.

This module imports only the standard library and ``protocol``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..protocol import stage_name


class Mode(enum.StrEnum):
    """Where the run rented: the emulator on this machine, or vast.ai."""

    LOCAL = "local"
    VASTAI = "vastai"


class WireDtype(enum.StrEnum):
    """The hidden states' dtype on the wire (``protocol.WIRE_DTYPES``, the spec's first)."""

    BF16 = "bf16"
    F16 = "f16"
    F32 = "f32"


class ReferenceState(enum.StrEnum):
    """What became of the token-exact reference (:class:`ReferenceFigures`)."""

    NOT_RUN = "not run"
    OFF = "off"
    SKIPPED = "skipped"
    FAILED = "failed"
    DONE = "done"


class ReferenceLoad(enum.StrEnum):
    """Where the reference's model was loaded: a worker of its own beside the stages, or the
    stage's own worker after the request (``nodeenv.REFERENCES``)."""

    BESIDE = "beside"
    AFTER = "after"


class LossKind(enum.StrEnum):
    """How the emulator took a host away (its failpoints): the node killed, its host offline
    (the node stopped), the container exited, or the node frozen."""

    KILLED = "killed"
    OFFLINE = "offline"
    EXITED = "exited"
    FROZEN = "frozen"


@dataclass
class ProgramFigures:
    """A worker's tinygrad programs over its life: ``read`` from the program cache, ``generated``
    by tinygrad (a cold node's work, which a prebuilt image's programs spare it), and ``compiled``
    (their binaries made on the node: NVRTC on a GPU; 0 where the cache carried each binary)."""

    read: int
    generated: int
    compiled: int


@dataclass
class ReferenceFigures:
    """The token-exact reference: the model run in one piece on a stage's node after the request
    (the ``reference`` step). ``state``: ``not run`` (no step asked for it), ``off`` (the setting),
    ``skipped`` or ``failed`` (``detail`` says why), or ``done``. ``match`` compares its tokens
    with the pipeline's; ``first_difference`` is the first index where they differ (or where the
    shorter list ends). A mismatch does not fail the run: the spec's token-exact test fails on it."""

    state: ReferenceState = ReferenceState.NOT_RUN
    detail: str | None = None
    stage: int | None = None
    device: str | None = None  # tinygrad's device on that node: CUDA on a rented GPU, CPU locally
    method: str | None = None  # protocol.reference_method: "unsplit", or rounded at the boundaries
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    match: bool | None = None
    first_difference: int | None = None
    load_s: float | None = None  # in the worker: loading the whole model (beside: while the stages loaded)
    generate_s: float | None = None  # in the worker: tinygrad's generate
    loaded: ReferenceLoad | None = (
        None  # beside: a reference worker loaded it with the stages; after: the stage's, afresh
    )
    seconds: float | None = None  # the step as the orchestrator saw it (asked early: the wait for its answer)
    # asked as stage 0's node was ready (its reference loaded beside), while the other stages still
    # loaded: its seconds from the query to the answer, before or beside the request's (None: asked
    # at the step, after the request)
    early_s: float | None = None
    mem_before: int | None = None  # the worker's device bytes in use before the load and after the generate
    mem_after: int | None = None  # (after: the model dropped first; beside: the model kept)
    programs: ProgramFigures | None = None  # its worker's (None: the program cache off)

    def line(self) -> str:
        """One line for the terminal summary and the command's output."""
        if self.state != "done":
            return f"reference {self.state}" + (f": {self.detail}" if self.detail else "")
        how = "loaded beside the stages" if self.loaded == "beside" else "loaded after the request"
        if self.early_s is not None:
            how += f", asked as its node joined: {self.early_s:.3g} s"
        where = f"{stage_name(self.stage)} ({self.device}, {self.method}, {how})"
        if self.match:
            return f"reference on {where}: the {len(self.token_ids)} tokens match"
        return f"reference on {where}: MISMATCH at token {self.first_difference}"


class NodeState(enum.StrEnum):
    """What became of an instance's node when the run failed (``harness/accounts.py``)."""

    ANSWERED = "answered"
    STALLED = "stalled"
    HUNG = "hung"
    DEAD = "dead"
    UNKNOWN = "unknown"
    BOOTING = "booting"


class LogSource(enum.StrEnum):
    """Where a node's log tail came from: the node itself over the cluster, or vast.ai's logs."""

    CLUSTER = "cluster"
    VAST_LOGS = "vast.ai logs"


@dataclass
class StageSplit:
    """One stage of the split: its blocks ``[first, end)`` (None before the stages said), its
    instance, and the line of its load (weights cached or not, programs; None before it loaded)."""

    stage: int
    blocks: tuple[int, int] | None = None
    instance: int | None = None
    load: str | None = None


@dataclass
class HopFigures:
    """One hop's frames in one phase: how many, their sizes, and the median time on the wire."""

    count: int
    bytes_each: list[int]
    bytes_total: int
    median_s: float | None


@dataclass
class HopPhases:
    """One hop (``pp-stage-0->pp-stage-1``), prefill and decode apart."""

    prefill: HopFigures
    decode: HopFigures


@dataclass
class KvFill:
    """Cached blocks with the same positions filled: both as ``[start, end)`` ranges."""

    blocks: list[tuple[int, int]]
    positions: list[tuple[int, int]]


@dataclass
class KvFigures:
    """One stage's caches as its worker read them: the blocks it owns; those present, realized and
    cached (``[start, end)`` ranges of block indices); the caches' shapes; the positions filled;
    the prompt's length and which caches kept their prefill digest; the writes its calls made."""

    stage: int
    blocks: tuple[int, int]
    present: list[tuple[int, int]]
    realized: list[tuple[int, int]]
    cached: list[tuple[int, int]]
    cache_shapes: list[list[int]]
    filled: list[KvFill]
    prefill_len: int
    prefill_digest_kept: list[tuple[int, int]]
    prefill_digest_changed: list[tuple[int, int]]
    writes: list[tuple[int, int]]
    programs: ProgramFigures | None = None  # its worker's, load to the end of decode (None: the cache off)


@dataclass
class MembershipCounts:
    """SWIM's and the name registry's frames, summed: what a node sends whatever the pipeline does."""

    sent: int = 0
    received: int = 0


@dataclass
class NoteCounts:
    """The stages' progress notes (``Progress``), summed: counts for the live line, one way, apart
    from the request's own traffic."""

    sent: int = 0
    received: int = 0


@dataclass
class ReferenceCounts:
    """The token-exact reference's query and answer (``ReferenceQuery``, ``ReferenceResult``),
    summed: asked as stage 0 is ready, its frames may fall in the request's windows."""

    sent: int = 0
    received: int = 0


@dataclass
class FrameWindow:
    """The frames of a window by message type name; membership traffic, progress notes and the
    reference's frames summed apart."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    membership: MembershipCounts = field(default_factory=MembershipCounts)
    notes: NoteCounts = field(default_factory=NoteCounts)
    reference: ReferenceCounts = field(default_factory=ReferenceCounts)


@dataclass
class OrchestratorFrames:
    """The orchestrator's windows: prefill (from the request to the FirstToken) and decode (from
    there to the InferenceResponse); with no FirstToken, the whole request is prefill's."""

    prefill: FrameWindow | None = None
    decode: FrameWindow | None = None


@dataclass
class Frames:
    """The request's frames: the orchestrator's windows, and each stage's, by stage name."""

    orchestrator: OrchestratorFrames = field(default_factory=OrchestratorFrames)
    stages: dict[str, FrameWindow] = field(default_factory=dict)


@dataclass
class ImageFigures:
    """The node image as its registry holds it (``cloud/oci.py``'s ``ImageInfo``)."""

    image: str
    digest: str
    platforms: list[str]
    layers: int
    compressed_bytes: int


@dataclass
class PreflightFigures:
    """What the checks before the first create found (``cloud/preflight.py``)."""

    credit_usd: float | None
    worst_case_usd: float
    image: ImageFigures | None
    image_checked: str
    offers: int
    model_blocks: int | None
    seconds: float


class ClaimState(enum.StrEnum):
    """How a claim of the run was judged (``harness/claims.py``)."""

    PASSED = "passed"
    FAILED = "failed"
    NOT_CHECKED = "not checked"


@dataclass
class ClaimFigures:
    """One claim of the README's table, as the run judged it: its evidence in words (a figure
    when it passed, what differed when it failed, why not when it was not checked)."""

    claim: str
    state: ClaimState
    evidence: str


@dataclass
class OfferFigures:
    """The offer an instance was created on, and its machine (0: not known)."""

    id: int
    machine_id: int
    gpu_name: str
    num_gpus: int
    gpu_ram_mb: float
    dph_total: float
    reliability: float
    geolocation: str


@dataclass
class Stall:
    """A stall of an event loop: seconds after the watch began, and how long."""

    at: float
    seconds: float


@dataclass
class InstanceFigures:
    """One rented instance (``cloud/rental.py``'s ``RentedInstance``) and, when the run failed, its
    node's own account (``harness/accounts.py``): its state, in words, the tail of its log and
    where it came from, its loop's stalls. ``timeline``: the instance's steps reached, by name,
    in seconds since the run began. A replaced instance says why and when; its cost is its own."""

    id: int | None
    stage: int
    label: str
    endpoint_id: str
    offer: OfferFigures
    dph_total: float
    seconds: float
    cost_usd: float
    final_state: str | None
    status_msg: str | None
    destroy_error: str | None
    public_udp: str | None
    timeline: dict[str, float]
    replacement: int  # 0: its stage's first instance; k: its k-th replacement
    replaces: int | None  # the id of the instance it replaced
    replaced: str | None  # why it was replaced (and destroyed): it never ran, or its node never joined
    replaced_at: float | None  # when, in seconds since the run began
    # destroyed before the teardown, once no step needed it (pp-smoke-run: the stages the
    # reference does not run on, while it runs)
    released: bool = False
    node_state: NodeState | None = None
    node_words: str = ""
    log_source: LogSource | None = None
    log_tail: list[str] = field(default_factory=list)
    stalls: list[Stall] = field(default_factory=list)


@dataclass
class ListedInstance:
    """An instance as vast.ai listed it after the teardown: what names it and its state."""

    id: int | None
    label: str | None
    actual_status: str | None
    intended_status: str | None
    next_state: str | None


@dataclass
class SkippedOffer:
    """An offer taken by someone else between the search and the create."""

    stage: int
    offer: int
    dph_total: float
    status: int | None
    error: str


@dataclass
class NetworkFigures:
    """The emulated network: its profile, the orchestrator's address on it (``host_addr``; behind
    an internet profile's home NAT, ``public_addr`` and ``home_addr``), its subnet and the prefix
    of its devices' names (None for an emulator started apart)."""

    spec: str
    subnet: str | None
    prefix: str | None = None
    host_addr: str | None = None
    public_addr: str | None = None
    home_addr: str | None = None


@dataclass
class LinkStats:
    """One directed link of the delay switch: its profile, packets, bytes, delivered, dropped (lost,
    partitioned, overflow), and the added delay measured, mean and max, in ms."""

    profile: str
    packets: int
    bytes: int
    delivered: int
    dropped: int
    lost: int
    partitioned: int
    overflow: int
    mean_delay_ms: float | None
    max_delay_ms: float | None


@dataclass
class PathFigures:
    """How one end reaches another, as a stage tells it: the path (``direct`` or ``relay``; None
    before any), the peer's address, the round trip, who dialled, and ``selected`` (False: the
    connection had no path selected at that moment, and the one that carried the most out is
    given)."""

    path: str | None
    remote_addr: str | None
    rtt_ms: float | None
    dialled_by: str
    selected: bool


@dataclass
class LinkFigures(PathFigures):
    """How the orchestrator reaches a stage: a stage's word on a path (:class:`PathFigures`),
    and how many paths the connection listed."""

    paths: int


@dataclass
class Paths:
    """How the orchestrator reaches each stage (``links``, by stage name: None with no
    connection), the connections it dialled and accepted, and how each stage reached its peers
    during the request (``stages``, by ``pp-stage-0->pp-stage-1``)."""

    links: dict[str, LinkFigures | None]
    dialled: int
    accepted: int
    stages: dict[str, PathFigures] = field(default_factory=dict)


@dataclass
class SwimNode:
    """The SWIM timing a node runs with after the orchestrator told it its own, or why it did not
    answer (``error``)."""

    ping_timeout: float | None = None
    protocol_period: float | None = None
    error: str | None = None


@dataclass
class SwimCounts:
    """The orchestrator's failure detector's counts (``runtime/swimconfig.py``'s ``SwimStats``)."""

    awareness: int
    suspicions_raised: int
    suspicions_refuted: int
    confirmations: int
    deaths_declared: int
    refuted_about_me: int
    stalls_excused: int


@dataclass
class SwimDeath:
    """A stage the orchestrator's SWIM declared dead, and when (epoch seconds)."""

    member: str
    at: float


@dataclass
class LoopStalls:
    """The orchestrator's own event loop, watched from the rent on: stalls longer than its SWIM
    ping timeout, how many, the longest (seconds), and those kept."""

    count: int
    longest: float
    stalls: list[Stall]


@dataclass
class SwimFigures:
    """The round trips measured after converge (ms, by stage name), the SWIM timing chosen and who
    chose it, each node's timing, the failure detector's counts, the stages it declared dead, and
    the orchestrator's loop stalls (None without a watch)."""

    rtt_ms: dict[str, float | None]
    worst_rtt_ms: float
    ping_timeout: float
    protocol_period: float
    suspicion_timeout: float
    suspicion_max_mult: float
    set_by: str
    nodes: dict[str, SwimNode]
    stats: SwimCounts
    deaths: list[SwimDeath] = field(default_factory=list)
    orchestrator_stalls: LoopStalls | None = None


@dataclass
class ApiCounts:
    """Calls to one endpoint of vast.ai's API (or all): requests sent (retries included), answers
    429 and those retried, retries after a 5xx or no answer, seconds slept before retries and
    seconds calls waited for their endpoint's pace."""

    calls: int = 0
    rate_limited: int = 0
    rate_limit_retries: int = 0
    retries: int = 0
    retry_wait_s: float = 0.0
    pace_wait_s: float = 0.0


@dataclass
class ApiFigures(ApiCounts):
    """The client's calls in all, and each endpoint's."""

    endpoints: dict[str, ApiCounts] = field(default_factory=dict)


@dataclass
class HostLoss:
    """An instance the emulator's failpoints killed, froze or took the host of (``vast.kill_stage``,
    ``vast.lose_host``), after how many tokens, and when (epoch seconds, just before the signal)."""

    instance: int
    stage: int | None
    how: LossKind
    after_tokens: int
    at: float


@dataclass
class EmulatorFigures:
    """The embedded emulator's own record: its live and destroyed instances, and its host losses."""

    live_instances: list[int]
    destroyed_instances: list[int]
    host_losses: list[HostLoss] = field(default_factory=list)


@dataclass
class PhaseSpan:
    """One phase, from its start to its end, in seconds since the rent began (the origin of
    ``instances[].timeline``; the pre-flight, before the rent, starts below 0). ``end - start``
    is the phase's ``timings`` entry, within their rounding."""

    phase: str
    start: float
    end: float


@dataclass
class RunTimeline:
    """Where the run's time went: its phases in the order they ran (each instance's steps are in
    ``instances[].timeline``, on the same clock), and its budget: the run's clock started at
    ``started`` (at or below 0: the emulator or the client opened before the rent) and its steps
    had to end by ``steps_deadline``, the budget by ``budget_end`` (the teardown's deadline kept
    between the two)."""

    phases: list[PhaseSpan] = field(default_factory=list)
    started: float = 0.0
    budget: float = 0.0
    steps_deadline: float = 0.0
    budget_end: float = 0.0
