"""prefect-launch as a package: its imports are declared, its wheel holds everything it needs at run time,
and the wheel alone (no source tree on ``sys.path``) runs setup, queue apply, submit, an agent and a session
against a real server (issue 38, section 1).

The installed wheel's dependencies: by default the ones already installed in this test's environment,
seen through a folder of links to its site-packages that leaves out prefect-launch's own editable install
(fast, no index needed); ``LAUNCH_WHEEL_DEPS=index`` installs the wheel with its dependencies from the
package index instead (minutes), which also proves that the declared requirements resolve.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from launch_helpers import ROOT, read_runs, wait_agent_online, wait_final
from prefect_launch.local_server import background_process

tomllib = pytest.importorskip("tomllib")

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS = PYPROJECT["tool"]["setuptools"]["package-dir"]  # package -> source folder
# import names whose distribution is not installed here (so packages_distributions() cannot name it)
IMPORT_TO_DIST = {"yaml": "pyyaml", "pynvml": "nvidia-ml-py", "docker": "docker", "psycopg": "psycopg",
                  "kubernetes_asyncio": "kubernetes-asyncio", "prefect_kubernetes": "prefect-kubernetes",
                  "prefect_docker": "prefect-docker", "jupyterlab": "jupyterlab", "sqlalchemy": "sqlalchemy"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _req_name(req: str) -> str:
    return _norm(re.split(r"[\s\[<>=!~;]", req.strip(), maxsplit=1)[0])


def _declared() -> dict[str, str]:
    """Distribution -> where pyproject.toml declares it (``dependencies`` or ``extra NAME``); dev is no home
    for what the package imports."""
    out = {_req_name(r): "dependencies" for r in PYPROJECT["project"]["dependencies"]}
    for extra, reqs in PYPROJECT["project"]["optional-dependencies"].items():
        if extra != "dev":
            for r in reqs:
                out.setdefault(_req_name(r), f"extra {extra}")
    return out


def _imports(path: Path) -> set[str]:
    """Top-level names of every absolute import in the file, at module level or inside functions."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _package_sources() -> list[Path]:
    return sorted(p for folder in set(PACKAGE_DIRS.values()) for p in (ROOT / folder).rglob("*.py")
                  if "__pycache__" not in p.parts)


