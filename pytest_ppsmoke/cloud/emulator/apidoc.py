"""vast.ai's own description of its API, held against every call the emulator answers.

The emulator is the only stand-in in the project, so it answers to what vast.ai publishes, not to
what this project believes: ``openapi/`` holds vast.ai's OpenAPI files for the endpoints the
emulator serves, byte for byte, with ``UPSTREAM`` naming the repository, the commit and each file's
git blob id there (:func:`check_vendored`). :func:`validate_request` and :func:`validate_response`
hold a call against its operation: the path's parameters, the query's, the JSON body and, for an
answer, its status and JSON body, each schema read as OpenAPI 3.0 reads it (``nullable``).

A disagreement that vast.ai's live API is known to accept (vast-cli sends it, or reads it) is in
``openapi/allowed.json``, each entry with its source. An endpoint the document does not describe
(the CLI calls a few at start-up) is there too, as ``undocumented``. Everything else is a
:class:`Violation`, named by its endpoint, where (request, response), field and rule.

The middleware (``api._gate``) fails the call on a violation where ``PP_EMULATOR_OPENAPI`` is
``strict`` (the test suite sets it) and logs it otherwise.

    python -m pytest_ppsmoke.cloud.emulator.apidoc [--upstream CLONE]   # CLONE: a clone, or a plain tree
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from ...protocol import VAST_ENDPOINTS

log = logging.getLogger(__name__)

DOCS = Path(__file__).parent / "openapi"
ENV = "PP_EMULATOR_OPENAPI"  # "strict": a violation fails the call; anything else: it is logged
METHODS = ("get", "put", "post", "delete", "patch")
# libyaml's parser where PyYAML was built with it (the same documents, a tenth of the CPU: the
# pure-Python one took 0.16 s for these files, in every process that starts an emulator or a client)
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def strict() -> bool:
    return os.environ.get(ENV, "") == "strict"


@dataclass(frozen=True)
class Violation:
    """A call that breaks vast.ai's description: ``endpoint`` (``POST /api/v0/bundles/``),
    ``where`` (``request`` or ``response``), ``field`` (a dotted path, list items as ``[]``; the
    part of the call for a missing or undescribed one), ``rule`` (the schema keyword broken, or
    ``undocumented``, ``status``) and what was wrong."""

    endpoint: str
    where: str
    field: str
    rule: str
    message: str
    value: Any = dataclasses.field(default=None, compare=False, repr=False)  # what broke the rule: never shown

    def __str__(self) -> str:
        return f"{self.endpoint} {self.where}: {self.field}: {self.message} ({self.rule})"


@dataclass(frozen=True)
class Operation:
    file: str
    method: str
    template: str
    pattern: re.Pattern[str]
    op: Mapping[str, Any]
    components: Mapping[str, Any]  # the file's components, read as JSON Schema once (its $refs' target)

    @property
    def endpoint(self) -> str:
        return f"{self.method.upper()} {self.template}"


def _openapi30(schema: Any) -> Any:
    """An OpenAPI 3.0 schema as JSON Schema (draft 4, whose ``exclusiveMinimum`` it shares):
    ``nullable: true`` admits null."""
    if isinstance(schema, list):
        return [_openapi30(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _openapi30(v) for k, v in schema.items() if k not in ("nullable", "example", "examples")}
    if schema.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


@functools.cache
def operations() -> tuple[Operation, ...]:
    """Every operation of the vendored files, the most specific path first."""
    ops = []
    for path in sorted(DOCS.glob("*.yaml")):
        doc = yaml.load(path.read_text(), Loader=YAML_LOADER)
        components = _openapi30(doc.get("components") or {})
        for template, item in (doc.get("paths") or {}).items():
            regex = re.sub(r"\\\{[^}]+\\\}", "([^/]+)", re.escape(template))
            for method in METHODS:
                if method in item:
                    ops.append(
                        Operation(path.name, method, template, re.compile(regex + "$"), item[method], components)
                    )
    return tuple(sorted(ops, key=lambda o: -len(o.template)))


def _forms(path: str) -> tuple[str, ...]:
    """A path with and without its trailing slash: vast.ai serves both, and its files name one."""
    return (path, path.rstrip("/") + "/", path.rstrip("/"))


def find(method: str, path: str) -> Operation | None:
    """The described operation a call goes to."""
    for op in operations():
        if op.method == method.lower() and any(op.pattern.match(p) for p in _forms(path)):
            return op
    return None


def _json_path(parts: Iterator[Any] | Any) -> str:
    out = ""
    for p in parts:
        out += "[]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(body)"


def _schema_errors(schema: Any, op: Operation, instance: Any) -> list[tuple[str, str, str, Any]]:
    """(field, rule, message, the value) for each way ``instance`` breaks ``schema`` (refs into
    ``op``'s file's components)."""
    root = {"allOf": [_openapi30(schema)], "components": op.components}
    out = []
    for e in jsonschema.Draft4Validator(root).iter_errors(instance):
        for err in e.context or [e]:  # an anyOf (nullable) names the branch that failed
            field = _json_path(err.absolute_path)
            if err.validator == "required":
                missing = re.match(r"'([^']+)' is a required property", err.message)
                field = (
                    f"{field}.{missing.group(1)}"
                    if missing and field != "(body)"
                    else (missing.group(1) if missing else field)
                )
            out.append((field, str(err.validator), _rule_text(err.validator, err.validator_value), err.instance))
            break
    unique = {(f, r, m): v for f, r, m, v in out}
    return [(f, r, m, v) for (f, r, m), v in sorted(unique.items())]


def _rule_text(rule: Any, value: Any) -> str:
    """What the rule asks, never the value that broke it: a record holds secrets (an instance's
    ``extra_env`` carries the cluster's keys), and a violation is logged and answered."""
    if rule == "type":
        return f"expected type {value!r}"
    if rule == "enum":
        return f"not one of {value!r}"
    if rule == "required":
        return "missing"
    return f"breaks {rule} {json.dumps(value, default=str)[:200]}"


def _coerce(raw: str, schema: Mapping[str, Any]) -> Any:
    """A query or path parameter's text as its schema's type (unparseable text stays text)."""
    kind = schema.get("type")
    try:
        if kind == "integer":
            return int(raw)
        if kind == "number":
            return float(raw)
        if kind == "boolean":
            return {"true": True, "false": False}.get(raw.lower(), raw)
        if kind in ("object", "array"):
            return json.loads(raw)
    except ValueError:
        return raw
    return raw


def validate_request(method: str, path: str, query: Mapping[str, str], body: Any, has_body: bool) -> list[Violation]:
    """How a request breaks its operation: its path and query parameters, its JSON body."""
    op = find(method, path)
    if op is None:
        return [Violation(f"{method} {path}", "request", "(endpoint)", "undocumented", "no operation describes it")]
    out: list[Violation] = []
    match = next(m for m in (op.pattern.match(p) for p in _forms(path)) if m)
    path_values = dict(zip(re.findall(r"\{([^}]+)\}", op.template), match.groups(), strict=True))
    for param in op.op.get("parameters") or []:
        where, name, schema = param.get("in"), param.get("name"), param.get("schema") or {}
        raw = path_values.get(name) if where == "path" else query.get(name) if where == "query" else None
        if raw is None:
            if param.get("required") and where in ("path", "query"):
                out.append(Violation(op.endpoint, "request", f"{where}.{name}", "required", "missing"))
            continue
        for _, rule, msg, value in _schema_errors(schema, op, _coerce(raw, schema)):
            out.append(Violation(op.endpoint, "request", f"{where}.{name}", rule, msg, value))
    content = ((op.op.get("requestBody") or {}).get("content") or {}).get("application/json")
    if content is not None and has_body:
        for name, rule, msg, value in _schema_errors(content.get("schema") or {}, op, body):
            out.append(Violation(op.endpoint, "request", name, rule, msg, value))
    elif content is not None and (op.op.get("requestBody") or {}).get("required"):
        out.append(Violation(op.endpoint, "request", "(body)", "required", "no JSON body"))
    return out


def validate_response(method: str, path: str, status: int, content_type: str, body: bytes) -> list[Violation]:
    """How an answer breaks its operation: a status it does not list, a body that is not JSON
    where JSON is described, a JSON body that breaks the schema given for its status, and an error
    answer without a described ``error`` or ``msg``, or with an ``error`` other than the one its
    description's example gives. A 429 (the rate limiter's) and a 5xx (a server failing, which
    any call may meet) are judged only where described, and only their JSON bodies."""
    op = find(method, path)
    if op is None:
        return []  # named once, for the request
    spec = _response_spec(op, status)
    exempt = status == 429 or status >= 500
    if spec is None:
        if exempt:
            return []
        return [Violation(op.endpoint, "response", "(status)", "status", f"status {status} is not described", status)]
    content = (spec.get("content") or {}).get("application/json")
    if content is None or "schema" not in content:
        return []
    if not content_type.startswith("application/json"):
        if exempt:
            return []
        what = f"a {content_type or 'typeless'} body where JSON is described"
        return [Violation(op.endpoint, "response", "(body)", "json", what, content_type)]
    try:
        data = json.loads(body)
    except ValueError as e:
        return [Violation(op.endpoint, "response", "(body)", "json", f"not JSON: {e}")]
    errors = _schema_errors(content["schema"], op, data)
    out = [Violation(op.endpoint, "response", f, r, m, v) for f, r, m, v in errors]
    if status >= 400 and isinstance(data, dict):
        props = _resolve(content["schema"], op).get("properties") or {}
        for name in ERROR_FIELDS:
            if name in props and name not in data:
                out.append(Violation(op.endpoint, "response", name, "required", "missing"))
        example = (props.get("error") or {}).get("example")
        if example is not None and "error" in data and data["error"] != example:
            what = f"not the described example {example!r}"
            out.append(Violation(op.endpoint, "response", "error", "example", what, data["error"]))
    return out


# --- its error answers and its input limits -----------------------------------------------------


ERROR_FIELDS = ("error", "msg")  # what every described error answer carries; the client reads both


def _operation(endpoint: str) -> Operation:
    """The operation ``endpoint`` (``PUT /api/v0/asks/{id}/``) names."""
    for op in operations():
        if op.endpoint == endpoint:
            return op
    raise KeyError(f"no operation {endpoint} in the vendored files")


def _resolve(schema: Any, op: Operation) -> Mapping[str, Any]:
    """A response schema, its ``$ref`` into the file's components followed (examples kept)."""
    while isinstance(schema, dict) and "$ref" in schema:
        doc = yaml.load((DOCS / op.file).read_text(), Loader=YAML_LOADER)
        node: Any = doc
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        schema = node
    return schema if isinstance(schema, dict) else {}


def _response_spec(op: Operation, status: int) -> Mapping[str, Any] | None:
    responses = op.op.get("responses") or {}
    spec = responses.get(str(status)) or responses.get(f"{str(status)[0]}XX") or responses.get("default")
    return spec if isinstance(spec, dict) else None


def error_schema(endpoint: str, status: int) -> Mapping[str, Any]:
    """The properties the description gives an error answer of ``endpoint`` with ``status``
    (each with its ``example`` and ``enum``, as written); {} where it describes none."""
    op = _operation(endpoint)
    spec = _response_spec(op, status) or {}
    content = (spec.get("content") or {}).get("application/json") or {}
    return _resolve(content.get("schema"), op).get("properties") or {}


def documented_error(
    endpoint: str,
    status: int,
    *,
    error: str | None = None,
    msg: str | None = None,
    path: Mapping[str, Any] | None = None,
    **values: Any,
) -> dict[str, Any]:
    """An error answer of ``endpoint`` as its description gives it for ``status``: every
    property with an example, that example; ``values`` (``ask_id=...``) in place of an example,
    and in the example ``msg`` each example value they replace (the real ask id for 1234567), as
    ``path``'s values replace their path parameters' examples (the instance for 12345).
    ``error`` only where the description gives no example (ValueError otherwise, and for one
    outside the documented enum); ``msg`` in place of the example, where the example is another
    fault's (a 400's names the input it refused): each the emulator's own words, a guess."""
    op = _operation(endpoint)
    props = error_schema(endpoint, status)
    if not props:
        raise ValueError(f"{endpoint}: no error answer {status} is described")
    body: dict[str, Any] = {k: p["example"] for k, p in props.items() if isinstance(p, dict) and "example" in p}
    for name, given in (("error", error), ("msg", msg)):
        if given is None:
            continue
        if name == "error" and name in body:
            raise ValueError(f"{endpoint} {status}: {name} is documented ({body[name]!r}); not {given!r}")
        enum = (props.get(name) or {}).get("enum")
        if enum and given not in enum:
            raise ValueError(f"{endpoint} {status}: {name} {given!r} is not one of {enum!r}")
        body[name] = given
    swaps = [(body.get(name), value) for name, value in values.items()]
    for param in op.op.get("parameters") or []:
        example = param.get("example", (param.get("schema") or {}).get("example"))
        if param.get("in") == "path" and example is not None and param.get("name") in (path or {}):
            swaps.append((example, (path or {})[param["name"]]))
    for example, value in swaps:
        if example is not None and msg is None and isinstance(body.get("msg"), str):
            body["msg"] = body["msg"].replace(str(example), str(value))
    body.update(values)
    missing = [f for f in ERROR_FIELDS if f in props and f not in body]
    if missing:
        raise ValueError(f"{endpoint} {status}: the description gives no example of {missing}; pass them")
    return body


def input_limits(endpoint: str) -> Mapping[str, Mapping[str, Any]]:
    """The ``x-input-validation`` of ``endpoint`` (``PUT /api/v0/asks/{id}/``), from the one table
    of vast.ai's limits (``cloud/vastdoc.py``): field -> its limits (``max_length``,
    ``max_total_length``, ``min``, ``max``), as written."""
    from .. import vastdoc

    method, route = endpoint.split(" ", 1)
    name = VAST_ENDPOINTS.get((method, route))
    limits = vastdoc.input_limits().get(name or "", {})
    return {k: {n: v for n, v in lim.items() if n != "description"} for k, lim in limits.items()}


def _env_flags(env: Any) -> tuple[list[str], str]:
    """``env``'s values and the docker flags it stands for: the described string as sent; an
    object (what vast-cli's ``parse_env`` makes of those flags) as ``-e NAME=value`` per variable
    and its ``-p``/``-v``/``-n`` keys (``"-p 7000:7000/udp": "1"``) as they are, joined by spaces."""
    if isinstance(env, str):
        words = env.split()
        values = [w.split("=", 1)[1] for i, w in enumerate(words) if i and words[i - 1] == "-e" and "=" in w]
        return values, env
    if isinstance(env, dict):
        from .. import vastdoc

        return [str(v) for k, v in env.items() if not str(k).startswith("-")], vastdoc.env_flags(env)
    return [], ""


def _measure(field: str, body: Mapping[str, Any]) -> tuple[list[tuple[str, Any]], Any]:
    """What a limit on ``field`` measures: (each part's name and value, the whole)."""
    if field == "args":  # "Combined length of args, args_str and onstart"
        parts = [str(a) for a in body.get("args") or [] if a is not None]
        parts += [str(body[k]) for k in ("args_str", "onstart") if isinstance(body.get(k), str)]
        return [], "".join(parts)
    if field == "env":
        values, flags = _env_flags(body.get("env"))
        return [("env value", v) for v in values], flags
    return [], body.get(field)


def over_limits(endpoint: str, body: Any) -> list[tuple[str, str]]:
    """(field, what it breaks) for each ``x-input-validation`` limit of ``endpoint`` that
    ``body`` breaks; never the value (an env carries secrets)."""
    if not isinstance(body, dict):
        return []
    out = []
    for field, limits in input_limits(endpoint).items():
        if field not in body and field != "args":
            continue
        parts, whole = _measure(field, body)
        if "max_length" in limits:
            n = limits["max_length"]
            if parts and any(isinstance(v, str) and len(v) > n for _, v in parts):
                out.append((field, f"a value longer than its max_length {n}"))
            elif not parts and isinstance(whole, str) and len(whole) > n:
                out.append((field, f"{len(whole)} characters, over its max_length {n}"))
        total = limits.get("max_total_length")
        if total is not None and isinstance(whole, str) and len(whole) > total:
            out.append((field, f"{len(whole)} characters in all, over its max_total_length {total}"))
        number = whole if isinstance(whole, (int, float)) and not isinstance(whole, bool) else None
        if number is not None and "min" in limits and number < limits["min"]:
            out.append((field, f"under its min {limits['min']:g}"))
        if number is not None and "max" in limits and number > limits["max"]:
            out.append((field, f"over its max {limits['max']:g}"))
    return out


# --- what vast.ai's live API is known to accept, against its description --------------------------


JSON_TYPES = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null", int: "number"}


def json_type(value: Any) -> str:
    return JSON_TYPES.get(type(value), "number")


@dataclass(frozen=True)
class Allowed:
    """A disagreement the live API is known to accept. ``allows``: for a ``type`` rule the JSON
    types accepted besides the described one, for ``enum`` and ``example`` the values, for
    ``status`` the statuses; empty: any (a rule the
    description misplaces, as ``order``'s ``minItems``)."""

    endpoint: str
    where: str
    field: str
    rule: str
    allows: tuple[Any, ...]
    source: str
    why: str

    def covers(self, v: Violation) -> bool:
        if self.rule == "undocumented":
            return v.rule == "undocumented" and self.endpoint == v.endpoint
        if (self.endpoint, self.where, self.field, self.rule) != (v.endpoint, v.where, v.field, v.rule):
            return False
        if self.rule == "type":
            return json_type(v.value) in self.allows
        if self.rule in ("enum", "status", "example"):
            return v.value in self.allows
        return not self.allows


@functools.cache
def allowed() -> tuple[Allowed, ...]:
    """``openapi/allowed.json``: each entry names its endpoint, where, field, rule, its source
    (a vast-cli path, a doc page) and why; ValueError for an entry without a source."""
    entries = json.loads((DOCS / "allowed.json").read_text())
    out = []
    for i, e in enumerate(entries):
        if not str(e.get("source", "")).strip():
            raise ValueError(f"openapi/allowed.json entry {i} ({e.get('endpoint')} {e.get('field')}): no source")
        if e["rule"] in ("type", "enum", "status", "example") and not e.get("allows"):
            what = f"{e['endpoint']} {e['field']}"
            raise ValueError(f"openapi/allowed.json entry {i} ({what}): a {e['rule']} rule needs allows")
        allows = tuple(e.get("allows") or ())
        out.append(Allowed(e["endpoint"], e["where"], e["field"], e["rule"], allows, e["source"], e["why"]))
    return tuple(out)


def unexplained(violations: list[Violation]) -> list[Violation]:
    """The violations no entry of the allow-list covers."""
    return [v for v in violations if not any(a.covers(v) for a in allowed())]


# --- the vendored files against their upstream ------------------------------------------------------


def blob_id(data: bytes) -> str:
    """A file's git blob id, as ``git hash-object`` computes it."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data, usedforsecurity=False).hexdigest()


def upstream() -> dict[str, str]:
    """``UPSTREAM``'s header (repository, commit, date, path) and its files' blob ids by name."""
    head: dict[str, str] = {}
    for line in (DOCS / "UPSTREAM").read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition(": ")
        if sep:
            head[key] = value
        else:
            blob, name = line.split()
            head[f"file:{name}"] = blob
    return head


def check_vendored() -> list[str]:
    """What differs: each vendored file against the blob id ``UPSTREAM`` names, every file named
    there present and none unnamed."""
    named = _named()
    have = {p.name for p in DOCS.glob("*.yaml")}
    problems = [f"{n}: vendored but not in UPSTREAM" for n in sorted(have - set(named))]
    problems += [f"{n}: in UPSTREAM but not vendored" for n in sorted(set(named) - have)]
    for name in sorted(have & set(named)):
        got = blob_id((DOCS / name).read_bytes())
        if got != named[name]:
            problems.append(f"{name}: blob {got}, UPSTREAM names {named[name]} (the file was changed)")
    return problems


def _named() -> dict[str, str]:
    return {k[5:]: v for k, v in upstream().items() if k.startswith("file:")}


class NotATree(ValueError):
    """``--upstream`` names something that is not a tree of the repository ``UPSTREAM`` names."""


def _git(clone: Path, *args: str) -> str:
    try:
        done = subprocess.run(["git", "-C", str(clone), *args], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NotATree(f"git {' '.join(args)} in {clone}: {e}") from None
    if done.returncode != 0:
        raise NotATree(f"git {' '.join(args)} in {clone}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def _is_git(clone: Path) -> bool:
    """A clone (its work tree, or a bare one) rather than a plain tree (``git archive``'s)."""
    return (clone / ".git").exists() or ((clone / "HEAD").is_file() and (clone / "objects").is_dir())


def _tree_blobs(clone: Path, commit: str, path: str) -> dict[str, str]:
    """The blob ids of the files directly under ``path`` at ``commit``, by name."""
    out = {}
    for line in _git(clone, "ls-tree", commit, "--", path).splitlines():
        meta, _, name = line.partition("\t")
        parts = meta.split()
        if len(parts) == 3 and parts[1] == "blob":
            out[name.rsplit("/", 1)[-1]] = parts[2]
    return out


def changed_upstream(clone: Path) -> tuple[str, list[str]]:
    """Each vendored file that changed upstream since ``UPSTREAM``'s commit: ``clone`` is a clone
    of the repository (its newest commit, ``HEAD``, against the blob ids at ``UPSTREAM``'s commit,
    which, where the clone holds that commit, are checked to be the ones ``UPSTREAM`` names) or a
    plain tree of it, as ``git archive`` writes one (each file hashed as git hashes it). Returns
    what was compared (for the report) and one line per difference; NotATree when ``clone`` is
    neither."""
    up, named = upstream(), _named()
    where = up["path"].rstrip("/")
    problems: list[str] = []
    if _is_git(clone):
        newest = _git(clone, "rev-parse", "HEAD").strip()
        if _has(clone, up["commit"]):
            then = _tree_blobs(clone, up["commit"], where + "/")
            for name, blob in sorted(named.items()):
                if then.get(name) != blob:
                    problems.append(f"{name}: {up['repository']} at {up['commit'][:12]} has {then.get(name)}, "
                                    f"not {blob} (UPSTREAM is wrong)")  # fmt: skip
        now = _tree_blobs(clone, newest, where + "/")
        what = f"{clone}'s newest commit, {newest[:12]}"
    else:
        tree = clone / where
        if not tree.is_dir():
            raise NotATree(f"{clone} is neither a clone of {up['repository']} nor a tree of it (no {up['path']})")
        now = {p.name: blob_id(p.read_bytes()) for p in tree.iterdir() if p.is_file()}
        what = f"the tree {clone} (no git: its files hashed as git does)"
    for name, blob in sorted(named.items()):
        if name not in now:
            problems.append(f"{name}: removed upstream since {up['commit'][:12]} (not in {what})")
        elif now[name] != blob:
            problems.append(
                f"{name}: changed upstream since {up['commit'][:12]}: blob {blob} then, {now[name]} in {what}"
            )
    return what, problems


def _has(clone: Path, commit: str) -> bool:
    """Whether the clone holds ``commit`` (a shallow clone may not)."""
    try:
        _git(clone, "cat-file", "-e", f"{commit}^{{commit}}")
    except NotATree:
        return False
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m pytest_ppsmoke.cloud.emulator.apidoc", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--upstream",
        type=Path,
        help="a clone of the repository UPSTREAM names, or a plain tree of it: name each vendored file "
        "changed there since UPSTREAM's commit",
    )
    args = p.parse_args(argv)
    problems = check_vendored()
    up = upstream()
    compared = ""
    if args.upstream is not None:
        try:
            compared, changed = changed_upstream(args.upstream)
        except NotATree as e:
            print(f"apidoc: --upstream: {e}", file=sys.stderr)
            sys.exit(2)
        problems += changed
    for line in problems:
        print(f"apidoc: {line}", file=sys.stderr)
    if not problems:
        print(f"apidoc: {len(operations())} operations in {len(list(DOCS.glob('*.yaml')))} files equal "
              f"{up['repository']} at {up['commit']} ({up['date']})"
              + (f", and none changed since in {compared}" if compared else ""))  # fmt: skip
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
