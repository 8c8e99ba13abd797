"""The emulator's catalogue: offers shaped like vast.ai's, and its search (``POST
/api/v0/bundles/``): a query's ``{field: {op: value}}`` filters, its ``order`` and ``limit``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

DEFAULT_STORAGE = 8.0  # GB: the allocated_storage a search prices offers for when its query names none
HOURS_PER_MONTH = 720  # storage_cost is $/GB/month; dph_total is $/hour

# compute capability (x100) -> the CUDA version a driver serves (cuda_max_good) -> that driver's version
DRIVERS = {
    11.8: "520.61.05",
    12.2: "535.183.01",
    12.4: "550.127.05",
    12.6: "560.35.03",
    12.8: "570.133.20",
    12.9: "575.57.08",
}


def default_catalogue() -> list[dict[str, Any]]:
    """Offers with the spread of vast.ai's hosts: compute capability 6.1 to 12.0 (Pascal to
    Blackwell), drivers serving CUDA 11.8 to 12.9, downloads of 50 to 10,000 Mbit/s, hosts that
    forward no port, storage at $0.05-0.50/GB/month. The search prices each for its query's
    ``allocated_storage`` (:func:`price`), so the stored ``dph_total`` is that for
    :data:`DEFAULT_STORAGE`.

    Laid out for the client's default query: without its compute-capability filter the two
    cheapest it takes are an RTX 5090 and a B200 (GPUs the image cannot compile for); with it,
    the two cheapest are slow-download hosts (the first is offer 4_100_000) and, past those, an RTX
    3090 and an RTX 4090 with good downloads. Some offers a careful query must skip: unverified,
    unreliable, two GPUs, a CUDA too old, and a price over $2/h."""
    kinds = [
        # gpu_name, gpu_ram MB, compute_cap, cuda, dph_base, storage_cost, reliability, verified,
        # num_gpus, inet_down, direct_port_count, geolocation
        ("RTX 3060", 12288, 860, 12.4, 0.34, 0.10, 0.985, True, 1, 80.0, 16, "Vietnam, VN"),
        ("RTX 5090", 32607, 1200, 12.8, 0.27, 0.15, 0.993, True, 1, 1800.0, 100, "Texas, US"),
        ("B200", 183359, 1000, 12.9, 0.30, 0.20, 0.997, True, 1, 10000.0, 500, "Virginia, US"),
        ("RTX 4060 Ti", 16380, 890, 12.6, 0.35, 0.10, 0.982, True, 1, 50.0, 8, "India, IN"),
        ("RTX 3090", 24576, 860, 12.4, 0.38, 0.08, 0.995, True, 1, 900.0, 50, "Poland, PL"),
        ("RTX 4090", 24564, 890, 12.6, 0.42, 0.12, 0.998, True, 1, 2500.0, 50, "Sweden, SE"),
        ("RTX A6000", 49140, 860, 12.4, 0.47, 0.10, 0.991, True, 1, 600.0, 0, "Germany, DE"),
        ("L40S", 46068, 890, 12.8, 0.79, 0.25, 0.996, True, 1, 5000.0, 40, "Quebec, CA"),
        ("A100 SXM4", 81920, 800, 12.4, 1.05, 0.30, 0.997, True, 1, 3000.0, 100, "Oregon, US"),
        ("H100 SXM", 81559, 900, 12.8, 2.15, 0.50, 0.999, True, 1, 10000.0, 200, "Iowa, US"),
        ("V100 SXM2", 16384, 700, 12.2, 0.14, 0.05, 0.99, True, 1, 1000.0, 30, "Brazil, BR"),
        ("GTX 1080 Ti", 11264, 610, 11.8, 0.07, 0.05, 0.99, True, 1, 500.0, 10, "Brazil, BR"),
        ("RTX 2080 Ti", 11264, 750, 12.4, 0.11, 0.08, 0.97, False, 1, 300.0, 20, "Vietnam, VN"),
        ("RTX 3090", 24576, 860, 12.4, 0.12, 0.10, 0.97, False, 1, 700.0, 20, "Vietnam, VN"),
        ("Tesla T4", 15360, 750, 12.4, 0.09, 0.10, 0.81, True, 1, 1000.0, 0, "Ohio, US"),
        ("RTX 3080", 10240, 860, 12.4, 0.09, 0.10, 0.81, True, 1, 400.0, 0, "Ohio, US"),
        ("RTX 4090", 24564, 890, 12.6, 0.62, 0.12, 0.996, True, 2, 2000.0, 50, "Norway, NO"),
        ("RTX 3090", 24576, 860, 12.4, 0.30, 0.08, 0.99, True, 2, 900.0, 50, "Norway, NO"),
    ]
    offers = []
    for i, (gpu, ram, cap, cuda, base, storage, rel, verified, n, down, direct, geo) in enumerate(kinds):
        oid = 4_100_000 + 17 * i
        offer = {
            "id": oid,
            "ask_contract_id": oid,
            "bundle_id": 900_000 + i,
            "machine_id": 31_000 + i,
            "host_id": 7_000 + i,
            "gpu_name": gpu,
            "num_gpus": n,
            "gpu_ram": ram,
            "gpu_total_ram": ram * n,
            "gpu_frac": 1.0,
            "gpu_arch": "nvidia",
            "compute_cap": cap,
            "cpu_name": "AMD EPYC 7543 32-Core Processor" if i % 2 else "Intel Xeon Gold 6248R",
            "cpu_cores": 32,
            "cpu_cores_effective": 8.0 * n,
            "cpu_ram": 64_000 * n,
            "disk_space": 200.0,
            "disk_bw": 2000.0,
            "disk_name": "nvme",
            "dph_base": base,
            "storage_cost": storage,
            "inet_up": round(down / 2, 1),
            "inet_down": down,
            "inet_up_cost": 0.0,
            "inet_down_cost": 0.0,
            "reliability": rel,
            "reliability2": rel,
            "cuda_max_good": cuda,
            "driver_version": DRIVERS[cuda],
            "verification": "verified" if verified else "unverified",
            "verified": verified,
            "rentable": True,
            "rented": False,
            "external": False,
            "geolocation": geo,
            "dlperf": 40.0 * n,
            "total_flops": 80.0 * n,
            "pcie_bw": 24.0,
            "direct_port_count": direct,
            "duration": 2_592_000.0,
            "min_bid": round(base * 0.5, 4),
            "is_bid": False,
            "start_date": 1.7e9,
            "end_date": 1.8e9,
            "static_ip": True,
            "hosting_type": 0,
            "public_ipaddr": "127.0.0.1",
            "score": 100.0 - i,
        }
        offers.append(priced(offer, DEFAULT_STORAGE))
    return offers


def storage_price(offer: Mapping[str, Any], gb: float) -> float:
    """$/hour for ``gb`` GB of the offer's storage (its ``storage_cost`` is $/GB/month)."""
    return float(offer.get("storage_cost") or 0.0) * gb / HOURS_PER_MONTH


