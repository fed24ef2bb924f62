"""pytest plugin the grader loads inside the sandbox: a signed per-test report.

This file is not imported by sandpool. It must run on every Python and pytest a SWE image may
carry (Python >= 3.6, pytest >= 3), so it uses no newer syntax. It is loaded one of two ways:

* by the isolated runner (``runner.py``), which imports it before anything from the repo and
  hands it the per-run key and the report path with :func:`arm`;
* by ``PYTEST_ADDOPTS=-p <name>`` (grading in place): at import it takes ``SANDPOOL_VERDICT``
  (``<key file>:<report file>``) out of the environment, reads the key file and unlinks it.

Either way the key is kept only inside an HMAC object and the report file is opened (it must
not exist yet). Each event is one JSON line; the closing line carries the HMAC-SHA256 of
every byte before it. Code under test that only prints text, exits early (``os._exit``) or
writes a report of its own cannot produce a closing line that verifies. Code that
deliberately walks the interpreter's objects to reach the HMAC state could; the integrity
check below (pytest's own test-running, report and assertion-rewriting machinery unchanged at
the end of the session, and no hook implementation on the hooks that run a test and make its
report added after collection began, except by a conftest.py) and the grader's cross-checks
against the log and the exit status remain. Its limit: code under test that edits a test's
function object or pytest's private state in a way not listed here is not caught.
"""

import hashlib
import hmac
import json
import os
import sys


def _state(key, report_path):
    mac = hmac.new(key, digestmod=hashlib.sha256)
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    return [mac, fd, None]  # None: the Config this report belongs to, set at configure


def _open():
    spec = os.environ.pop("SANDPOOL_VERDICT", None)
    if not spec:
        return None
    key_path, report_path = spec.split(":", 1)
    with open(key_path, "rb") as f:
        key = f.read()
    os.unlink(key_path)
    return _state(key, report_path)


_STATE = _open()


#: Code objects compiled from the task's test files, by id (None: not known, see _trusted).
_TRUSTED_CODE = None


def arm(key, report_path, trusted_code=None):
    """Start the report at ``report_path`` under ``key`` (the isolated runner's way in).

    ``trusted_code``: a dict (id -> code object) the runner fills with every code object it
    compiles from the task's test files, conftest.py included; an imperative xfail is the
    test's own only when raised from one of them.
    """
    global _STATE, _TRUSTED_CODE
    _STATE = _state(key, report_path)
    _TRUSTED_CODE = trusted_code


_MACHINERY = ("pytest", "_pytest.python", "_pytest.runner", "_pytest.reports", "_pytest.main",
              "_pytest.nodes", "_pytest.fixtures", "_pytest.outcomes", "_pytest.unittest",
              "_pytest.skipping", "_pytest.python_api", "_pytest.raises", "_pytest.recwarn",
              "_pytest.assertion.rewrite", "unittest.case", "importlib._bootstrap_external")


def _watched():
    # pytest's test-running and report machinery as it is before the code under test is
    # imported, and what tests call to decide an outcome (pytest.raises, approx, xfail
    # marks, unittest's TestCase): every function, class and descriptor of these modules
    # and of the classes they define. Data attributes are left out (pytest updates some
    # during a run).
    import importlib
    out = []
    kinds = (type(_open), type, property, classmethod, staticmethod)
    for modname in _MACHINERY:
        try:
            module = importlib.import_module(modname)
        except ImportError:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, kinds):
                out.append((module, name, value))
            if isinstance(value, type) and value.__module__ == modname:
                for attr, member in list(vars(value).items()):
                    if isinstance(member, kinds):
                        out.append((value, attr, member))
    return out


_WATCHED = _watched()


def snapshot():
    """Take pytest's machinery as it is now as the reference (after the runner's own changes)."""
    global _WATCHED
    _WATCHED = _watched()


#: Hooks through which a test is run and its outcome made; a plugin that the code under test
#: registers on them (e.g. a ``pytest_pyfunc_call`` that returns True without calling the
#: test) fakes a pass that every other source agrees with.
_RUN_HOOKS = ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call",
              "pytest_runtest_teardown", "pytest_pyfunc_call", "pytest_runtest_makereport",
              "pytest_report_teststatus", "pytest_runtest_logreport")
_IMPLS = {}  # hook name -> impl functions registered before collection (and conftest.py's)


def _impls(config, name):
    caller = getattr(config.pluginmanager.hook, name, None)
    if caller is None:
        return []
    get = getattr(caller, "get_hookimpls", None)
    impls = get() if get else list(getattr(caller, "_nonwrappers", [])) + list(getattr(caller, "_wrappers", []))
    return [(impl.plugin, impl.function) for impl in impls]


def _is_conftest(config, plugin):
    # conftest.py files are restored from the base commit before the run, so theirs are trusted.
    known = getattr(config.pluginmanager, "_conftest_plugins", None)
    if known is not None:
        return plugin in known
    return os.path.basename(getattr(plugin, "__file__", "") or "") == "conftest.py"


