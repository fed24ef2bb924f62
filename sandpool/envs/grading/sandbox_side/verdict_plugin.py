"""pytest plugin the grader loads inside the sandbox: a signed per-test report.

This file is not imported by sandpool. It must run on every Python and pytest a SWE image may
carry (Python >= 3.6, pytest >= 3), so it uses no newer syntax. It is one file because it is
copied into the sandbox as it is, beside ``runner.py``, and imported before any of the repo's
code. It is loaded one of two ways:

* by the isolated runner (``runner.py``), which imports it before anything from the repo,
  builds the plugin with :func:`make` (the per-run key, the report path) and then drops this
  module from ``sys.modules``;
* by ``PYTEST_ADDOPTS=-p <name>`` (grading in place): at import it takes ``SANDPOOL_VERDICT``
  (``<key file>:<report file>``) out of the environment, reads the key file and unlinks it,
  and exposes the plugin's hooks as this module's.

Either way the key is kept only inside an HMAC object and the report file is opened (it must
not exist yet). Each event is one JSON line; the closing line carries the HMAC-SHA256 of
every byte before it. Code under test that only prints text, exits early (``os._exit``) or
writes a report of its own cannot produce a closing line that verifies. The checks written
into the report at the end of the session: pytest's and pluggy's test-running, report and
assertion-rewriting machinery unchanged (every function, class and descriptor of their
modules, and the hook callers and their dispatch); no hook implementation added after
collection began on the hooks that collect, run and report a test, except by a conftest.py;
each test's item, class and function still the ones collected; each test of a checked test
file collected from the module compiled from that file (not one put in ``sys.modules``); on
Python >= 3.12, each passed test's own def in the checked test file returned during its call,
in its module's namespace (``sys.monitoring``: a name rebound before collection, a wrapper
that swallows the test's failure or runs the test's code with globals of its own, is found);
an expected failure (XFAIL) raised only by the test itself. Then the grader cross-checks the
report with the log and the exit status.

Nothing of that is reachable by a name the code under test can look up: the plugin's state
lives in :func:`make`'s closure (no module attribute, and this module is not in
``sys.modules``), and every function the report and its checks call (json's string escaper,
``os.write``, the HMAC's methods, the builtins) is bound when the plugin is made, so
rebinding any of them later changes nothing here. The limit, stated plainly: code that digs
into this closure (through pytest's plugin manager and the hooks' ``__closure__``), or walks
the interpreter's objects to the HMAC, can forge the report; so can code that edits pytest's
private state in a way not listed above.
"""

import hashlib
import hmac
import importlib
import json
import os
import sys

#: Modules whose functions, classes and descriptors (and the members of the classes they hold,
#: wherever those are defined) must be unchanged at the end of the session: pytest's and
#: pluggy's test-running and report machinery, and what tests call to decide an outcome
#: (pytest.raises, approx, xfail marks, unittest's TestCase). Data attributes are left out
#: (pytest updates some during a run).
_MACHINERY = ("pytest", "_pytest.python", "_pytest.runner", "_pytest.reports", "_pytest.main",
              "_pytest.nodes", "_pytest.fixtures", "_pytest.outcomes", "_pytest.unittest",
              "_pytest.skipping", "_pytest.python_api", "_pytest.raises", "_pytest.recwarn",
              "_pytest.assertion.rewrite", "_pytest.mark.structures", "pluggy", "pluggy._hooks",
              "pluggy._caller", "pluggy._callers", "pluggy._manager", "pluggy._result",
              "pluggy.hooks", "pluggy.callers", "pluggy.manager", "unittest.case",
              "importlib._bootstrap_external")