def price(offer: Mapping[str, Any], gb: float) -> float:
    """The offer's ``dph_total`` with ``gb`` GB of storage: its ``dph_base`` and the storage's
    price (an offer without ``dph_base``, as a hand-written catalogue may give, keeps its own)."""
    if "dph_base" not in offer:
        return float(offer["dph_total"])
    return float(offer["dph_base"]) + storage_price(offer, gb)


def priced(offer: Mapping[str, Any], gb: float) -> dict[str, Any]:
    """A copy of ``offer`` as a search for ``gb`` GB of allocated storage shows it."""
    total = price(offer, gb)
    out = {**offer, "dph_total": total, "storage_total_cost": storage_price(offer, gb)}
    if "dlperf" in offer:
        out["dlperf_per_dphtotal"] = round(offer["dlperf"] / total, 2) if total else 0.0
    return out


def allocated_storage(query: Mapping[str, Any]) -> float:
    """The GB a query prices offers for (``allocated_storage``; absent: :data:`DEFAULT_STORAGE`);
    ValueError if it is not a number >= 0."""
    raw = query.get("allocated_storage")
    if raw is None:
        return DEFAULT_STORAGE
    try:
        gb = float(raw)
    except (TypeError, ValueError):
        raise ValueError(f"allocated_storage must be a number of GB, got {raw!r}") from None
    if not gb >= 0:
        raise ValueError(f"allocated_storage must be a number of GB >= 0, got {raw!r}")
    return gb


