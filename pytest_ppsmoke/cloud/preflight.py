"""The pre-flight: what can be known before the first create, in seconds, with nothing rented.

A run that cannot succeed should cost nothing. Before :meth:`Deployment.rent` sends a create,
:func:`preflight` checks, in this order, and refuses with one line that names the fix:

1. **The key.** ``GET /api/v0/users/current``: a 401 or 403 means vast.ai refused it.
2. **The image**, where asked (``check_image``): the image's registry, as a pull asks it
   (:mod:`.oci`): it exists, anonymous hosts may pull it, and it has a ``linux/amd64`` manifest.
3. **The model**, where the orchestrator can know its blocks without the file (a name the
   catalogue declares, :mod:`..stage.catalog`) or from its header (a GGUF file on this machine,
   whose tensors must also lie within it: a file cut short is refused): at least one block per
   stage.
4. **The offers**: enough match the query for every stage (the search the rent then uses).
5. **The credit**: the account's ``credit`` covers the worst case, the chosen offers' $/h for the
   whole budget.

:class:`Preflight` holds what it found (the account's credit, the image's digest and compressed
size, the offers) for the report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..ggufinfo import GGUFError, blocks_of, check_complete
from ..protocol import Names, Phase, PhaseError
from ..stage.catalog import declared
from .oci import ImageInfo, ImageProblem, ImageRef, inspect_image, on_loopback
from .provider import Offer, OfferQuery, Provider, ProviderError, QuotaExceeded

CHECKS = 5  # the key, the image, the model, the offers, the credit


@dataclass
class Preflight:
    """What the pre-flight found. ``offers``: the matching offers, cheapest first."""

    credit: float | None = None
    image: ImageInfo | None = None
    image_checked: str = "not asked"  # "checked", or why not
    offers: list[Offer] = field(default_factory=list)
    worst_case_usd: float = 0.0
    blocks: int | None = None
    seconds: float = 0.0
    checks: int = 0  # how many of the CHECKS have passed so far (the live line's count)
    of: ClassVar[int] = CHECKS

    def summary(self) -> dict[str, Any]:
        return {
            "credit_usd": self.credit,
            "worst_case_usd": round(self.worst_case_usd, 4),
            "image": self.image.summary() if self.image else None,
            "image_checked": self.image_checked,
            "offers": len(self.offers),
            "model_blocks": self.blocks,
            "seconds": round(self.seconds, 3),
        }


def image_check(image: str, vastai: bool) -> bool | str:
    """Whether the pre-flight asks the image's registry: always for vast.ai; in local mode only a
    registry on this machine (local mode reaches nothing else), else the reason it is not asked."""
    if vastai:
        return True
    try:
        registry = ImageRef.parse(image).registry
    except ImageProblem:
        return True  # asked, to fail with the name's problem
    if on_loopback(registry):
        return True
    return f"local mode asks only a registry on this machine, not {registry}"


def _fail(message: str) -> PhaseError:
    return PhaseError(Phase.PREFLIGHT, message)


async def preflight(
    vast: Provider,
    *,
    query: OfferQuery,
    num_stages: int,
    image: str,
    check_image: bool | str,
    model: str,
    budget_s: float,
    names: Names,
    found: Preflight | None = None,
) -> Preflight:
    """The checks of the module docstring; PhaseError (phase ``preflight``) on the first that
    fails. ``check_image``: True to ask the image's registry, or the reason it is not asked.
    ``found``: the record to fill as the checks pass (``checks``), and return."""
    started = time.monotonic()
    found = Preflight() if found is None else found
    found.credit = await _key(vast, names)
    found.checks = 1
    if check_image is True:
        try:
            found.image = await inspect_image(image, names=names)
        except ImageProblem as e:
            raise _fail(str(e)) from None
        found.image_checked = "checked"
    else:
        found.image_checked = str(check_image) or "not asked"
    found.checks = 2
    found.blocks = _blocks(model, num_stages, names)
    found.checks = 3
    found.offers = await find_offers(vast, query, num_stages, names)
    found.checks = 4
    rate = sum(o.dph_total for o in found.offers[:num_stages])
    found.worst_case_usd = rate * budget_s / 3600
    if found.credit is not None and found.credit < found.worst_case_usd:
        raise _fail(
            f"the account's credit, ${found.credit:.2f}, does not cover the run's worst case, "
            f"${found.worst_case_usd:.2f} ({num_stages} instances at ${rate:.3f}/h in all for the "
            f"{budget_s:g} s budget); add credit on vast.ai, or lower {names.setting('budget')} or "
            f"{names.setting('max_price')}"
        )
    found.seconds = time.monotonic() - started
    found.checks = CHECKS
    return found


async def find_offers(
    vast: Provider, query: OfferQuery, num_stages: int, names: Names, phase: Phase = Phase.PREFLIGHT
) -> list[Offer]:
    """The offers that match ``query``, cheapest first: the search the rent uses, with or without
    the pre-flight. PhaseError (``phase``) if it fails or fewer than ``num_stages`` match."""
    try:
        offers = await vast.search_offers(query)
    except QuotaExceeded as e:  # its own words: a daily quota, not a failed search
        raise PhaseError(phase, str(e)) from None
    except ProviderError as e:
        raise PhaseError(
            phase, unreachable(vast, e, names) if e.status == 0 else f"searching offers failed: {e}"
        ) from None
    if len(offers) < num_stages:
        raise PhaseError(
            phase,
            f"{len(offers)} offer(s) match ({query.describe()}); {num_stages} are needed. "
            f"Relax {names.setting('gpu_ram')}, {names.setting('max_price')} or {names.setting('min_reliability')}",
        )
    return offers


def unreachable(vast: Provider, e: ProviderError, names: Names) -> str:
    """A call that got no answer (connection refused, a name that does not resolve, a timeout):
    where it went, why, and the fixes."""
    return (
        f"cannot reach vast.ai at {vast.where} ({e}); check this machine's network and its proxy "
        f"(HTTPS_PROXY), or point {names.setting('vast_url')} at the API"
    )


async def _key(vast: Provider, names: Names) -> float | None:
    """The account's credit ($), None where the record has none; PhaseError if the key is refused."""
    try:
        return await vast.credit()
    except ProviderError as e:
        if e.status in (401, 403):
            raise _fail(
                f"vast.ai refused the API key (HTTP {e.status}); check {names.setting('api_key')} "
                "(the key on vast.ai's Account page)"
            ) from None
        if e.status == 0:
            raise _fail(unreachable(vast, e, names)) from None
        raise _fail(f"asking vast.ai for the account failed: {e}") from None


def _blocks(model: str, num_stages: int, names: Names) -> int | None:
    """The model's blocks: a catalogue name's declared count, or a GGUF file's here, whose header
    is read and whose tensors must lie within the file (None for a URL); PhaseError if fewer
    than the stages."""
    entry = declared(model)
    if entry is not None:
        blocks = entry.blocks
    else:
        path = Path(model).expanduser()
        if path.suffix != ".gguf" or not path.is_file():
            return None
        try:
            blocks = blocks_of(check_complete(path).metadata, path)
        except (GGUFError, OSError) as e:
            raise _fail(f"{names.setting('model')} {model!r}: {e}") from None
    if blocks < num_stages:
        raise _fail(
            f"{names.setting('model')} {model!r} has {blocks} block(s), fewer than the {num_stages} stages; "
            f"lower {names.setting('num_stages')} to at most {blocks}"
        )
    return blocks
