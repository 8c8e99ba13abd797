"""The run report is typed all the way down, and its shipped schema is the one the types make.

``Report``'s fields, and the fields of every dataclass reachable from it, are typed only with
primitives (str, int, float, bool, None), enums, the package's dataclasses, and lists, tuples and
``dict[str, X]`` maps of them (read from the source, not the running classes: an ``Any`` a
``from __future__ import annotations`` hides is seen). ``report.schema.json`` is what
:func:`json_schema` generates; every field of every part is a key of the schema and every key of
the schema a field, both ways round, in the types and in a report with every part filled.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import json
import types
import typing
from pathlib import Path
from typing import Any

import pytest

import pytest_ppsmoke
from pytest_ppsmoke.harness import report as report_module
from pytest_ppsmoke.harness.figures import ApiFigures, InstanceFigures, NodeState, SkippedOffer
from pytest_ppsmoke.harness.report import (
    REGENERATE,
    SCHEMA_FILE,
    Report,
    json_schema,
    parse,
    schema,
    schema_problems,
    schema_text,
)

pytestmark = pytest.mark.local

PACKAGE = Path(pytest_ppsmoke.__file__).parent
PRIMITIVES = {"str", "int", "float", "bool", "None"}
CONTAINERS = {"list", "tuple", "dict"}


# --- the types, from the source ------------------------------------------------------------------


Classes = dict[str, tuple[ast.ClassDef, Path]]


REPORT = (PACKAGE / "harness" / "report.py", PACKAGE / "harness" / "figures.py")


def _classes(here: tuple[Path, ...] = REPORT) -> Classes:
    """Every class of the package by name: the names of ``here``'s own first (where the report
    and its parts live; a lower layer's class of the same name is another)."""
    out: Classes = {}
    for path in [*here, *sorted(PACKAGE.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, (node, path))
    return out


def _is_dataclass(node: ast.ClassDef) -> bool:
    return any(
        (isinstance(d, ast.Name) and d.id == "dataclass")
        or (isinstance(d, ast.Call) and isinstance(d.func, ast.Name) and d.func.id == "dataclass")
        or (isinstance(d, ast.Attribute) and d.attr == "dataclass")
        for d in node.decorator_list
    )


def _is_enum(node: ast.ClassDef) -> bool:
    return any(ast.unparse(b).split(".")[-1] in ("Enum", "StrEnum", "IntEnum") for b in node.bases)


def _fields(node: ast.ClassDef, classes: Classes) -> list[tuple[str, ast.expr]]:
    """A dataclass's fields with their annotations, its dataclass bases' first."""
    out = []
    for base in node.bases:
        if isinstance(base, ast.Name) and base.id in classes and _is_dataclass(classes[base.id][0]):
            out += _fields(classes[base.id][0], classes)
    for stmt in node.body:
        named = isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
        if named and not ast.unparse(stmt.annotation).startswith("ClassVar"):
            out.append((stmt.target.id, stmt.annotation))
    return out


def _refused(annotation: ast.expr, classes: Classes, found: set[str]) -> list[str]:
    """What in ``annotation`` is not an allowed report type; the dataclasses it names go to ``found``."""
    if isinstance(annotation, ast.Constant) and annotation.value is None:
        return []
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):  # a quoted annotation
        return _refused(ast.parse(annotation.value, mode="eval").body, classes, found)
    if isinstance(annotation, ast.BinOp) and isinstance(annotation.op, ast.BitOr):
        return _refused(annotation.left, classes, found) + _refused(annotation.right, classes, found)
    if isinstance(annotation, ast.Name):
        if annotation.id in PRIMITIVES:
            return []
        known = classes.get(annotation.id)
        if known is not None and _is_enum(known[0]):
            return []
        if known is not None and _is_dataclass(known[0]):
            found.add(annotation.id)
            return []
        return [annotation.id]
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name):
        outer = annotation.value.id
        args = annotation.slice.elts if isinstance(annotation.slice, ast.Tuple) else [annotation.slice]
        if outer not in CONTAINERS:
            return [ast.unparse(annotation)]
        if outer == "dict" and (len(args) != 2 or ast.unparse(args[0]) != "str"):
            return [ast.unparse(annotation)]  # a map is keyed by strings
        if outer == "list" and len(args) != 1:
            return [ast.unparse(annotation)]
        return [
            bad
            for a in args
            if not (outer == "tuple" and isinstance(a, ast.Constant) and a.value is Ellipsis)
            for bad in _refused(a, classes, found)
        ]
    return [ast.unparse(annotation)]  # Any, object, Mapping, a bare dict, a TypedDict's name ...


