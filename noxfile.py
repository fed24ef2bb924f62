"""nox sessions for test suites that need their own venv.

``nox -s nemo_gym`` builds ``.venvs/nemo`` (Python 3.12, sandpool editable, the real nemo-gym)
and runs ``tests/nemo_gym`` in it. nemo-gym needs Python >= 3.12; 0.4.0 is the newest release
that installs on 3.12 (later releases want 3.13.14), so it is pinned here.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import nox

nox.options.default_venv_backend = "none"

ROOT = Path(__file__).resolve().parent
NEMO_VENV = ROOT / ".venvs" / "nemo"
NEMO_GYM = "nemo-gym==0.4.0"
NEMO_TEST_DEPS = ["pytest>=8", "pytest-asyncio>=0.24", "pytest-timeout>=2.3"]


def _python312() -> str:
    """Return a Python 3.12 interpreter: ``python3.12`` on PATH, else pyenv's newest 3.12.x."""
    pyenv = os.environ.get("PYENV_ROOT") or str(Path.home() / ".pyenv")
    found = sorted(glob.glob(f"{pyenv}/versions/3.12*/bin/python3.12"),
                   key=lambda p: [int(x) for x in Path(p).parts[-3].split(".") if x.isdigit()])
    for cand in [shutil.which("python3.12"), *reversed(found)]:
        if cand and subprocess.run([cand, "-c", "import sys; assert sys.version_info[:2] == (3, 12)"],
                                   capture_output=True).returncode == 0:
            return cand
    raise RuntimeError("Python 3.12 not found: install it (e.g. `pyenv install 3.12`) and retry")


@nox.session(python=False)
def nemo_gym(session: nox.Session) -> None:
    """Run tests/nemo_gym with the real nemo-gym in .venvs/nemo (built or refreshed as needed)."""
    py = NEMO_VENV / "bin" / "python"
    stamp = NEMO_VENV / ".installed"
    want = hashlib.sha256(((ROOT / "pyproject.toml").read_bytes() + NEMO_GYM.encode()
                           + " ".join(NEMO_TEST_DEPS).encode())).hexdigest()
    if not py.exists():
        session.run(_python312(), "-m", "venv", str(NEMO_VENV), external=True)
    if not stamp.exists() or stamp.read_text() != want:
        session.run(str(py), "-m", "pip", "install", "-q", "--upgrade", "pip", external=True)
        session.run(str(py), "-m", "pip", "install", "-q", "-e", str(ROOT), NEMO_GYM, *NEMO_TEST_DEPS,
                    external=True)
        stamp.write_text(want)
    session.run(str(py), "-m", "pytest", "tests/nemo_gym", "-p", "no:cacheprovider", *session.posargs,
                external=True)