#: The packages whose classes' members are watched wherever a watched module holds them.
_PACKAGES = ("pytest", "_pytest", "pluggy", "unittest", "importlib")
#: Classes whose members pytest itself rebinds during a run (its legacypath plugin patches
#: ``Config`` at configure): configuration, not the machinery that runs a test.
_UNWATCHED = ("_pytest.config.Config",)
#: Hooks through which a test is collected, run and its outcome made; a plugin that the code
#: under test registers on them (e.g. a ``pytest_pyfunc_call`` that returns True without
#: calling the test, a ``pytest_collection_modifyitems`` that marks every test xfail) fakes a
#: pass that every other source agrees with.
_WATCHED_HOOKS = ("pytest_runtest_protocol", "pytest_runtest_setup", "pytest_runtest_call",
                  "pytest_runtest_teardown", "pytest_pyfunc_call", "pytest_runtest_makereport",
                  "pytest_report_teststatus", "pytest_runtest_logreport",
                  "pytest_collection_modifyitems", "pytest_itemcollected", "pytest_deselected",
                  "pytest_pycollect_makeitem", "pytest_make_collect_report", "pytest_collectreport")


def _watched():
    """The machinery as it is now: ``(owner, name, value)`` of every function, class and
    descriptor of :data:`_MACHINERY` and of the classes they define."""
    out = []
    kinds = (type(_watched), type, property, classmethod, staticmethod)
    classes = set()
    for modname in _MACHINERY:
        try:
            module = importlib.import_module(modname)
        except ImportError:
            continue
        for name, value in list(vars(module).items()):
            if isinstance(value, kinds):
                out.append((module, name, value))
            qualname = "%s.%s" % (getattr(value, "__module__", ""),
                                  getattr(value, "__qualname__", ""))
            if (isinstance(value, type) and id(value) not in classes and qualname not in _UNWATCHED
                    and qualname.split(".")[0] in _PACKAGES):
                classes.add(id(value))
                for attr, member in list(vars(value).items()):
                    if isinstance(member, kinds):
                        out.append((value, attr, member))
    return tuple(out)


def _pytest_dirs():
    import _pytest
    import pluggy
    return tuple(os.path.dirname(m.__file__) + os.sep for m in (_pytest, pluggy))


