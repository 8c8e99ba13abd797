"""The image's publishing and its page: every workflow passes GitHub's workflow schema; the image
workflow pushes exactly the package's default ``--image`` on a version tag (its own version check
run here, in bash) and nothing else; ``docs/image.md`` names every variable of the node contract
and every setting the Dockerfile bakes in."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from ruamel.yaml import YAML

import pytest_ppsmoke
from pytest_ppsmoke import nodeenv

pytestmark = pytest.mark.local

ROOT = Path(__file__).resolve().parent.parent
WORKFLOWS = ROOT / ".github" / "workflows"
IMAGE_WORKFLOW = WORKFLOWS / "image.yml"
DOC = ROOT / "docs" / "image.md"
DOCKERFILE = ROOT / "docker" / "Dockerfile"
PUSH_ACTION = "docker/build-push-action"


def project_version() -> str:
    """pyproject.toml's version (the first ``version =`` of its ``[project]`` table)."""
    project = (ROOT / "pyproject.toml").read_text().split("[project]", 1)[1]
    m = re.search(r'^version\s*=\s*"([^"]+)"', project, re.M)
    assert m, "pyproject.toml's [project] table has no version"
    return m[1]


def workflow() -> dict[str, Any]:
    data: dict[str, Any] = YAML(typ="safe").load(IMAGE_WORKFLOW.read_text())  # YAML 1.2: `on` stays a string
    return data


def steps(job: dict[str, Any], action: str) -> list[dict[str, Any]]:
    return [s for s in job["steps"] if str(s.get("uses", "")).split("@")[0] == action]


def render(text: str, context: dict[str, str]) -> str:
    """``${{ expr }}`` replaced from ``context``; an expression it does not know fails the test."""

    def one(m: re.Match[str]) -> str:
        assert m[1] in context, f"{m[0]} in the image workflow's tags: expected one of {sorted(context)}"
        return context[m[1]]

    return re.sub(r"\$\{\{\s*([^}]*?)\s*\}\}", one, text)