def _added_impls(config):
    out = []
    for name in _RUN_HOOKS:
        for plugin, function in _impls(config, name):
            if function not in _IMPLS.get(name, ()) and not _is_conftest(config, plugin):
                out.append("%s:%s" % (name, getattr(function, "__qualname__", function)))
    return out


def _emit(record):
    if _STATE is None or _STATE[2] is False:
        return
    line = (json.dumps(record, sort_keys=True) + "\n").encode("utf-8")
    _STATE[0].update(line)
    os.write(_STATE[1], line)


def _ours(config):
    return _STATE is not None and _STATE[2] is config


def pytest_configure(config):
    if _STATE is not None and _STATE[2] is None:
        _STATE[2] = config
        import pytest
        _emit({"ev": "start", "pid": os.getpid(), "pytest": getattr(pytest, "__version__", "?"),
               "python": sys.version.split()[0]})


def pytest_collection(session):
    # Before any test module (and so the code under test) is imported.
    if _ours(session.config):
        for name in _RUN_HOOKS:
            _IMPLS[name] = set(function for _, function in _impls(session.config, name))


def pytest_collectreport(report):
    if _STATE is not None and _STATE[2] and report.failed:
        _emit({"ev": "collect_error", "nodeid": report.nodeid})


_ITEMS = {}  # node id -> (the test's function, its code) when pytest collected it
_SWAPPED = []  # what was replaced under pytest during the run, one sentence each


def tampered(what):
    """Record a change to the tests made during the run (the isolated runner's checks)."""
    if len(_SWAPPED) < 20:
        _SWAPPED.append(what)


def _function(item):
    try:
        obj = getattr(item, "obj", None)
    except Exception:  # an item pytest itself cannot resolve fails on its own
        return None
    return getattr(obj, "__func__", obj)


def pytest_itemcollected(item):
    # As each item is made, before any hook may rewrite the collection.
    if _STATE is not None and _STATE[2]:
        fn = _function(item)
        _ITEMS[item.nodeid] = (fn, getattr(fn, "__code__", None))


def pytest_runtest_call(item):
    # Registered after pytest's own runner plugin, so this runs before it calls the test.
    known = _ITEMS.get(item.nodeid)
    if known is None:
        return
    fn = _function(item)
    if "runtest" in vars(item) or fn is not known[0] or (
            known[1] is not None and getattr(fn, "__code__", None) is not known[1]):
        tampered("test %s replaced after collection" % item.nodeid)


def pytest_collection_finish(session):
    if _ours(session.config):
        _emit({"ev": "collected", "n": len(session.items),
               "ids": [item.nodeid for item in session.items]})


_XFAIL_BY = {}  # node id -> where code that is not the test's raised its imperative xfail


def _pytest_dirs():
    import _pytest
    import pluggy
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (_pytest, pluggy))


def _trusted(code):
    if _TRUSTED_CODE is not None:
        return _TRUSTED_CODE.get(id(code)) is code
    # Graded in place (no isolated runner): the test files by name only.
    name = os.path.basename(code.co_filename)
    return name == "conftest.py" or (name.endswith(".py") and (name.startswith("test_")
                                                               or name.endswith("_test.py")))


def pytest_runtest_makereport(item, call):
    # An XFAIL counts as a pass (as SWE-bench counts it): only the test may decide that its
    # outcome is an expected failure, by its xfail mark or by calling pytest.xfail() itself.
    # Code under test that raises xfail's exception turns any failure into such a "pass".
    excinfo = call.excinfo
    if _STATE is None or not _STATE[2] or excinfo is None:
        return None
    try:
        from _pytest.outcomes import XFailed
    except ImportError:
        return None
    if not isinstance(excinfo.value, XFailed):
        return None
    skip = _pytest_dirs()
    origin, tb = None, excinfo.tb
    while tb is not None:  # the deepest frame that is not pytest's or pluggy's raised it
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip):
            origin = code
        tb = tb.tb_next
    if origin is not None and not _trusted(origin):
        _XFAIL_BY[item.nodeid] = "%s:%s" % (origin.co_filename, origin.co_name)
    return None


def pytest_runtest_logreport(report):
    if _STATE is None or not _STATE[2]:
        return
    record = {"ev": "test", "nodeid": report.nodeid, "when": report.when,
              "outcome": report.outcome, "xfail": hasattr(report, "wasxfail"),
              "longrepr": report.longrepr is not None}
    if record["xfail"] and report.nodeid in _XFAIL_BY:
        record["xfail_by"] = _XFAIL_BY[report.nodeid]
    _emit(record)


def pytest_sessionfinish(session, exitstatus):
    if not _ours(session.config):
        return
    changed = []
    for owner, name, original in _WATCHED:
        if vars(owner).get(name) is not original:
            changed.append("%s.%s" % (getattr(owner, "__name__", owner), name))
    changed += _added_impls(session.config)
    changed += _SWAPPED[:5]
    _emit({"ev": "finish", "exitstatus": int(exitstatus), "changed": changed})
    digest = _STATE[0].hexdigest()
    os.write(_STATE[1], (json.dumps({"ev": "end", "mac": digest}) + "\n").encode("utf-8"))
    os.close(_STATE[1])
    _STATE[2] = False  # nothing more is written once the report is sealed
