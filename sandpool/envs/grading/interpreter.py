"""The interpreter a task's tests run with: the one its image has.

Shell lines both graders (:mod:`~sandpool.envs.grading.diff`,
:mod:`~sandpool.envs.grading.inplace`) run in the sandbox before the harness's command, for
every harness (SWE-bench, SWE-smith, R2E-Gym, the pack's pytest):

* :data:`ACTIVATE`: the SWE-bench images' conda env ``testbed``, when the image has one;
* :data:`FIND_PYTHON`: sets ``$PY`` to the image's interpreter: the SWE-bench env's, else
  ``python3``, else ``python`` on ``PATH``; empty when the image has none;
* :func:`commands_on_path`: when the image has no ``python`` (or no ``pytest``) command, puts
  one that runs ``$PY`` (``$PY -m pytest``) first on ``PATH``. A harness command, a shebang or
  a script that says ``python`` (the pack's ``python -m pytest``, R2E-Gym's
  ``run_tests.sh``, a SWE-bench spec's runner) then runs the image's ``python3``, as on a
  Debian or Ubuntu image with ``python-is-python3`` installed. A command the image has is
  never replaced.
"""

from __future__ import annotations

__all__ = ["ACTIVATE", "FIND_PYTHON", "commands_on_path"]

ACTIVATE = ("if [ -f /opt/miniconda3/bin/activate ]; then source /opt/miniconda3/bin/activate "
            "&& conda activate testbed; fi")
FIND_PYTHON = ('PY=; for p in /opt/miniconda3/envs/testbed/bin/python "$(command -v python3)" '
               '"$(command -v python)"; do [ -n "$p" ] && [ -x "$p" ] && PY="$p" && break; done')


def commands_on_path(bin_dir: str) -> str:
    """Shell lines (bash, after :data:`FIND_PYTHON` found ``$PY``) that write a ``python`` and
    a ``pytest`` command of ``$PY`` into ``bin_dir``, each only when the image lacks it, and
    put ``bin_dir`` first on ``PATH`` (exported).

    ``python`` runs ``$PY`` with its arguments (a wrapper, not a link: a venv's interpreter
    finds its venv from the path it is run as); ``pytest`` is what pip writes as pytest's
    console script (``#!$PY``, ``sys.exit(pytest.main())``), so the work tree is not put on
    ``sys.path`` as ``python -m pytest`` would put it.

    Args:
        bin_dir: A fresh directory of the grading run (shell-safe: no quoting is applied).
    """
    python = (f"printf '#!/bin/bash\\nexec %q \"$@\"\\n' \"$PY\" > {bin_dir}/python")
    pytest = (f"printf '#!%s\\nimport sys\\nimport pytest\\nsys.exit(pytest.main())\\n' \"$PY\" "
              f"> {bin_dir}/pytest")
    return "\n".join([
        f"mkdir -p {bin_dir}",
        *(f'[ -z "$PY" ] || command -v {name} >/dev/null 2>&1 || {{ {write} && chmod 755 {bin_dir}/{name}; }}'
          for name, write in (("python", python), ("pytest", pytest))),
        f"export PATH={bin_dir}:$PATH"])
