"""The package's layers (docs/code.md): every import, at module level, inside a function or under
``if TYPE_CHECKING:``, points down the list or within its layer, and no two modules import each
other, directly or round a loop. ``cloud/`` reaches none of the cluster's modules. Loading the
plugin imports only the standard library, pytest and the settings table."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

import pytest_ppsmoke

# in the suite that .ci/run and the README's command run (-m local): a check that never runs checks nothing
pytestmark = pytest.mark.local

PACKAGE = Path(pytest_ppsmoke.__file__).parent

# top to bottom, as docs/code.md lists them; a module is in the layer of its longest prefix here
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("face", ("plugin", "distributed", "nodeids", "spec", "harness.cli")),
    ("layout", ("layout",)),
    ("harness", ("harness",)),
    ("stage", ("stage",)),
    ("cloud", ("cloud",)),
    ("network", ("network",)),
    ("messages", ("messages",)),  # arriving from another branch; absent until then
    ("runtime", ("runtime",)),
    # "": the package's __init__; stage.catalog, the models' declarations, standard library only
    ("shared", ("", "protocol", "nodeenv", "failpoints", "checks", "redact", "stage.catalog")),
)


def modules() -> dict[str, Path]:
    """Every module of the package, by dotted name below the package ("" for its __init__)."""
    return dict(_modules())


@functools.cache
def _modules() -> dict[str, Path]:
    """:func:`modules`, found once: the package does not change while the suite runs, and the
    chains of imports name a file for every arrow (:func:`where`)."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def layer_of(module: str) -> int:
    best, found = -1, None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".") or p == "") and len(p) > best:
                best, found = len(p), i
    assert found is not None, f"{module} is in no layer"
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, module imported) for every import of the package in ``path``, functions' included."""
    is_pkg = path.name == "__init__.py"
    here = module.split(".") if module else []
    package = here if is_pkg else here[:-1]
    found = []

    def resolve(name: str) -> str:
        while name not in known and name:
            name = name.rpartition(".")[0]
        return name

    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "pytest_ppsmoke" or alias.name.startswith("pytest_ppsmoke."):
                    found.append((node.lineno, resolve(alias.name.removeprefix("pytest_ppsmoke").lstrip("."))))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                target = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module == "pytest_ppsmoke" or (node.module or "").startswith("pytest_ppsmoke."):
                target = (node.module or "").removeprefix("pytest_ppsmoke").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from . import failpoints` imports a module
                sub = f"{target}.{alias.name}" if target else alias.name
                found.append((node.lineno, sub if sub in known else resolve(target)))
    return [(line, t) for line, t in found if t != module]


def graph() -> dict[str, list[tuple[int, str]]]:
    """Every module's imports, those under ``if TYPE_CHECKING:`` included: a type named is a
    dependency as much as a function called. A copy of the graph parsed once (:func:`_graph`),
    which a test may change (a deliberate break) without changing another's."""
    return {m: list(targets) for m, targets in _graph().items()}


@functools.cache
def _graph() -> dict[str, list[tuple[int, str]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def where(module: str) -> str:
    return str(modules()[module].relative_to(PACKAGE.parent))


def up_arrows(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    out = []
    for m, targets in edges.items():
        for line, t in targets:
            if layer_of(t) < layer_of(m):
                out.append(
                    f"{where(m)}:{line} imports pytest_ppsmoke.{t} ({LAYERS[layer_of(t)][0]}), "
                    f"above its own layer ({LAYERS[layer_of(m)][0]})"
                )
    return out


def cycles(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    """Each import cycle once: every group of modules that reach each other (a strongly connected
    component, Tarjan's), with the file and line of each arrow inside it. An arrow lies on a cycle
    exactly when both its ends are in one group, so the arrows listed are those to cut. Linear in
    the arrows: listing the loops one by one grows with the number of paths."""
    succ = {m: {t: line for line, t in reversed(ts)} for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []
    for root in sorted(succ):
        if root in index:
            continue
        work = [(root, iter(sorted(succ.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while (top := stack.pop()) != node:
                        group.append(top)
                    groups.append(sorted([node, *group]))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                work.append((child, iter(sorted(succ.get(child, {})))))
            elif child in stack:
                low[node] = min(low[node], index[child])
    out = []
    for group in groups:
        inside = set(group)
        arrows = [f"{where(a)}:{succ[a][b]} -> {where(b)}" for a in group for b in sorted(succ[a]) if b in inside]
        if arrows:  # a group of one is a cycle only through an arrow to itself
            out.append("; ".join(arrows))
    return out


# cloud/ rents machines and serves vast.ai's API; the cluster that runs on them sits above it (the
# membership, the codec and the messages): no cloud module reaches these, directly or through another
CLOUD_FORBIDDEN = ("runtime.node", "runtime.cluster", "runtime.swim*", "runtime.codec", "messages")


def forbidden_in_cloud(module: str) -> bool:
    return any(module.startswith(f[:-1]) if f.endswith("*") else module == f for f in CLOUD_FORBIDDEN)


def reached(edges: dict[str, list[tuple[int, str]]], start: str) -> dict[str, list[str]]:
    """Every module ``start`` imports, directly or through others, with one shortest chain of
    imports to it (``file:line`` of each)."""
    chains: dict[str, list[str]] = {start: []}
    queue = [start]
    for m in queue:
        for line, t in edges.get(m, []):
            if t not in chains:
                chains[t] = [*chains[m], f"{where(m)}:{line}"]
                queue.append(t)
    return {t: [*chain, where(t)] for t, chain in chains.items() if t != start}


def cloud_crossings(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    out = []
    for m in sorted(edges):
        if m == "cloud" or m.startswith("cloud."):
            for t, chain in sorted(reached(edges, m).items()):
                if forbidden_in_cloud(t):
                    out.append(f"pytest_ppsmoke.{m} reaches pytest_ppsmoke.{t}: " + " -> ".join(chain))
    return out


# the provider seam (cloud/provider.py): vast.ai's client, its records and the emulator are named
# only inside cloud/ and by harness/setup.py (where a run picks its provider); never by the neutral
# modules of cloud/ itself, nor by the in-memory provider of the tests
PROVIDER_MODULES = ("cloud.vast", "cloud.vastrecords", "cloud.vastdoc", "cloud.createlimits", "cloud.emulator")
PROVIDER_NAMERS = ("cloud", "harness.setup")
NEUTRAL = ("cloud.provider", "cloud.rental", "cloud.waits", "cloud.preflight")
TESTS = Path(__file__).resolve().parent
NEUTRAL_TESTS = ("memprovider.py", "test_provider.py")


def names_a_provider(target: str) -> bool:
    return any(target == m or target.startswith(m + ".") for m in PROVIDER_MODULES)


def provider_crossings(edges: dict[str, list[tuple[int, str]]]) -> list[str]:
    out = []
    for m, targets in sorted(edges.items()):
        allowed = any(m == p or m.startswith(p + ".") for p in PROVIDER_NAMERS) and m not in NEUTRAL
        if allowed:
            continue
        out += [f"{where(m)}:{line} imports pytest_ppsmoke.{t}" for line, t in targets if names_a_provider(t)]
    return out


def test_only_cloud_and_the_setup_name_a_provider() -> None:
    problems = provider_crossings(graph())
    assert not problems, "a provider named past the seam (cloud/provider.py):\n" + "\n".join(problems)
    known = modules()
    for name in NEUTRAL_TESTS:  # the in-memory provider and its tests: the seam alone
        found = [(line, t) for line, t in imports(f"tests.{name[:-3]}", TESTS / name, known) if names_a_provider(t)]
        assert not found, f"tests/{name} imports {found}"


def test_the_provider_check_sees_a_deliberate_break() -> None:
    edges = graph()
    edges["harness.driver"] = [*edges["harness.driver"], (3, "cloud.emulator.server")]
    edges["cloud.rental"] = [*edges["cloud.rental"], (4, "cloud.vast")]
    found = provider_crossings(edges)
    assert any("harness/driver.py:3 imports pytest_ppsmoke.cloud.emulator.server" in p for p in found), found
    assert any("cloud/rental.py:4 imports pytest_ppsmoke.cloud.vast" in p for p in found), found
    assert not any("harness/setup.py" in p for p in found), found
    edges["harness.settings"] = [*edges["harness.settings"], (5, "cloud.emulator.registry")]
    assert any(
        "harness/settings.py:5 imports pytest_ppsmoke.cloud.emulator.registry" in p for p in provider_crossings(edges)
    )


def test_every_module_is_in_a_layer() -> None:
    for m in modules():
        layer_of(m)


def test_no_import_points_up() -> None:
    problems = up_arrows(graph())
    assert not problems, "imports against the layers (docs/code.md):\n" + "\n".join(problems)


def test_no_import_cycle() -> None:
    """Those under ``if TYPE_CHECKING:`` counted: a module that needs a type of one that imports it
    names a ``Protocol`` of its own instead (the emulator's handlers name ``protocols.Emulator``,
    not ``FakeVast``, which builds their routes)."""
    problems = cycles(graph())
    assert not problems, "import cycles:\n" + "\n".join(problems)


def test_cloud_reaches_none_of_the_clusters_modules() -> None:
    problems = cloud_crossings(graph())
    assert not problems, f"cloud/ imports what runs the cluster ({', '.join(CLOUD_FORBIDDEN)}):\n" + "\n".join(problems)


def test_the_checks_see_a_deliberate_break() -> None:
    """The two checks on a graph with an arrow from the runtime up to the harness, closing a loop."""
    edges = graph()
    edges["runtime.node"] = [*edges["runtime.node"], (1, "harness.driver")]
    up = [p for p in up_arrows(edges) if "runtime/node.py:1 imports pytest_ppsmoke.harness.driver" in p]
    assert len(up) == 1, up_arrows(edges)
    assert any("runtime/node.py:1" in c for c in cycles(edges)), cycles(edges)


def test_the_cloud_check_names_the_chain_to_a_forbidden_module() -> None:
    """An arrow from the emulator's catalogue to the swim settings, and one from the vast.ai
    client to a module of the emulator's that reaches the codec: each crossing found, its chain
    named import by import; the exempt module's own imports are not checked."""
    edges = graph()
    edges["cloud.emulator.catalogue"] = [*edges["cloud.emulator.catalogue"], (1, "runtime.swimconfig")]
    edges["cloud.emulator.answers"] = [*edges["cloud.emulator.answers"], (2, "runtime.transport")]
    found = cloud_crossings(edges)
    assert any(
        p.startswith("pytest_ppsmoke.cloud.emulator.catalogue reaches pytest_ppsmoke.runtime.swimconfig: ")
        and p.endswith("cloud/emulator/catalogue.py:1 -> pytest_ppsmoke/runtime/swimconfig.py")
        for p in found
    ), found
    chain = "cloud/emulator/answers.py:2 -> pytest_ppsmoke/runtime/transport.py:"
    assert any("reaches pytest_ppsmoke.runtime.codec: " in p and chain in p for p in found), found
    assert not any(p.startswith("pytest_ppsmoke.cloud.lifecycle ") for p in found)


def test_the_layers_are_written_down_once() -> None:
    """docs/code.md names every layer of the list above, in its order, and the package's
    docstring points to it."""
    doc = (PACKAGE.parent / "docs" / "code.md").read_text()
    positions = [doc.find(f"**{name}**") for name, _ in LAYERS]
    assert -1 not in positions and positions == sorted(positions), list(zip(LAYERS, positions, strict=True))
    assert "docs/code.md" in (pytest_ppsmoke.__doc__ or "")


def test_loading_the_plugin_imports_only_stdlib_pytest_and_the_settings_table() -> None:
    probe = (
        "import sys, pytest; before = set(sys.modules); import pytest_ppsmoke.plugin; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    loaded = {m for m in out.stdout.split() if m}
    ours = {m for m in loaded if m == "pytest_ppsmoke" or m.startswith("pytest_ppsmoke.")}
    allowed = {
        "pytest_ppsmoke",
        "pytest_ppsmoke.plugin",
        "pytest_ppsmoke.nodeids",
        "pytest_ppsmoke.harness",
        "pytest_ppsmoke.harness.settings",
        "pytest_ppsmoke.harness.options",
        "pytest_ppsmoke.harness.gridspec",
        "pytest_ppsmoke.nodeenv",
        "pytest_ppsmoke.failpoints",
        "pytest_ppsmoke.protocol",
        "pytest_ppsmoke.checks",
        "pytest_ppsmoke.cloud",  # its __init__ imports nothing
        "pytest_ppsmoke.cloud.provider",  # the neutral records, OfferQuery's defaults (standard library only)
        "pytest_ppsmoke.cloud.runtimenames",  # the emulator's runtimes' names (standard library only)
        "pytest_ppsmoke.cloud.replace",  # the replacement policy's defaults (standard library only)
    }
    assert ours <= allowed, sorted(ours - allowed)
    others = {m.split(".")[0] for m in loaded - ours} - set(sys.stdlib_module_names)
    assert not others, sorted(others)  # beyond what pytest itself loaded


def test_pp_smoke_runs_arguments_are_checked_without_tinygrad(synth_model: str) -> None:
    """The orchestrator never runs tinygrad: resolving the offline model, a ``.gguf`` path or a
    name from tinygrad's table (the catalogue declares its URL) imports none of it (half a second
    in every ``pp-smoke-run``)."""
    probe = (
        "import sys; from pytest_ppsmoke.harness.cli import parse_args; "
        "from pytest_ppsmoke.stage.catalog import resolve_model; "
        f"parse_args(['--local', '--model', {synth_model!r}]); parse_args(['--local']); "
        "print('tinygrad' in sys.modules); print(resolve_model('llama3.2:1b')); print('tinygrad' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == [
        "False",
        "https://huggingface.co/bartowski/Llama-3.2-1B-Instruct-GGUF/resolve/main/Llama-3.2-1B-Instruct-Q6_K.gguf",
        "False",
    ]


def test_every_test_runs_in_the_suite_that_ci_runs() -> None:
    """``.ci/run`` and the README run ``pytest -m local``: a test without the ``local`` mark (a
    file that forgot its ``pytestmark``) would never run there. Only the GPU's tests are apart."""
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", "not local and not gpu"],
        cwd=root, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 5, done.stdout[-3000:]  # 5: no tests collected