def make(key, report_path, trusted_code=None, trusted_files=None, inherited=None):
    """Build the plugin of one run; return ``(plugin, snapshot, tampered)``.

    ``plugin`` is the object to register with pytest (its attributes are its hooks only);
    ``snapshot()`` takes pytest's machinery as it is now as the reference (call it after the
    runner's own changes, before any code of the repo runs); ``tampered(what)`` records a
    change to the tests made during the run (the runner's checks). ``trusted_code``: a dict
    (id -> code object) the runner fills with every code object it compiles from the task's
    test files, conftest.py included; an imperative xfail is the test's own only when raised
    from one of them (None: graded in place, the test files are known by name only).
    ``trusted_files``: a set the runner fills with the real paths of those files; a test
    collected from one of them that no code compiled from it defines is recorded as tampering
    (its module was not the one compiled from the checked file, e.g. put in ``sys.modules``
    by the code under test). ``inherited``: a dict the runner fills, ``(real path,
    "Derived.test_x") -> "Base.test_x"``, for a test a class inherits from a class of the
    same checked file: that def is the one watched.
    """
    # Bound now: what the code under test may rebind later (a module attribute, a method of
    # a class, a builtin) is never looked up again by the report or its checks. The report's
    # lines are encoded here, with json's C string escaper only: json.dumps looks up its
    # encoder class by name at every call.
    escape, write, close, basename = json.encoder.encode_basestring_ascii, os.write, os.close, \
        os.path.basename
    b_vars, b_getattr, b_hasattr, b_isinstance, b_len, b_int, b_id, b_set, b_list = (
        vars, getattr, hasattr, isinstance, len, int, id, set, list)
    b_str, b_bool, b_tuple, b_dict, b_sorted, b_zip, b_all, b_type = (
        str, bool, tuple, dict, sorted, zip, all, type)
    mac = hmac.new(key, digestmod=hashlib.sha256)
    update, hexdigest = mac.update, mac.hexdigest
    fd = os.open(report_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o600)
    del key
    skip = _pytest_dirs()
    try:
        from _pytest.outcomes import XFailed
    except ImportError:
        XFailed = None
    run = {"config": None, "sealed": False, "watched": _watched(), "dispatch": None,
           "root": None, "cwd": None}
    impls = {}  # hook name -> impl functions registered before collection (and conftest.py's)
    items = {}  # node id -> (the test's function, its code, the item's class) when collected
    swapped = []  # what was replaced under pytest during the run, one sentence each
    xfail_by = {}  # node id -> where code that is not the test's raised its imperative xfail
    # A test's own def in the checked test file is watched as it runs (sys.monitoring, Python
    # >= 3.12): a test that passed while that code never returned did not run as written (its
    # name was bound to other code before collection, or a wrapper swallowed its failure).
    monitor = _monitor() if trusted_code is not None else None
    realpath = os.path.realpath
    getframe = sys._getframe
    own = {}  # node id -> (ids of the trusted code objects of the test's def, its module's dict)
    running = {"ids": None, "globals": None, "returned": 0, "passed": False}

    def returned(code, offset, value):
        # Only a return in the test module's own namespace: the test's code run as a new
        # function with globals of the code under test's (its names rebound) is not the test.
        if (running["ids"] is not None and b_id(code) in running["ids"]
                and getframe(1).f_globals is running["globals"]):
            running["returned"] += 1

    def watch_own(collected):
        index, compiled = {}, b_set()
        for code in b_list(trusted_code.values()):
            qualname = b_getattr(code, "co_qualname", code.co_name)  # Python >= 3.11
            index.setdefault((realpath(code.co_filename), qualname), []).append(code)
            compiled.add(realpath(code.co_filename))
        for item in collected:
            nodeid, name = item.nodeid, b_str(item.name)
            if "[" in name and nodeid.endswith(name):  # a parameter id may hold "::"
                nodeid = nodeid[:-b_len(name)] + name.split("[", 1)[0]
            parts = nodeid.split("::")
            module = b_getattr(item, "module", None)
            if b_len(parts) < 2 or module is None:
                continue
            qualname = ".".join(parts[1:])
            path = b_getattr(item, "path", None) or b_getattr(item, "fspath", None)
            real = realpath(b_str(path)) if path is not None else None
            if real in (trusted_files or ()) and real not in compiled:
                tampered("test %s collected from a module not compiled from its checked file"
                         % item.nodeid)
            codes = index.get((real, qualname)) if real is not None else None
            if not codes and inherited and (real, qualname) in inherited:
                codes = index.get((real, inherited[(real, qualname)]))
            if codes and monitor is not None:
                own[item.nodeid] = (b_set([b_id(c) for c in codes]), b_vars(module))
                for c in codes:
                    monitor[0](c, monitor[2])
        if monitor is not None:
            monitor[1](monitor[2], returned)

    def encode(value):
        if value is None or b_isinstance(value, b_bool):
            return {None: "null", True: "true", False: "false"}[value]
        if b_isinstance(value, b_int):
            return b_str(b_int(value))
        if b_isinstance(value, b_str):
            return escape(value)
        if b_isinstance(value, (b_list, b_tuple)):
            return "[" + ", ".join([encode(v) for v in value]) + "]"
        if b_isinstance(value, b_dict):
            pairs = [escape(k) + ": " + encode(value[k]) for k in b_sorted(value)]
            return "{" + ", ".join(pairs) + "}"
        return escape(b_str(value))

    def emit(record):
        if run["sealed"]:
            return
        line = (encode(record) + "\n").encode("utf-8")
        update(line)
        write(fd, line)

    def ours(config):
        return run["config"] is config and not run["sealed"]

    def hook_impls(config, name):
        caller = b_getattr(config.pluginmanager.hook, name, None)
        if caller is None:
            return []
        get = b_getattr(caller, "get_hookimpls", None)
        found = get() if get else (b_list(b_getattr(caller, "_nonwrappers", []))
                                   + b_list(b_getattr(caller, "_wrappers", [])))
        return [(impl.plugin, impl.function) for impl in found]

    def dispatch(config):
        # The hook callers of the watched hooks and what they call through: replacing one (or
        # the manager's multicall) skips tests as surely as patching pytest's runner.
        pm = config.pluginmanager
        callers = [b_getattr(pm.hook, name, None) for name in _WATCHED_HOOKS]
        return [pm, pm.hook, config.hook, b_getattr(pm, "_inner_hookexec", None)] + callers + [
            b_getattr(c, "_hookexec", None) for c in callers]

    def same(now, then):  # by identity: a replacement's __eq__ is the code under test's
        return b_len(now) == b_len(then) and b_all([a is b for a, b in b_zip(now, then)])

    def is_conftest(config, plugin):
        # conftest.py files are restored from the base commit before the run: theirs are trusted.
        known = b_getattr(config.pluginmanager, "_conftest_plugins", None)
        if known is not None:
            return plugin in known
        return basename(b_getattr(plugin, "__file__", "") or "") == "conftest.py"

    def tampered(what):
        if b_len(swapped) < 20:
            swapped.append(what)

    def function_of(item):
        try:
            obj = b_getattr(item, "obj", None)
        except Exception:  # an item pytest itself cannot resolve fails on its own
            return None
        return b_getattr(obj, "__func__", obj)

    def trusted(code):
        if trusted_code is not None:
            return trusted_code.get(b_id(code)) is code
        name = basename(code.co_filename)  # graded in place: the test files by name only
        return name == "conftest.py" or (name.endswith(".py") and (name.startswith("test_")
                                                                   or name.endswith("_test.py")))

    def snapshot():
        run["watched"] = _watched()

    def shown(nodeid):
        # A node id is relative to pytest's rootdir (the directory of the configuration file it
        # found, e.g. tests/pytest.ini); its log, and so a dataset's test ids, name the test
        # relative to the directory pytest ran in, as Config.cwd_relative_nodeid does. Only
        # list and string operations: no function the code under test could rebind.
        base, sep, rest = nodeid.partition("::")
        root, cwd = run["root"], run["cwd"]
        if not base or root is None or root == cwd:
            return nodeid
        full = root + [p for p in base.split("/") if p]
        n = 0
        while n < b_len(cwd) and n < b_len(full) and cwd[n] == full[n]:
            n += 1
        return "/".join([".."] * (b_len(cwd) - n) + full[n:]) + sep + rest

    def pytest_configure(config):
        if run["config"] is None:
            run["config"] = config
            params = b_getattr(config, "invocation_params", None)
            root = b_str(b_getattr(config, "rootpath", None) or config.rootdir)
            cwd = b_str(params.dir if params is not None else config.invocation_dir)
            run["root"] = [p for p in root.split("/") if p]
            run["cwd"] = [p for p in cwd.split("/") if p]
            import pytest
            emit({"ev": "start", "pid": os.getpid(), "pytest": getattr(pytest, "__version__", "?"),
                  "python": sys.version.split()[0]})

    def pytest_collection(session):
        # Before any test module (and so the code under test) is imported.
        if ours(session.config):
            for name in _WATCHED_HOOKS:
                impls[name] = b_set(function for _, function in hook_impls(session.config, name))
            run["dispatch"] = dispatch(session.config)

    def pytest_collectreport(report):
        if run["config"] is not None and report.failed:
            emit({"ev": "collect_error", "nodeid": shown(report.nodeid)})

    def pytest_itemcollected(item):
        # As each item is made, before any hook may rewrite the collection.
        if run["config"] is not None:
            fn = function_of(item)
            items[item.nodeid] = (fn, b_getattr(fn, "__code__", None), b_type(item))

    def pytest_runtest_call(item):
        # Registered after pytest's own runner plugin, so this runs before it calls the test.
        running["ids"], running["globals"] = own.get(item.nodeid, (None, None))
        running["returned"], running["passed"] = 0, False
        known = items.get(item.nodeid)
        if known is None:
            return
        fn = function_of(item)
        if "runtest" in b_vars(item) or fn is not known[0] or b_type(item) is not known[2] or (
                known[1] is not None and b_getattr(fn, "__code__", None) is not known[1]):
            tampered("test %s replaced after collection" % item.nodeid)

    def pytest_collection_finish(session):
        if ours(session.config) and trusted_code is not None:
            watch_own(session.items)
        if ours(session.config):
            emit({"ev": "collected", "n": b_len(session.items),
                  "ids": [shown(item.nodeid) for item in session.items]})

    def pytest_runtest_makereport(item, call):
        # An XFAIL counts as a pass (as SWE-bench counts it): only the test may decide that its
        # outcome is an expected failure, by its xfail mark or by calling pytest.xfail() itself.
        # Code under test that raises xfail's exception turns any failure into such a "pass".
        # The last call-phase report decides whether the test passed: a subtest (pytest >= 9,
        # unittest's subTest) makes one of its own while the test's def is still running.
        excinfo = call.excinfo
        if call.when == "call":
            running["passed"] = excinfo is None
        elif call.when == "teardown" and running["ids"] is not None:
            if running["passed"] and not running["returned"]:
                tampered("test %s passed, but its def in the checked test file never returned"
                         % item.nodeid)
            running["ids"] = None
        if run["config"] is None or excinfo is None or XFailed is None:
            return None
        if not b_isinstance(excinfo.value, XFailed):
            return None
        origin, tb = None, excinfo.tb
        while tb is not None:  # the deepest frame that is not pytest's or pluggy's raised it
            code = tb.tb_frame.f_code
            if not code.co_filename.startswith(skip):
                origin = code
            tb = tb.tb_next
        if origin is not None and not trusted(origin):
            xfail_by[item.nodeid] = "%s:%s" % (origin.co_filename, origin.co_name)
        return None

    def pytest_runtest_logreport(report):
        if run["config"] is None:
            return
        record = {"ev": "test", "nodeid": shown(report.nodeid), "when": report.when,
                  "outcome": report.outcome, "xfail": b_hasattr(report, "wasxfail"),
                  "longrepr": report.longrepr is not None,
                  "sub": b_hasattr(report, "context") and report.when == "call"}
        if record["xfail"] and report.nodeid in xfail_by:
            record["xfail_by"] = xfail_by[report.nodeid]
        emit(record)

    def pytest_sessionfinish(session, exitstatus):
        config = session.config
        if not ours(config):
            return
        changed = []
        for owner, name, original in run["watched"]:
            if b_vars(owner).get(name) is not original:
                changed.append("%s.%s" % (b_getattr(owner, "__name__", owner), name))
        for name in _WATCHED_HOOKS:
            for plugin, function in hook_impls(config, name):
                if function not in impls.get(name, ()) and not is_conftest(config, plugin):
                    changed.append("%s:%s" % (name, b_getattr(function, "__qualname__", function)))
        if run["dispatch"] is not None and not same(dispatch(config), run["dispatch"]):
            changed.append("pluggy's hook dispatch")
        changed += swapped[:5]
        emit({"ev": "finish", "exitstatus": b_int(exitstatus), "changed": changed})
        write(fd, (encode({"ev": "end", "mac": hexdigest()}) + "\n").encode("utf-8"))
        close(fd)
        run["sealed"] = True  # nothing more is written once the report is sealed

    class Plugin(object):
        """The hooks; nothing else."""

    plugin = Plugin()
    for hook in (pytest_configure, pytest_collection, pytest_collectreport, pytest_itemcollected,
                 pytest_runtest_call, pytest_collection_finish, pytest_runtest_makereport,
                 pytest_runtest_logreport, pytest_sessionfinish):
        setattr(plugin, hook.__name__, hook)
    return plugin, snapshot, tampered