OPS: dict[str, Callable[[Any, Any], bool]] = {
    "eq": lambda a, b: a == b,
    "neq": lambda a, b: a != b,
    "gt": lambda a, b: a > b,
    "gte": lambda a, b: a >= b,
    "lt": lambda a, b: a < b,
    "lte": lambda a, b: a <= b,
    "in": lambda a, b: a in b,
    "notin": lambda a, b: a not in b,
    "nin": lambda a, b: a not in b,
}
QUERY_META = {"order", "type", "limit", "allocated_storage", "disable_bundling", "extra_ids"}


def _coerce(have: Any, want: Any) -> Any:
    """The CLI sends some numbers and booleans as strings ("1", "0.99", "true")."""
    if isinstance(want, list):
        return [_coerce(have, w) for w in want]
    if isinstance(have, bool) and isinstance(want, str):
        return want.lower() == "true"
    if isinstance(have, (int, float)) and not isinstance(have, bool) and isinstance(want, str):
        try:
            return float(want)
        except ValueError:
            return want
    return want


def match_offer(offer: Mapping[str, Any], query: Mapping[str, Any]) -> bool:
    for fld, cond in query.items():
        if fld in QUERY_META or not isinstance(cond, dict):
            continue
        if fld not in offer:
            continue  # vast.ai ignores fields it does not know as filters
        for op, want in cond.items():
            if op not in OPS:
                raise ValueError(f"unknown operator {op!r} for {fld}; expected one of {', '.join(OPS)}")
            have = offer[fld]
            try:
                if not OPS[op](have, _coerce(have, want)):
                    return False
            except TypeError:
                return False
    return True


def _sort_key(key: str) -> Callable[[Mapping[str, Any]], tuple[bool, Any]]:
    return lambda o: (o.get(key) is None, o.get(key) or 0)


def _order(order: Any) -> list[tuple[str, str]]:
    if not isinstance(order, list):
        return []
    out = []
    for item in order:
        if isinstance(item, (list, tuple)) and item:
            out.append((str(item[0]), str(item[1]) if len(item) > 1 else "asc"))
    return list(reversed(out))  # stable sorts, the most significant key last


def search(offers: list[dict[str, Any]], query: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The offers that match ``query``, in its ``order``, each a copy priced for its
    ``allocated_storage`` (filtered and ordered by that price); ValueError for an unknown operator
    or a bad ``allocated_storage``."""
    gb = allocated_storage(query)
    found = [p for p in (priced(o, gb) for o in offers) if match_offer(p, query)]
    for key, direction in _order(query.get("order")):
        found.sort(key=_sort_key(key), reverse=direction == "desc")
    return found


def rent(offer: dict[str, Any]) -> None:
    """The offer is taken (by us, or by someone else): searches no longer return it."""
    offer["rentable"], offer["rented"] = False, True


def free(offer: dict[str, Any]) -> None:
    """The offer's machine is free again."""
    offer["rentable"], offer["rented"] = True, False


def widened(
    instances: int, query: Mapping[str, Any], offers: Iterable[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The catalogue (``offers``, default: :func:`default_catalogue`) with enough machines for
    ``instances`` rentals that ``query`` (a search body, ``OfferQuery.body()``) takes: the offers
    it takes first, then copies of the first of them (its cheapest), each a machine and host of its
    own. Unchanged where the query already takes enough, or takes none (nothing to copy: the
    preflight says so)."""
    out = [dict(o) for o in (offers if offers is not None else default_catalogue())]
    found = search(out, query)
    if not found or len(found) >= instances:
        return out
    first = next(o for o in out if o["id"] == found[0]["id"])  # as stored, not as priced for the query
    for i in range(instances - len(found)):
        oid = 4_200_000 + 17 * i
        out.append(
            {
                **first,
                "id": oid,
                "ask_contract_id": oid,
                "bundle_id": 910_000 + i,
                "machine_id": 32_000 + i,
                "host_id": 8_000 + i,
            }
        )
    return out