def _report_parts() -> tuple[dict[str, list[str]], set[str]]:
    """Each dataclass reachable from Report (by the source) and what its fields are refused for."""
    classes = _classes()
    todo, seen, refused = ["Report"], set(), {}
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        node, path = classes[name]
        assert _is_dataclass(node), f"{name} ({path}) is a part of the report but not a dataclass"
        found: set[str] = set()
        bad = [f"{field}: {what}" for field, ann in _fields(node, classes) for what in _refused(ann, classes, found)]
        if bad:
            refused[f"{name} ({path.relative_to(PACKAGE.parent)})"] = bad
        todo += sorted(found - seen)
    return refused, seen


def test_every_part_of_the_report_is_typed_only_with_primitives_enums_dataclasses_and_their_containers() -> None:
    refused, parts = _report_parts()
    assert not refused, f"report fields typed with what a schema cannot name all the keys of: {refused}"
    assert {"Report", "ReferenceFigures", "Frames", "FrameWindow", "InstanceFigures", "SwimFigures"} <= parts


@pytest.mark.parametrize(
    "annotation",
    ["Any", "object", "Mapping[str, int]", "dict", "dict[int, str]", "list[Any]", "dict[str, Any] | None", "Hops"],
)
def test_the_type_check_refuses_what_names_no_keys(annotation: str) -> None:
    """An annotation the check must refuse: ``Hops`` stands for a class that is no dataclass."""
    classes = {"Hops": (ast.parse("class Hops(TypedDict):\n    a: int").body[0], Path("x.py"))}
    refused = _refused(ast.parse(annotation, mode="eval").body, classes, set())  # type: ignore[arg-type]
    assert refused, annotation


def test_the_type_check_takes_what_a_report_may_hold() -> None:
    classes = _classes()
    for annotation in ("list[tuple[int, int]] | None", "dict[str, FrameWindow]", "NodeState | None", "tuple[int, ...]"):
        assert _refused(ast.parse(annotation, mode="eval").body, classes, set()) == [], annotation


# --- the schema, from the types ------------------------------------------------------------------


def test_the_shipped_schema_is_the_one_the_dataclasses_generate() -> None:
    shipped = (Path(report_module.__file__).parent / SCHEMA_FILE).read_text()
    assert shipped == schema_text(), f"{SCHEMA_FILE} is stale; regenerate it: {REGENERATE}"
    assert schema() == json_schema()


def _hinted_parts(cls: type, out: dict[str, type]) -> dict[str, type]:
    """Every dataclass reachable from ``cls`` through its type hints, by name."""
    out[cls.__name__] = cls
    for hint in typing.get_type_hints(cls).values():
        for part in _dataclasses_in(hint):
            if part.__name__ not in out:
                _hinted_parts(part, out)
    return out


def _dataclasses_in(hint: Any) -> list[type]:
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return [hint]
    return [d for a in typing.get_args(hint) for d in _dataclasses_in(a)]


def test_every_field_is_a_key_of_the_schema_and_every_key_a_field() -> None:
    """Walked both ways over the types: each dataclass reachable from Report is a ``$defs`` entry
    with exactly its fields as keys, all required, no other allowed; each ``$defs`` entry is one
    of them."""
    s = schema()
    parts = _hinted_parts(Report, {})
    assert set(s["$defs"]) == set(parts) - {"Report"}, "a part without a $defs entry, or an entry of no part"
    for name, cls in parts.items():
        where = s if cls is Report else s["$defs"][name]
        fields = [f.name for f in dataclasses.fields(cls)]
        keys = [k for k in where["properties"] if not (cls is Report and k == "schema_version")]
        missing, extra = set(fields) - set(keys), set(keys) - set(fields)
        assert not missing, f"{name}'s fields {sorted(missing)} are not in {SCHEMA_FILE}"
        assert not extra, f"{SCHEMA_FILE} names {sorted(extra)} in {name}, which has no such field"
        assert where["additionalProperties"] is False and set(where["required"]) == set(where["properties"]), name


def _filled(hint: Any, depth: int = 0) -> Any:
    """A value of ``hint`` with every optional part present and every list and map one long."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return _filled(next(a for a in args if a is not type(None)), depth)
    if origin is list:
        return [_filled(args[0], depth)]
    if origin is tuple:
        return tuple(_filled(a, depth) for a in args if a is not Ellipsis)
    if origin is dict:
        return {"k": _filled(args[1], depth)}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        return hint(**{f.name: _filled(hints[f.name], depth + 1) for f in dataclasses.fields(hint)})
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return next(iter(hint))
    return {str: "x", int: 1, float: 1.5, bool: True}[hint]


def _walk(value: Any, node: dict[str, Any], defs: dict[str, Any], where: str) -> list[str]:
    """Where a JSON value and its schema disagree on an object's keys, either way round."""
    if "anyOf" in node:
        node = next(n for n in node["anyOf"] if n.get("type") != "null")
    if "$ref" in node:
        node = defs[node["$ref"].rsplit("/", 1)[1]]
    out = []
    if isinstance(value, dict) and "properties" in node:
        keys, named = set(value), set(node["properties"])
        out += [f"{where}.{k}: in the report, not the schema" for k in sorted(keys - named)]
        out += [f"{where}.{k}: in the schema, not the report" for k in sorted(named - keys)]
        for k in sorted(keys & named):
            out += _walk(value[k], node["properties"][k], defs, f"{where}.{k}")
    elif isinstance(value, dict):
        for k, v in value.items():
            out += _walk(v, node.get("additionalProperties", {}), defs, f"{where}[{k}]")
    elif isinstance(value, list):
        items = node.get("prefixItems") or [node.get("items", {})] * len(value)
        for i, (v, n) in enumerate(zip(value, items, strict=False)):
            out += _walk(v, n, defs, f"{where}[{i}]")
    return out