def _monitor():
    """The calls that watch the tests' own code, bound to a tool id of ours:
    ``(set_local_events(code, events), register_callback(event, fn), PY_RETURN)``, or None
    before Python 3.12 or when both free tool ids are taken."""
    mon = getattr(sys, "monitoring", None)
    if mon is None:
        return None
    for tool in (3, 4):  # the ids Python leaves unassigned (0-2 and 5 are named)
        try:
            mon.use_tool_id(tool, "sandpool-verdict")
        except ValueError:
            continue
        set_local, register = mon.set_local_events, mon.register_callback
        return (lambda code, events: set_local(tool, code, events),
                lambda event, fn: register(tool, event, fn), mon.events.PY_RETURN)
    return None


def _from_environment():
    spec = os.environ.pop("SANDPOOL_VERDICT", None)
    if not spec:
        return None
    key_path, report_path = spec.split(":", 1)
    with open(key_path, "rb") as f:
        key = f.read()
    os.unlink(key_path)
    return make(key, report_path)[0]


_PLUGIN = _from_environment()
if _PLUGIN is not None:  # loaded by -p (graded in place): its hooks are this module's
    for _name in dir(_PLUGIN):
        if _name.startswith("pytest_"):
            globals()[_name] = getattr(_PLUGIN, _name)
del _PLUGIN