def test_every_direct_import_is_a_declared_dependency():
    installed = importlib.metadata.packages_distributions()
    declared = _declared()
    undeclared = {}
    for path in _package_sources():
        for top in _imports(path):
            if top in sys.stdlib_module_names or top in ("prefect_launch", "__future__"):
                continue
            dists = [_norm(d) for d in installed.get(top, [])] or [_norm(IMPORT_TO_DIST.get(top, top))]
            if not any(d in declared for d in dists):
                undeclared.setdefault(f"{top} ({'/'.join(dists)})", []).append(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not declared in pyproject.toml (dependencies or a non-dev extra): {undeclared}"


def test_the_cli_dependencies_are_declared_in_the_core_not_an_extra():
    """The console script's own imports (typer, rich) must come with a plain `pip install prefect-launch`."""
    declared = _declared()
    assert declared.get("typer") == "dependencies" and declared.get("rich") == "dependencies", declared


def test_runtime_files_are_package_data_found_through_importlib_resources():
    from importlib.resources import files

    from prefect_launch.deployments import sessions

    flows = files("prefect_launch.flows")
    assert flows.joinpath("session.py").is_file()
    assert sessions.session_flow_file() == Path(str(flows)) / "session.py"
    assert files("prefect_launch.deployments").joinpath("queues.yaml").is_file()
    data = PYPROJECT["tool"]["setuptools"]["package-data"]
    assert "queues.yaml" in data["prefect_launch.deployments"] and "pages/*.py" in data["prefect_launch.dashboard"]
    assert "prefect_launch.flows" in PYPROJECT["tool"]["setuptools"]["packages"]


def test_a_missing_session_flow_is_found_before_anything_is_written(monkeypatch, tmp_path):
    """An installation without flows/session.py: `queue apply` refuses up front, writing nothing."""
    from prefect.exceptions import ObjectNotFound

    from prefect_launch.deployments import queues, sessions
    from prefect_launch.workers.scheduling.queue_spec import QueueSpec
    from prefect_launch.workers.scheduling.resources import LaunchValidationError

    class Client:  # answers reads; any write fails the test
        def read_work_pool(self, name):
            raise ObjectNotFound(None)

        def __getattr__(self, name):
            raise AssertionError(f"wrote {name} before checking")

    monkeypatch.setattr(sessions, "FLOWS_DIR", tmp_path)
    spec = QueueSpec.model_validate({"name": "q1", "default_preset": "a", "presets": {"a": {"cpu": 1, "memory": "1Gi"}}})
    with pytest.raises(LaunchValidationError) as exc:
        queues.apply_queues(Client(), [spec])
    assert "nothing applied" in str(exc.value) and "session flow is missing" in str(exc.value)
    assert str(tmp_path / "session.py") in str(exc.value)


# ---------------------------------------------------------------------------------------------- the wheel
def _run(args: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel, built from a copy of what the build reads (pyproject.toml, README.md, the package folders),
    so that the build leaves nothing in the checkout."""
    src = tmp_path_factory.mktemp("wheel-src")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    for folder in set(PACKAGE_DIRS.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", out, src], timeout=300)
    (whl,) = out.glob("prefect_launch-*.whl")
    return whl


@pytest.mark.server  # builds the wheel: pip fetches the build backend (setuptools) from the package index
def test_the_wheel_holds_every_file_of_every_package_folder(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for package, folder in PACKAGE_DIRS.items():
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
                rel = path.relative_to(ROOT / folder)
                if f"{package.replace('.', '/')}/{rel.as_posix()}" not in names:
                    missing.append(f"{folder}/{rel.as_posix()}")
    assert not missing, f"the wheel lacks: {missing}"
    assert "prefect_launch/flows/session.py" in names and "prefect_launch/deployments/queues.yaml" in names
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    requires = {_req_name(line.split(":", 1)[1]) for line in metadata.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line}
    assert {"typer", "rich", "prefect", "pyyaml"} <= requires, requires


def _dependency_view(tmp: Path) -> Path:
    """This environment's site-packages as a folder of links, without prefect-launch's editable install (its
    finder maps the package onto the checkout) or its metadata."""
    view = tmp / "deps"
    view.mkdir()
    for folder in dict.fromkeys([sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]):
        for entry in Path(folder).iterdir():
            if entry.name.startswith(("prefect_launch", "__editable__", "prefect-launch")):
                continue
            if not (view / entry.name).exists():
                (view / entry.name).symlink_to(entry)
    return view


@pytest.fixture(scope="module")
def wheel_env(wheel, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheel installed; its environment variables and a working folder
    outside the checkout."""
    tmp = tmp_path_factory.mktemp("wheel-env")
    venv = tmp / "venv"
    if os.environ.get("LAUNCH_WHEEL_DEPS") == "index":
        _run([sys.executable, "-m", "venv", venv], timeout=300)
        _run([venv / "bin" / "python", "-m", "pip", "install", "-q", wheel], timeout=1200)
    else:
        _run([sys.executable, "-m", "venv", "--without-pip", venv], timeout=120)
        purelib = _run([venv / "bin" / "python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]
                       ).stdout.strip()
        view = _dependency_view(tmp)
        Path(purelib, "launch_test_dependencies.pth").write_text(f"import site; site.addsitedir({str(view)!r})\n")
        _run([sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "install", "--no-deps", "-q", wheel],
             timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = os.pathsep.join([str(venv / "bin")] + [p for p in env.get("PATH", "").split(os.pathsep)
                                                         if p and not p.startswith(str(ROOT))])
    env["VIRTUAL_ENV"] = str(venv)
    work = tmp / "work"
    work.mkdir()
    return {"venv": venv, "env": env, "cwd": work, "bin": venv / "bin"}


def _in_wheel_env(wheel_env: dict, *args, timeout: float = 180) -> subprocess.CompletedProcess:
    return _run(list(args), env=wheel_env["env"], cwd=wheel_env["cwd"], timeout=timeout)


CHECK_INSTALL = r"""
import importlib.metadata as md, json, sys
from importlib.resources import files
from packaging.requirements import Requirement
import prefect_launch, prefect_launch.cli, prefect_launch.deployments.sessions as sessions

root = sys.argv[1]
unmet = []
for line in md.requires("prefect-launch") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        if not req.specifier.contains(md.version(req.name), prereleases=True):
            unmet.append(f"{line} (found {md.version(req.name)})")
    except md.PackageNotFoundError:
        unmet.append(f"{line} (missing)")
print(json.dumps({"package": prefect_launch.__file__, "session_flow": str(sessions.session_flow_file()),
                  "queues_yaml": files("prefect_launch.deployments").joinpath("queues.yaml").is_file(),
                  "source_on_path": [p for p in sys.path if p.startswith(root)],
                  "dist_files": str(md.distribution("prefect-launch").locate_file("")), "unmet": unmet}))
"""

DEPLOY_PROBE = r"""
import sys
from importlib.resources import files
from prefect import flow
flow.from_source(source=str(files("prefect_launch.flows")), entrypoint="probe.py:probe").to_deployment(
    name=sys.argv[1], work_pool_name=sys.argv[2], work_queue_name="medium").apply()
"""


@pytest.mark.usefixtures("prefect_server")
def test_the_wheel_alone_applies_submits_and_runs_a_job_and_a_session(wheel_env, tmp_path, unique_name):
    venv, bin_ = wheel_env["venv"], wheel_env["bin"]
    site = str(venv)
    found = json.loads(_in_wheel_env(wheel_env, bin_ / "python", "-c", CHECK_INSTALL, ROOT).stdout)
    assert found["package"].startswith(site) and found["session_flow"].startswith(site), found
    assert found["queues_yaml"] and found["source_on_path"] == [] and found["unmet"] == [], found

    setup = json.loads(_in_wheel_env(wheel_env, bin_ / "prefect-launch", "setup", "--json").stdout)
    assert setup["schema_version"] >= 1, setup
    q = f"wheel-{unique_name}"
    qfile = tmp_path / "queues.yaml"
    qfile.write_text(json.dumps({"queues": [{"name": q, "default_preset": "small",
                                             "presets": {"small": {"cpu": 1, "memory": "512Mi"}}}]}))
    applied = json.loads(_in_wheel_env(wheel_env, bin_ / "prefect-launch", "queue", "apply", qfile, "--json").stdout)
    assert applied == [{"queue": q, "action": "created", "session_job": f"launch-session/session-{q}"}], applied
    example = _in_wheel_env(wheel_env, bin_ / "prefect-launch", "queue", "example").stdout
    assert example == (ROOT / "deployments" / "queues.yaml").read_text()

    _in_wheel_env(wheel_env, bin_ / "python", "-c", DEPLOY_PROBE, f"probe-{unique_name}", q)
    records, marker = tmp_path / "records", tmp_path / "session-ran"
    records.mkdir()
    job = json.loads(_in_wheel_env(wheel_env, bin_ / "prefect-launch", "submit", f"probe/probe-{unique_name}",
                                   "--queue", q, "--param", f"record_dir={records}", "--param", "seconds=0",
                                   "--json").stdout)
    session = json.loads(_in_wheel_env(
        wheel_env, bin_ / "prefect-launch", "session", "start", "--type", "batch", "--queue", q,
        "--owner", f"w{unique_name}", "--name", f"wheel-{unique_name}",
        "--startup-command", f"touch {marker}", "--json").stdout)
    ids = job["run_ids"] + session["run_ids"]
    agent_args = [bin_ / "prefect-launch", "agent", "--queue", q, "--name", f"wheel-{unique_name}",
                  "--capacity", "cpu=2,memory=4Gi", "--on-exit", "cancel"]
    log = tmp_path / "agent.log"
    with background_process([str(a) for a in agent_args], log, env=wheel_env["env"], cwd=wheel_env["cwd"]):
        wait_agent_online(f"wheel-{unique_name}", [q])
        runs = wait_final(ids, timeout=240)
    states = {str(r.id): r.state_name for r in runs}
    assert all(s == "Completed" for s in states.values()), f"{states}\n--- agent log\n{log.read_text()[-6000:]}"
    assert (records / f"{job['run_ids'][0]}.json").exists() and marker.exists()

    from prefect import get_client

    with get_client(sync_client=True) as client:  # the session job runs the wheel's flows/session.py
        run = read_runs(session["run_ids"])[0]
        deployment = client.read_deployment(run.deployment_id)
    assert site in json.dumps(deployment.pull_steps), deployment.pull_steps
