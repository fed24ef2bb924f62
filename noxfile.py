"""nox sessions for test suites that need their own venv.

``nox -s nemo_gym-0.4 nemo_gym-0.7`` runs ``tests/nemo_gym`` against two NeMo Gym releases,
each in a venv of its own under ``sandpool_home()/venvs/`` (built once per machine, keyed by
the interpreter, the pins and sandpool's dependencies; see ``_nemo_venv``):

* ``nemo_gym-0.4``: nemo-gym 0.4.0 on Python 3.12, the newest release that installs on 3.12.
* ``nemo_gym-0.7``: nemo-gym 0.7.0, the newest release. It declares ``Requires-Python
  >=3.13.14``, which no interpreter on this machine satisfies (pyenv has 3.13.0), so it is
  installed on pyenv's 3.13.0 with ``pip install --ignore-requires-python``. Its tests pass
  there; that is not a claim that 0.7.0 supports 3.13.0.

The README-commands test (``test_readme_commands.py``) runs in the 0.4 session only: the
README's install path is the one that resolves here (Python 3.12, nemo-gym 0.4.0).

``nox -s swebench_harness`` runs ``tests/swebench_harness``: sandpool's grading beside swebench
4.1.0's ``run_evaluation`` on the same tasks, images and patches, in a Docker daemon the test
starts and stops (Debian's docker.io). It runs in this venv (swebench is a sandpool dependency);
its task images are cached under ``sandpool_home()``, keyed by their version.

``nox -s venvs`` builds all of these venvs and runs no test (``make test`` runs it beside the
main suite).

``nox -s openhands`` runs ``tests/openhands`` with openhands-sdk/-tools/-workspace/-agent-server
1.58.2, and ``nox -s openhands_app`` runs ``tests/openhands_app`` with openhands-ai 1.11.0
(the app server; it pins the SDK at 1.34.0, hence a venv of its own). Their venvs are big, so it lives under ``sandpool_home()/venvs/<name>-<hash of the pins>``,
shared by every clone on the machine (a warm CI run reuses it); sandpool itself is not
installed there but imported from this checkout (``PYTHONPATH``), so one venv serves any clone. Each session prints the cold install time when it builds one.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"

ROOT = Path(__file__).resolve().parent
NEMO_TEST_DEPS = ["pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3"]
README_TEST = "tests/nemo_gym/test_readme_commands.py"


def _pyenv_python(minor: str, exact: str | None = None) -> str:
    """Return a Python ``minor`` (e.g. ``"3.12"``) interpreter, or exactly ``exact`` from pyenv.

    ``python3.12`` on PATH is taken first when no exact version is asked for, else pyenv's
    newest matching version.

    Raises:
        RuntimeError: No such interpreter; the message says how to install one.
    """
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    if exact is not None:
        cand = f"{pyenv}/versions/{exact}/bin/python{minor}"
        if Path(cand).exists():
            return cand
        raise RuntimeError(f"Python {exact} not found at {cand}: `pyenv install {exact}` and retry")
    found = sorted(glob.glob(f"{pyenv}/versions/{minor}*/bin/python{minor}"),
                   key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()])
    want = tuple(int(x) for x in minor.split("."))
    for cand in [shutil.which(f"python{minor}"), *reversed(found)]:
        if cand and subprocess.run([cand, "-c", f"import sys; assert sys.version_info[:2] == {want}"],
                                   capture_output=True).returncode == 0:
            return cand
    raise RuntimeError(f"Python {minor} not found: install it (e.g. `pyenv install {minor}`) and retry")


def _nemo_venv(session: nox.Session, release: str, python: str, *pip_flags: str) -> Path:
    """Build (or reuse) the cached venv for nemo-gym ``release`` and return its python.

    The venv lives under ``sandpool_home()/venvs/nemo-gym-<release>-<key>``, where ``key``
    hashes the interpreter, the pip flags, the pins and sandpool's own dependencies, so every
    clone on the machine (a CI run's fresh clone too) reuses it; a change of any of those
    builds a new one. sandpool itself is re-installed editable from this checkout on every
    run (``--no-deps``, seconds), because NeMo Gym finds the ``sandpool`` sandbox provider
    through the installed package's entry points.
    """
    pins = [f"nemo-gym=={release}", *NEMO_TEST_DEPS]
    reqs = [python, *pip_flags, *pins, *sorted(_sandpool_deps())]
    key = hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    venv = _venvs_home() / f"nemo-gym-{release}-{key}"
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if not stamp.exists():
        shutil.rmtree(venv, ignore_errors=True)
        t0 = time.monotonic()
        session.run(python, "-m", "venv", str(venv), external=True)
        session.run(str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", external=True)
        session.run(str(py), "-m", "pip", "install", "-q", *pip_flags, "-e", str(ROOT), *pins,
                    external=True)
        stamp.write_text("\n".join(reqs) + "\n")
        print(f"nemo-gym {release}: cold install took {time.monotonic() - t0:.0f} s", file=sys.stderr)
    else:
        session.run(str(py), "-m", "pip", "install", "-q", "--no-deps", *pip_flags, "-e", str(ROOT),
                    external=True)
    return py


def _venvs_home() -> Path:
    """``sandpool_home()/venvs``: integration venvs shared by every clone on this machine."""
    home = Path(os.environ.get("SANDPOOL_HOME") or Path.home() / ".cache" / "sandpool")
    return home / "venvs"


def _pytest(session: nox.Session, py: Path, *args: str) -> None:
    session.run(str(py), "-m", "pytest", "tests/nemo_gym", "-p", "no:cacheprovider", *args,
                *session.posargs, external=True)


@nox.session(name="nemo_gym-0.4", python=False)
def nemo_gym_04(session: nox.Session) -> None:
    """tests/nemo_gym with nemo-gym 0.4.0 on Python 3.12, plus the README-commands test."""
    _pytest(session, _nemo_venv(session, "0.4.0", _pyenv_python("3.12")))


@nox.session(name="nemo_gym-0.7", python=False)
def nemo_gym_07(session: nox.Session) -> None:
    """tests/nemo_gym with nemo-gym 0.7.0 on pyenv's 3.13.0 (``--ignore-requires-python``)."""
    py = _nemo_venv(session, "0.7.0", _pyenv_python("3.13", exact="3.13.0"), "--ignore-requires-python")
    _pytest(session, py, f"--ignore={README_TEST}")


OPENHANDS_SDK = ["openhands-sdk==1.58.2", "openhands-tools==1.58.2", "openhands-workspace==1.58.2",
                 "openhands-agent-server==1.58.2"]
OPENHANDS_APP = ["openhands-ai==1.11.0"]


def _sandpool_deps() -> list[str]:
    """sandpool's own runtime dependencies, from pyproject.toml."""
    import tomllib

    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def _cached_venv(session: nox.Session, name: str, pins: list[str], later: tuple[str, ...] = ()) -> Path:
    """Return the cached venv ``name`` holding ``pins``, building it on first use (timed).

    ``later`` names sandpool dependencies installed in a second pip run, after the rest.
    """
    split = [(d, re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0] in later) for d in _sandpool_deps()]
    reqs = sorted([*pins, *(d for d, late in split if not late), *NEMO_TEST_DEPS])
    second = sorted(d for d, late in split if late)
    key = hashlib.sha256("\n".join([*reqs, "--then", *second]).encode()).hexdigest()[:12] if second else \
        hashlib.sha256("\n".join(reqs).encode()).hexdigest()[:12]
    venv = _venvs_home() / f"{name}-{key}"
    stamp = venv / ".installed"
    if stamp.exists():
        return venv
    shutil.rmtree(venv, ignore_errors=True)
    t0 = time.monotonic()
    session.run(_pyenv_python("3.12"), "-m", "venv", str(venv), external=True)
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *reqs, external=True)
    if second:
        session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *second, external=True)
    stamp.write_text("\n".join([*reqs, *second]) + "\n")
    print(f"{name}: cold install took {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return venv


#: The Kubernetes backend's client and the cluster tests' client, for tests/openhands' pod
#: route; laid over the openhands venv (see _extras) so that venv's key stays the same.
OPENHANDS_K8S_EXTRAS = ["kubernetes_asyncio>=32", "aiohttp>=3.9", "kubernetes>=30", "pyyaml>=6"]


def _extras(session: nox.Session, venv: Path, pins: list[str]) -> Path:
    """A ``pip install --target`` directory of ``pins`` for ``venv``, put on ``PYTHONPATH``.

    Constrained to the versions ``venv`` already has, so nothing it holds changes; cached under
    ``sandpool_home()/venvs/<venv name>-extras-<hash of the pins>`` (seconds to build).
    """
    key = hashlib.sha256("\n".join(sorted(pins)).encode()).hexdigest()[:12]
    target = _venvs_home() / f"{venv.name}-extras-{key}"
    stamp = target / ".installed"
    if stamp.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    py = str(venv / "bin" / "python")
    freeze = subprocess.run([py, "-m", "pip", "freeze", "--exclude-editable"], capture_output=True, text=True,
                            check=True).stdout
    target.mkdir(parents=True)
    (target / "constraints.txt").write_text("".join(line + "\n" for line in freeze.splitlines()
                                                    if "==" in line))
    session.run(py, "-m", "pip", "install", "-q", "--target", str(target), "-c", str(target / "constraints.txt"),
                *pins, external=True)
    stamp.write_text("\n".join(pins) + "\n")
    return target


def _run_pytest(session: nox.Session, venv: Path, tests: str, extras: Path | None = None) -> None:
    path = os.pathsep.join([str(ROOT), *([str(extras)] if extras else [])])
    env = {"PYTHONPATH": path, "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    session.run(str(venv / "bin" / "python"), "-m", "pytest", tests, "-p", "no:cacheprovider",
                *session.posargs, env=env, external=True)


@nox.session(python=False)
def openhands(session: nox.Session) -> None:
    """Run tests/openhands with the real OpenHands SDK 1.58.2 (cached venv, built as needed),
    the Kubernetes route on the local cluster included (hack/cluster; its client laid over)."""
    venv = _cached_venv(session, "openhands-sdk", OPENHANDS_SDK)
    _run_pytest(session, venv, "tests/openhands", _extras(session, venv, OPENHANDS_K8S_EXTRAS))


@nox.session(python=False)
def openhands_example(session: nox.Session) -> None:
    """Run examples/openhands_swe.py in the openhands session's venv (built as needed) with this
    checkout on PYTHONPATH; arguments after ``--`` go to the example (``-- -n 2``)."""
    venv = _cached_venv(session, "openhands-sdk", OPENHANDS_SDK)
    env = {"PYTHONPATH": str(ROOT), "OPENHANDS_SUPPRESS_BANNER": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    session.run(str(venv / "bin" / "python"), str(ROOT / "examples" / "openhands_swe.py"), *session.posargs,
                env=env, external=True)


@nox.session(python=False)
def openhands_app(session: nox.Session) -> None:
    """Run tests/openhands_app with the real openhands-ai 1.11.0 app server (cached venv)."""
    # Resolved together with openhands-ai's exact pins, swebench/datasets/pyarrow made pip
    # backtrack for over 20 minutes; installed after it, they resolve in a minute or two.
    venv = _cached_venv(session, "openhands-app", OPENHANDS_APP, later=("swebench", "datasets", "pyarrow"))
    _run_pytest(session, venv, "tests/openhands_app")


@nox.session(python=False)
def venvs(session: nox.Session) -> None:
    """Build (or find) every integration session's cached venv, and run no test.

    ``make test`` starts this beside the cluster build and the main suite, so a cold machine's
    pip downloads overlap the compile and the tests instead of following them.
    """
    _nemo_venv(session, "0.4.0", _pyenv_python("3.12"))
    _nemo_venv(session, "0.7.0", _pyenv_python("3.13", exact="3.13.0"), "--ignore-requires-python")
    sdk = _cached_venv(session, "openhands-sdk", OPENHANDS_SDK)
    _extras(session, sdk, OPENHANDS_K8S_EXTRAS)
    _cached_venv(session, "openhands-app", OPENHANDS_APP, later=("swebench", "datasets", "pyarrow"))


@nox.session(python=False)
def swebench_harness(session: nox.Session) -> None:
    """Run tests/swebench_harness: the SWE-bench harness's verdicts beside sandpool's (prints the table)."""
    session.run(sys.executable, "-m", "pytest", "tests/swebench_harness", "-p", "no:cacheprovider", "-s",
                *session.posargs, env={"SANDPOOL_SWEBENCH_HARNESS": "1"}, external=True)
