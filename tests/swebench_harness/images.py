"""SWE-bench task images built here: a real package's sdist with one bug, as an OCI image shaped like
SWE-bench's (the repo at ``/testbed`` at ``base_commit``, an environment that runs its tests).

Each :class:`Recipe` gives one task and its patches. The image is the OCI test images' ``base``
(Debian bookworm's python3, pytest and git; :mod:`sandpool.envs.taskpack.oci`) plus one layer:
``/testbed`` (the sdist with the bug, committed, then an empty commit as ``base_commit`` so
that the eval script's ``git show`` prints a commit, not the whole tree) and ``/opt/testbed-env``
(a venv over the system site packages with the package's requirements, a ``pytest`` of its own
that runs Debian's pytest with the venv's Python, and a ``.pth`` putting the repo's import root
on ``sys.path``, as ``pip install -e`` would). Its config sets ``PIP_NO_INDEX``: the
SWE-bench eval script's ``install`` step then fails at once (there is no network in the
daemon's namespace) and the image's own install stands, as in SWE-bench's images.

Cached under ``sandpool_home()/swebench-harness-v<VERSION>/`` (per recipe, ``.complete`` last).
The patches (gold, empty, a wrong fix, three mutants of the gold, and a cheat that prints
passing test lines and exits) are diffs computed on the host from the same tree.
"""

from __future__ import annotations

import fcntl
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from sandpool.core.paths import sandpool_home
from sandpool.envs.taskpack.mutate import find_mutations, select_mutations
from sandpool.envs.taskpack.oci import VERSION as OCI_VERSION
from sandpool.envs.taskpack.oci import build_test_images

VERSION = "2"
_ENV = "/opt/testbed-env"
_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_GIT_ENV = {"GIT_AUTHOR_NAME": "sandpool", "GIT_AUTHOR_EMAIL": "sandpool@localhost",
            "GIT_COMMITTER_NAME": "sandpool", "GIT_COMMITTER_EMAIL": "sandpool@localhost",
            "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000", "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
            "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": os.devnull, "PATH": "/usr/bin:/bin"}
CASES = ("gold", "empty", "wrong", "mutant-1", "mutant-2", "mutant-3", "cheat")

# Case 002's cheat: at import under the test runner, print a passing line for every test id to
# each pipe it inherited (the runner's saved stdout/stderr among them) and exit 0.
_CHEAT = '''import os as _o, stat as _s, sys as _y
if {when}:
    _l = "".join({fmt}.format(t) for t in {ids!r}).encode()
    for _fd in range(256):
        try:
            if _s.S_ISFIFO(_o.fstat(_fd).st_mode):
                _o.write(_fd, _l)
        except OSError:
            pass
    _o._exit(0)
'''


@dataclass(frozen=True)
class Recipe:
    """One SWE-bench task made from a package's sdist.

    Attributes:
        name: Short name (image tag, cache directory).
        dist / pkg_version: The sdist on the package index.
        requirements: Pinned wheels installed into the image's venv.
        import_root: The repo directory that must be on ``sys.path``.
        instance_id / repo / version: The SWE-bench row's (``repo``/``version`` pick swebench's
            test command and log parser).
        source: The file the bug goes into; ``bug`` = ``(fixed text, buggy text)``.
        test_file / edit_test: The test patch: the test file's new text from its old.
        wrong: ``(buggy text, wrong fix)`` in ``source``.
        mutate: Functions of ``source`` whose gold version the mutants change.
        cheat_when / cheat_line: When the cheat fires, and the line it prints per test id.
        fail_to_pass / pass_to_pass: The task's tests, in the harness's ids.
    """

    name: str
    dist: str
    pkg_version: str
    requirements: tuple[str, ...]
    import_root: str
    instance_id: str
    repo: str
    version: str
    source: str
    bug: tuple[str, str]
    test_file: str
    edit_test: Callable[[str], str]
    wrong: tuple[str, str]
    mutate: tuple[str, ...]
    cheat_when: str
    cheat_line: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]

    @property
    def image(self) -> str:
        return f"sandpool.swebench/{self.name}:v{VERSION}"


def _run(*argv: str | Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    res = subprocess.run([str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, argv[:4]))} failed: {(res.stderr or res.stdout)[-1500:]}")
    return res.stdout


def _git(repo: Path, *args: str) -> str:
    return _run("git", "-C", repo, *args, env=_GIT_ENV)


