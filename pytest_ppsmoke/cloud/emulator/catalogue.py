"""The emulator's catalogue: offers shaped like vast.ai's, and its search (``POST
/api/v0/bundles/``): a query's ``{field: {op: value}}`` filters, its ``order`` and ``limit``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any


def default_catalogue() -> list[dict[str, Any]]:
    """Offers shaped like vast.ai's: single-GPU machines of a few kinds, and some that a careful
    query must skip (unverified, unreliable, two GPUs, an old CUDA)."""
    kinds = [
        # gpu_name, gpu_ram MB, dph_total, reliability, cuda, verified, num_gpus, geolocation
        ("RTX 3090", 24576, 0.21, 0.995, 12.4, True, 1, "Poland, PL"),
        ("RTX 4090", 24564, 0.34, 0.998, 12.6, True, 1, "Sweden, SE"),
        ("RTX 4090", 24564, 0.36, 0.991, 12.6, True, 1, "Texas, US"),
        ("A100 SXM4", 81920, 1.05, 0.997, 12.4, True, 1, "Oregon, US"),
        ("H100 SXM", 81559, 2.19, 0.999, 12.8, True, 1, "Quebec, CA"),
        ("RTX 3090", 24576, 0.12, 0.97, 12.2, False, 1, "Vietnam, VN"),
        ("RTX 3080", 10240, 0.09, 0.81, 12.0, True, 1, "Ohio, US"),
        ("RTX 4090", 24564, 0.68, 0.996, 12.6, True, 2, "Norway, NO"),
        ("GTX 1080 Ti", 11264, 0.07, 0.99, 11.4, True, 1, "Brazil, BR"),
    ]
    offers = []
    for i, (gpu, ram, dph, rel, cuda, verified, n, geo) in enumerate(kinds):
        oid = 4_100_000 + 17 * i
        offers.append(
            {
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
                "compute_cap": 860,
                "cpu_name": "AMD EPYC 7543 32-Core Processor",
                "cpu_cores": 32,
                "cpu_cores_effective": 8.0 * n,
                "cpu_ram": 64_000 * n,
                "disk_space": 200.0,
                "disk_bw": 2000.0,
                "disk_name": "nvme",
                "dph_base": round(dph * 0.9, 4),
                "dph_total": dph,
                "storage_cost": 0.1,
                "inet_up": 800.0,
                "inet_down": 900.0,
                "inet_up_cost": 0.0,
                "inet_down_cost": 0.0,
                "reliability": rel,
                "reliability2": rel,
                "cuda_max_good": cuda,
                "driver_version": "550.54.14",
                "verification": "verified" if verified else "unverified",
                "verified": verified,
                "rentable": True,
                "rented": False,
                "external": False,
                "geolocation": geo,
                "dlperf": 40.0 * n,
                "dlperf_per_dphtotal": round(40.0 * n / dph, 2),
                "total_flops": 80.0 * n,
                "pcie_bw": 24.0,
                "direct_port_count": 50,
                "duration": 2_592_000.0,
                "min_bid": round(dph * 0.5, 4),
                "is_bid": False,
                "start_date": 1.7e9,
                "end_date": 1.8e9,
                "static_ip": True,
                "hosting_type": 0,
                "public_ipaddr": "127.0.0.1",
                "score": 100.0 - i,
            }
        )
    return offers


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
    """The offers that match ``query``, in its ``order``; ValueError for an unknown operator."""
    found = [o for o in offers if match_offer(o, query)]
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
    first = found[0]
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