def run_version_step(ref_name: str, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], dict[str, str]]:
    """The publish job's version step as the runner runs it (bash -e -o pipefail, in the checkout)."""
    (step,) = [s for s in workflow()["jobs"]["publish"]["steps"] if s.get("id") == "version"]
    script, out = tmp_path / "step.sh", tmp_path / "github_output"
    script.write_text(step["run"])
    out.write_text("")
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "GITHUB_REF_NAME": ref_name,
        "GITHUB_OUTPUT": str(out),
    }
    done = subprocess.run(
        ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    outputs = dict(line.split("=", 1) for line in out.read_text().splitlines() if "=" in line)
    return done, outputs


def test_every_workflow_passes_githubs_workflow_schema() -> None:
    files = sorted(WORKFLOWS.glob("*.y*ml"))
    assert IMAGE_WORKFLOW in files, files
    lint = [sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.github-workflows", *map(str, files)]
    try:
        done = subprocess.run(lint, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:  # pragma: no cover
        pytest.fail("check-jsonschema is missing: pip install -e '.[dev]'")
    assert "No module named" not in done.stderr, f"check-jsonschema is missing: pip install -e '.[dev]'\n{done.stderr}"
    assert done.returncode == 0, f"a workflow is not valid:\n{done.stdout}{done.stderr}"


def test_the_workflow_pushes_the_packages_default_image(tmp_path: Path) -> None:
    version = project_version()
    assert pytest_ppsmoke.__version__ == version, (
        f"the installed package says version {pytest_ppsmoke.__version__}, pyproject.toml says {version}: reinstall"
    )
    wf = workflow()
    done, outputs = run_version_step(f"v{version}", tmp_path)
    assert done.returncode == 0, done.stderr
    assert outputs == {"version": version}
    context = {"env.IMAGE": wf["env"]["IMAGE"], "steps.version.outputs.version": outputs["version"]}
    context["github.ref_name"] = f"v{version}"
    pushed = []
    for name, job in wf["jobs"].items():
        for step in steps(job, PUSH_ACTION):
            if step["with"].get("push") is True:
                tags = render(str(step["with"]["tags"]), context)  # newline- or comma-separated
                pushed += [(name, tag) for tag in re.split(r"[\s,]+", tags.strip())]
    assert pushed == [("publish", pytest_ppsmoke.DEFAULT_IMAGE)], (
        f"the image workflow pushes {pushed}; the package's default --image is {pytest_ppsmoke.DEFAULT_IMAGE}"
    )


def test_the_version_step_refuses_a_tag_that_is_not_the_packages_version(tmp_path: Path) -> None:
    done, outputs = run_version_step("v9.9.9", tmp_path)
    assert done.returncode != 0, f"the version step accepted tag v9.9.9 for version {project_version()}: {outputs}"
    assert outputs == {}, outputs
    assert "9.9.9" in done.stderr and project_version() in done.stderr, done.stderr


def test_the_workflow_publishes_on_version_tags_only_and_builds_pull_requests() -> None:
    wf = workflow()
    on = wf["on"]
    assert on["push"]["tags"] == ["v*"]
    for inputs in ("docker/**", "pytest_ppsmoke/**", "worker/**", "pyproject.toml"):
        assert inputs in on["pull_request"]["paths"], f"pull requests that touch {inputs} must build the image"
    assert wf["permissions"] == {"contents": "read"}  # nothing may write unless its job says so
    for name, job in wf["jobs"].items():
        pushes = any(s["with"].get("push") is True for s in steps(job, PUSH_ACTION))
        writes = job.get("permissions", {}).get("packages") == "write"
        assert pushes == writes, f"job {name}: packages: write only where it pushes (pushes={pushes})"
        if pushes:
            assert job["if"] == "github.ref_type == 'tag'", f"job {name} pushes outside a tag: if {job.get('if')!r}"
        for step in steps(job, PUSH_ACTION):
            assert "type=gha" in step["with"]["cache-from"], f"job {name} builds without the layer cache"
            assert step["with"]["file"] == "docker/Dockerfile"
    assert any(s["with"].get("push") is False for s in steps(wf["jobs"]["build"], PUSH_ACTION))
    for job in wf["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", step["uses"]), f"{step['uses']} is not pinned"


def dockerfile_env() -> dict[str, str]:
    """The Dockerfile's ``ENV KEY=VALUE`` settings (continuation lines joined)."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    pairs = [ln.strip()[4:] for ln in text.splitlines() if ln.strip().upper().startswith("ENV ")]
    return dict(p.split("=", 1) for line in pairs for p in line.split())


def test_the_image_page_names_the_node_contract_and_the_images_settings() -> None:
    doc = DOC.read_text()
    for var in nodeenv.variables():
        assert f"`{var.name}`" in doc, f"{var.name} (pytest_ppsmoke/nodeenv.py) is missing from docs/image.md"
    for key, value in dockerfile_env().items():
        assert f"`{key}={value}`" in doc, f"the Dockerfile sets {key}={value}; docs/image.md does not say so"
    text = DOCKERFILE.read_text()
    (base,) = re.findall(r"^ARG\s+BASE=(\S+)", text, re.M)
    assert f"`{base}`" in doc, f"the default base {base} is not in docs/image.md"
    (user,) = re.findall(r"^USER\s+(\S+)", text, re.M)
    (entrypoint,) = re.findall(r"^ENTRYPOINT\s+(.+)$", text, re.M)
    assert f"User:** `{user}`" in doc and f"`ENTRYPOINT {entrypoint.strip()}`" in doc
    # the baked model's file, as tinygrad's model table names it (read, not imported: importing is slow)
    spec = importlib.util.find_spec("tinygrad")
    assert spec and spec.origin
    table = (Path(spec.origin).parent / "apps" / "llm.py").read_text()
    (url,) = re.findall(r'"llama3\.2:1b":\s*"([^"]+)"', table)
    assert f"`{url.rsplit('/', 1)[1]}`" in doc, f"docs/image.md does not name llama3.2:1b's file, {url}"


RELEASE_WORKFLOW = WORKFLOWS / "release.yml"


def test_the_release_workflow_publishes_the_checked_files_from_the_same_tag() -> None:
    """PyPI from the version tag that publishes the image: the same version check, the files
    checked by twine before upload, and only the upload job may ask for PyPI's token."""
    wf: dict[str, Any] = YAML(typ="safe").load(RELEASE_WORKFLOW.read_text())
    assert wf["on"] == {"push": {"tags": ["v*"]}} and wf["permissions"] == {"contents": "read"}
    jobs = wf["jobs"]
    (check,) = [s for s in jobs["dist"]["steps"] if s.get("id") == "version"]
    (image_check,) = [s for s in workflow()["jobs"]["publish"]["steps"] if s.get("id") == "version"]
    assert check["run"] == image_check["run"]  # one rule: the tag names pyproject.toml's version
    build = " ".join(str(s.get("run", "")) for s in jobs["dist"]["steps"])
    assert "python3 -m build" in build and "twine check --strict dist/*" in build and "-c constraints.txt" in build
    assert [n for n, j in jobs.items() if j.get("permissions", {}).get("id-token") == "write"] == ["pypi"]
    assert jobs["pypi"]["environment"]["name"] == "pypi" and jobs["pypi"]["needs"] == "dist"
    assert [s["uses"].split("@")[0] for s in jobs["pypi"]["steps"]][-1] == "pypa/gh-action-pypi-publish"
    assert not any("password" in (s.get("with") or {}) for s in jobs["pypi"]["steps"])  # trusted publishing


def test_the_sdist_and_the_wheel_pass_twines_check(tmp_path: Path) -> None:
    """What the release uploads, built here as it builds it (with the dev extra's setuptools, not
    an isolated environment: the same backend, without a download) and checked by twine, as PyPI
    would render and accept it."""
    build = [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path), str(ROOT)]
    done = subprocess.run(build, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    files = sorted(p.name for p in tmp_path.iterdir())
    version = project_version()
    assert files == [f"pytest_ppsmoke-{version}-py3-none-any.whl", f"pytest_ppsmoke-{version}.tar.gz"], files
    check = [sys.executable, "-m", "twine", "check", "--strict", *map(str, sorted(tmp_path.iterdir()))]
    done = subprocess.run(check, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.count("PASSED") == 2, done.stdout + done.stderr