def _pip(*args: str) -> None:
    _run(sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", *args)


def _patches(r: Recipe, testbed: Path) -> dict[str, str]:
    """Every case's patch, as diffs of the one-commit repo at ``testbed`` (left clean)."""
    src = testbed / r.source
    buggy = src.read_text()
    fixed = buggy.replace(r.bug[1], r.bug[0], 1)

    def diff_with(path: Path, text: str) -> str:
        old = path.read_text()
        path.write_text(text)
        try:
            return _git(testbed, "diff")
        finally:
            path.write_text(old)

    out = {"gold": diff_with(src, fixed), "empty": "",
           "wrong": diff_with(src, buggy.replace(r.wrong[0], r.wrong[1], 1))}
    candidates = [m for m in find_mutations(r.source, fixed.encode()) if m.function in r.mutate]
    chosen = select_mutations(candidates, random.Random(0))[:3]
    if len(chosen) < 3:
        raise RuntimeError(f"{r.name}: only {len(chosen)} mutants in {r.mutate}")
    for i, m in enumerate(chosen, 1):
        out[f"mutant-{i}"] = diff_with(src, m.apply(fixed.encode()).decode())
    ids = [*r.fail_to_pass, *r.pass_to_pass]
    cheat = _CHEAT.format(when=r.cheat_when, fmt=repr(r.cheat_line), ids=ids)
    lines = buggy.splitlines(keepends=True)
    # After the module's docstring and __future__ imports, which must stay first.
    at = next((i for i in range(len(lines) - 1, -1, -1) if lines[i].startswith("from __future__")), -1) + 1
    out["cheat"] = diff_with(src, "".join(lines[:at]) + cheat + "".join(lines[at:]))
    return out


_BUILD = f"""set -eu
python3 -m venv --system-site-packages {_ENV}
{_ENV}/bin/pip install -q --no-index --find-links /tmp/wheels {{reqs}}
echo {{root}} > "$({_ENV}/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/testbed.pth"
printf '#!{_ENV}/bin/python\nimport sys\nfrom pytest import console_main\nsys.exit(console_main())\n' \
  > {_ENV}/bin/pytest
chmod 755 {_ENV}/bin/pytest
rm -rf /tmp/wheels
# umoci repack keeps whole-second mtimes: make them whole now, then write valid bytecode.
find {_ENV} -exec touch -h -d @946684800 {{{{}}}} +
{_ENV}/bin/python -m compileall -q -f {_ENV}/lib >/dev/null
"""


def build(r: Recipe) -> tuple[Path, dict, dict[str, str]]:
    """Build (or reuse) the recipe's image; return ``(OCI layout, task row, patches by case)``.

    The layout holds the image under tag ``r.name``. Needs the package index (pip) on a cold
    build, root, umoci, skopeo and bubblewrap.
    """
    root = sandpool_home() / f"swebench-harness-v{VERSION}-oci{OCI_VERSION}"
    done = root / r.name / ".complete"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_file():
            _build(r, root)
    d = root / r.name
    return root / "layout", json.loads((d / "task.json").read_text()), json.loads((d / "patches.json").read_text())


def _build(r: Recipe, root: Path) -> None:
    work = root / r.name
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    layout = root / "layout"
    if not (layout / "index.json").is_file():
        _run("skopeo", "copy", "--quiet", f"oci:{build_test_images() / 'layout'}:base", f"oci:{layout}:base")
    _pip("download", "-d", work / "sdist", "--no-binary", ":all:", "--no-deps", f"{r.dist}=={r.pkg_version}")
    _pip("download", "-d", work / "wheels", "--only-binary=:all:", "--python-version", "3.11",
         "--implementation", "cp", "--abi", "cp311", "--abi", "none", "--abi", "abi3",
         "--platform", "manylinux2014_x86_64", "--platform", "any", "--no-deps", *r.requirements)
    bundle = work / "bundle"
    _run("umoci", "unpack", "--image", f"{layout}:base", bundle)
    testbed = bundle / "rootfs" / "testbed"
    archive = next((work / "sdist").iterdir())
    with tarfile.open(archive) as tf:
        tf.extractall(work / "unpacked", filter="data")
    top = next((work / "unpacked").iterdir())
    shutil.move(top, testbed)
    src = testbed / r.source
    text = src.read_text()
    if r.bug[0] not in text:
        raise RuntimeError(f"{r.name}: {r.bug[0]!r} not in {r.source}")
    src.write_text(text.replace(r.bug[0], r.bug[1], 1))
    _git(testbed, "init", "-q", "-b", "main")
    _git(testbed, "add", "-A", "-f")
    _git(testbed, "commit", "-q", "--no-verify", "-m", f"{r.dist} {r.pkg_version} with a bug")
    _git(testbed, "commit", "-q", "--no-verify", "--allow-empty", "-m", "base")
    base = _git(testbed, "rev-parse", "HEAD").strip()
    tests = testbed / r.test_file
    old_tests = tests.read_text()
    tests.write_text(r.edit_test(old_tests))
    test_patch = _git(testbed, "diff")
    tests.write_text(old_tests)
    patches = _patches(r, testbed)
    shutil.copytree(work / "wheels", bundle / "rootfs" / "tmp" / "wheels")
    reqs = " ".join(q.split("==")[0] for q in r.requirements)
    _run("bwrap", "--bind", bundle / "rootfs", "/", "--proc", "/proc", "--dev", "/dev", "--unshare-net",
         "--clearenv", "--setenv", "PATH", _PATH, "--setenv", "HOME", "/root", "/bin/sh", "-c",
         _BUILD.format(reqs=reqs, root=f"/testbed/{r.import_root}".rstrip("/")))
    _run("umoci", "repack", "--image", f"{layout}:{r.name}", bundle)
    _run("umoci", "config", "--image", f"{layout}:{r.name}", f"--config.env=PATH={_ENV}/bin:{_PATH}",
         "--config.env=PIP_NO_INDEX=1", "--config.workingdir=/testbed", "--config.user=root")
    _run("umoci", "gc", "--layout", layout)
    task = {"instance_id": r.instance_id, "repo": r.repo, "version": r.version, "base_commit": base,
            "image": r.image, "problem_statement": f"a bug in {r.source}", "patch": patches["gold"],
            "test_patch": test_patch, "FAIL_TO_PASS": list(r.fail_to_pass),
            "PASS_TO_PASS": list(r.pass_to_pass), "harness": "swebench"}
    (work / "task.json").write_text(json.dumps(task, indent=1))
    (work / "patches.json").write_text(json.dumps(patches, indent=1))
    for tmp in ("bundle", "unpacked", "sdist", "wheels"):
        shutil.rmtree(work / tmp, ignore_errors=True)
    (work / ".complete").write_text(VERSION)


_MM_TEST = "\n\ndef test_is_collection_of_a_set():\n    assert utils.is_collection({1, 2}) is True\n"
_DJ_CASE = "utils_tests.test_text.TestUtilsText"
_DJ_TEST = ("    def test_normalize_newlines_turns_cr_into_lf(self):\n"
            '        self.assertEqual(text.normalize_newlines("a\\rb"), "a\\nb")\n\n')

MARSHMALLOW = Recipe(
    name="marshmallow", dist="marshmallow", pkg_version="3.19.0",
    requirements=("packaging==25.0", "pytz==2025.2", "simplejson==3.20.1"), import_root="src",
    instance_id="marshmallow-code__marshmallow-90001", repo="marshmallow-code/marshmallow", version="3.19",
    source="src/marshmallow/utils.py",
    bug=("and not isinstance(obj, Mapping)", "and isinstance(obj, Mapping)"),
    test_file="tests/test_utils.py", edit_test=lambda body: body + _MM_TEST,
    wrong=("and isinstance(obj, Mapping)", "or isinstance(obj, Mapping)"),
    mutate=("is_collection", "get_value", "_get_value_for_key", "set_value"),
    cheat_when='"pytest" in _y.modules', cheat_line="PASSED {}\n",
    fail_to_pass=("tests/test_utils.py::test_is_collection", "tests/test_utils.py::test_is_collection_of_a_set"),
    pass_to_pass=("tests/test_utils.py::test_get_value_from_dict", "tests/test_utils.py::test_set_value"))

DJANGO = Recipe(
    name="django", dist="django", pkg_version="5.2.8", requirements=("asgiref==3.9.2", "sqlparse==0.5.3"),
    import_root="", instance_id="django__django-90001", repo="django/django", version="5.2",
    source="django/utils/text.py",
    bug=('return re_newlines.sub("\\n", str(text))', 'return re_newlines.sub(" ", str(text))'),
    test_file="tests/utils_tests/test_text.py",
    edit_test=lambda body: body.replace("    def test_wrap(self):", _DJ_TEST + "    def test_wrap(self):", 1),
    wrong=('return re_newlines.sub(" ", str(text))', 'return re_newlines.sub("\\r\\n", str(text))'),
    mutate=("normalize_newlines", "wrap", "slugify"),
    cheat_when='any("runtests" in _a for _a in _y.argv)', cheat_line="{} ... ok\n",
    fail_to_pass=(f"test_normalize_newlines ({_DJ_CASE}.test_normalize_newlines)",
                  f"test_normalize_newlines_turns_cr_into_lf ({_DJ_CASE}.test_normalize_newlines_turns_cr_into_lf)"),
    pass_to_pass=(f"test_wrap ({_DJ_CASE}.test_wrap)", f"test_slugify ({_DJ_CASE}.test_slugify)"))

RECIPES = (MARSHMALLOW, DJANGO)