def test_a_report_with_every_part_filled_has_the_schemas_keys_and_validates() -> None:
    """The walk over a report, every optional part present: a field missing from the schema and
    a key of the schema missing from the report both show; it validates; it parses back."""
    full: Report = _filled(Report)
    data = full.to_json()
    s = schema()
    assert _walk(data, s, s["$defs"], "report") == []
    assert schema_problems(data) == []
    assert parse(Report, {k: v for k, v in data.items() if k != "schema_version"}) == full
    data["swim"]["nodes"]["k"]["extra"] = 1
    del data["instances"][0]["offer"]["gpu_name"]
    assert _walk(data, s, s["$defs"], "report") == [
        "report.instances[0].offer.gpu_name: in the schema, not the report",
        "report.swim.nodes[k].extra: in the report, not the schema",
    ]
    assert len(schema_problems(data)) == 2


def test_write_checks_the_report_against_the_schema(tmp_path: Path) -> None:
    """A report that does not match its schema is written (its figures are kept) and refused."""
    good = Report("local", "m", "hi", 4, 2, "bf16")
    good.write(tmp_path / "good.json")
    assert json.loads((tmp_path / "good.json").read_text()) == good.to_json()
    bad = Report("local", "m", "hi", 4, 2, "bf16")
    bad.max_tokens = "4"  # type: ignore[assignment]
    with pytest.raises(ValueError, match="max_tokens: '4' is not of type 'integer'"):
        bad.write(tmp_path / "bad.txt")
    assert (tmp_path / "bad.txt").exists()


def test_parse_checks_every_key_and_type_of_a_lower_layers_record() -> None:
    offer = {"stage": 0, "offer": 7, "dph_total": 1, "status": None, "error": "gone"}
    assert parse(list[SkippedOffer], [offer]) == [SkippedOffer(0, 7, 1.0, None, "gone")]
    with pytest.raises(TypeError, match="SkippedOffer has no field price"):
        parse(SkippedOffer, {**offer, "price": 1})
    with pytest.raises(TypeError, match=r"SkippedOffer.offer: expected int, got '7'"):
        parse(SkippedOffer, {**offer, "offer": "7"})
    with pytest.raises(TypeError, match="missing 1 required positional argument: 'error'"):
        parse(SkippedOffer, {k: v for k, v in offer.items() if k != "error"})
    with pytest.raises(TypeError, match="expected int, got True"):
        parse(SkippedOffer, {**offer, "offer": True})
    api = parse(ApiFigures, {"calls": 2, "endpoints": {"/bundles/": {"calls": 2}}})
    assert api.endpoints["/bundles/"].calls == 2 and api.rate_limited == 0
    with pytest.raises(TypeError, match="is not one of"):
        parse(NodeState, "asleep")
    inst: InstanceFigures = _filled(InstanceFigures)
    assert parse(InstanceFigures, dataclasses.asdict(inst) | {"node_state": "hung"}).node_state is NodeState.HUNG


def test_the_reports_enums_are_the_tables_they_stand_for() -> None:
    """The report's closed sets are the package's own tables: the modes, the wire dtypes, where
    a reference loads, and how the emulator takes a host away (its failpoints' words)."""
    from pytest_ppsmoke.cloud.emulator import faults
    from pytest_ppsmoke.harness.figures import LossKind, Mode, ReferenceLoad, WireDtype
    from pytest_ppsmoke.harness.settings import MODES
    from pytest_ppsmoke.nodeenv import REFERENCES
    from pytest_ppsmoke.protocol import WIRE_DTYPES

    assert tuple(Mode) == MODES and tuple(WireDtype) == WIRE_DTYPES
    assert set(ReferenceLoad) == set(REFERENCES)
    source = Path(faults.__file__).read_text()
    for kind in LossKind:  # each is a word the emulator's host losses are recorded with
        assert f'"{kind}"' in source, kind
    schema_of = json_schema()
    assert schema_of["properties"]["mode"] == {"enum": ["local", "vastai"]}
    assert schema_problems(
        {**json.loads(json.dumps(Report(Mode.LOCAL, "m", "p", 1, 2, WireDtype.BF16).to_json())), "wire_dtype": "f64"}
    )
