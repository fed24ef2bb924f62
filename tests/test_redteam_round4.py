"""Red-team of the verdict plugin's check that a passed test's own def returned (Python >= 3.12).

Through :class:`DiffGrader` and ``run_rollout`` on the local backend (calc image: Python 3.12,
pytest 9), on variants of the calc task whose test patch adds tests:

* no false positive: tests of many honest styles (unittest methods, subTest and pytest's
  ``subtests``, mock decorators, decorators with and without ``functools.wraps``, parametrize
  ids holding ``::`` and ``[``, nested and inherited classes, a name defined twice, yield
  fixtures and a conftest's, xfail, static and class methods, a test package in a
  subdirectory, ``pytest_generate_tests``, threads, skips and expected failures) score 1 with
  the gold patch and 0 without it, no test reported as tampered with;
* attacks by the code under test (calc.py, the fix space) score 0: the tests swapped for
  wrappers that run the real test's code with globals of their own, swallow its failure, or
  free the plugin's ``sys.monitoring`` tool ids first; class tests' methods rebound before
  collection; a fake test module put in ``sys.modules``; pytest's cached ``item.obj`` pointed
  at a passing function.
"""

from __future__ import annotations

import pytest

from sandpool.core import Outcome

from .test_redteam_round3 import _buggy_calc_with, _graded


def _new_files(files: dict[str, str]) -> str:
    """A unified diff creating ``files`` (path -> text ending in a newline)."""
    out = []
    for path, text in files.items():
        lines = text.splitlines()
        out.append(f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
                   f"@@ -0,0 +1,{len(lines)} @@\n" + "".join(f"+{line}\n" for line in lines))
    return "".join(out)


_STYLES = '''\
import functools
import threading
import unittest
from unittest import mock

import pytest

import calc
from calc import add


class TestUnit(unittest.TestCase):
    def test_unit(self):
        self.assertEqual(add(2, 3), 5)

    @mock.patch("calc.add", wraps=calc.add)
    def test_mock_patch(self, spy):
        self.assertEqual(calc.add(2, 3), 5)
        spy.assert_called_once_with(2, 3)

    def test_skipped_inside(self):
        self.skipTest("skipped by the test")

    @unittest.expectedFailure
    def test_expected_failure(self):
        self.assertEqual(add(2, 2), 5)

    def test_subtests(self):
        for a in (1, 2):
            with self.subTest(a=a):
                self.assertEqual(add(a, a), 2 * a)


@mock.patch.object(calc, "add", wraps=calc.add)
def test_patch_object(spy):
    assert calc.add(2, 3) == 5
    assert spy.called


def wrapped(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        return fn(*args, **kwargs)
    return wrapper


def plain(fn):
    def runner():
        fn()
    return runner


@wrapped
def test_wraps():
    assert add(2, 3) == 5


@plain
def test_plain_decorator():
    assert add(2, 3) == 5


@pytest.mark.parametrize(("a", "b", "want"), [(2, 3, 5), (1, 1, 2)], ids=["two::three", "one[1]"])
def test_param(a, b, want):
    assert add(a, b) == want


class TestClass:
    def test_method(self):
        assert add(2, 3) == 5

    class TestNested:
        def test_nested(self):
            assert add(2, 3) == 5

    @staticmethod
    def test_static():
        assert add(2, 3) == 5

    @classmethod
    def test_classmethod(cls):
        assert add(2, 3) == 5


class Base:
    def test_inherited(self):
        assert add(2, 3) == 5


class TestDerived(Base):
    pass


def test_twice():
    assert False, "the first definition is never collected"


def test_twice():
    assert add(2, 3) == 5


@pytest.fixture
def pair():
    yield 2, 3


def test_fixture(pair, tmp_path):
    assert add(*pair) == 5


@pytest.mark.xfail(strict=False, reason="passes")
def test_xpass():
    assert add(0, 0) == 0


@pytest.mark.xfail(strict=False, reason="fails")
def test_xfail():
    assert add(2, 2) == 5


def test_thread():
    out = []

    def work():
        out.append(add(2, 3))

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert out == [5]


def test_subtests_fixture(subtests):
    for a in (1, 2):
        with subtests.test(a=a):
            assert add(a, a) == 2 * a


def test_skip_inside():
    pytest.skip("skipped by the test")


def test_from_conftest(conftest_value):
    assert add(*conftest_value) == 5
'''

_SUB = '''\
from calc import add


def test_in_package():
    assert add(2, 3) == 5


class TestInPackage:
    def test_method(self):
        assert add(2, 3) == 5
'''

_CONFTEST = '''\
import pytest


@pytest.fixture
def conftest_value():
    yield 2, 3


def pytest_generate_tests(metafunc):
    if "generated" in metafunc.fixturenames:
        metafunc.parametrize("generated", [(2, 3)], ids=["gen"])
'''

_GENERATED = '''\
from calc import add


def test_generated(generated):
    assert add(*generated) == 5
'''

_F2P = tuple(f"test_styles.py::{t}" for t in (
    "TestUnit::test_unit", "TestUnit::test_mock_patch", "TestUnit::test_subtests", "test_subtests_fixture",
    "test_patch_object",
    "test_wraps", "test_plain_decorator", "test_param[two::three]", "test_param[one[1]]",
    "TestClass::test_method", "TestClass::TestNested::test_nested", "TestClass::test_static",
    "TestClass::test_classmethod", "TestDerived::test_inherited", "test_twice", "test_fixture",
    "test_thread", "test_from_conftest")) + (
    "sub/test_sub.py::test_in_package", "sub/test_sub.py::TestInPackage::test_method",
    "test_gen.py::test_generated[gen]")
#: test_xpass runs unlisted: an XPASS is no pass to the pack's harness (nor to SWE-bench's parser).
_P2P = ("test_calc.py::test_zero", "test_styles.py::test_xfail", "test_styles.py::TestUnit::test_expected_failure")


@pytest.fixture(scope="module")
def styles_task(calc_task):
    """The calc task with the honest styles added by its test patch."""
    patch = _new_files({"test_styles.py": _STYLES, "sub/__init__.py": "\n", "sub/test_sub.py": _SUB,
                        "conftest.py": _CONFTEST, "test_gen.py": _GENERATED})
    return calc_task.model_copy(update={"instance_id": "calc__styles-1", "test_patch": patch,
                                        "FAIL_TO_PASS": _F2P, "PASS_TO_PASS": _P2P})


def _write(path: str, data: bytes):
    async def episode(lease) -> None:
        await lease.write_file(path, data)
    return episode


async def test_honest_styles_score_1_with_the_gold_patch(test_images_root, styles_task):
    gold = styles_task.patch.split("+++ b/calc.py\n", 1)[1]
    assert "+    return a + b" in gold
    result, _, infra = await _graded(test_images_root, styles_task,
                                     _write("calc.py", b"def add(a, b):\n    return a + b\n"))
    assert infra == {}, infra
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result


async def test_honest_styles_score_0_without_the_fix(test_images_root, styles_task):
    async def nothing(lease) -> None:
        pass

    result, _, infra = await _graded(test_images_root, styles_task, nothing)
    assert infra == {}, infra
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 0.0), result
    assert "never returned" not in str(result), result


# -- attacks by the code under test -------------------------------------------------------------

#: Finds the test module importing calc; ``_swap`` (each attack's own) then runs at each line of
#: that module as it executes, so it sees each test the moment it is defined.
_TRACE = """\
import sys, types
_f = sys._getframe(1)
while _f is not None and "test_" not in _f.f_globals.get("__name__", ""):
    _f = _f.f_back
_done = set()


def _swap(frame, event, arg):
    for name in NAMES:
        real = frame.f_globals.get(name)
        if real is not None and name not in _done:
            _done.add(name)
            frame.f_globals[name] = fake_of(real)
    return _swap


_f.f_trace = _swap
sys.settrace(lambda *a: None)
"""

_OWN_GLOBALS = """\
NAMES = ("test_add", "test_zero")


def fake_of(real):
    def fake():  # the real test's code, run with add() fixed in a namespace of its own
        types.FunctionType(real.__code__, dict(real.__globals__, add=lambda a, b: a + b))()
    return fake
"""

_SWALLOW = """\
NAMES = ("test_add", "test_zero")


def fake_of(real):
    def fake():
        try:
            real()
        except AssertionError:
            pass
    return fake
"""

_FREE_TOOLS = """\
import sys
NAMES = ("test_add", "test_zero")
for _tool in (3, 4):  # the verdict plugin's own tool id, whichever it took
    try:
        sys.monitoring.free_tool_id(_tool)
        sys.monitoring.use_tool_id(_tool, "mine")
    except ValueError:
        pass


def fake_of(real):
    return lambda: None
"""


_PATCHED_GLOBALS = """\
NAMES = ("test_add", "test_zero")


def fake_of(real):
    def fake():  # the real test's code, in its own module, with that module's add() fixed meanwhile
        g = real.__globals__
        old = g["add"]
        g["add"] = lambda a, b: a + b
        try:
            real()
        finally:
            g["add"] = old
    return fake
"""


@pytest.mark.parametrize("attack", [_OWN_GLOBALS, _SWALLOW, _FREE_TOOLS],
                         ids=["real-code-own-globals", "swallow-assertion", "free-tool-ids"])
async def test_tests_swapped_for_wrappers_of_the_real_code_score_0(test_images_root, calc_task, attack):
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(attack + _TRACE))
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_calc.py", timeout=60)
        print("POLICY'S OWN RUN", res.text[-300:])
        assert "2 passed" in res.text, res.text  # the attack fakes the fix where the policy runs the tests

    result, _, infra = await _graded(test_images_root, calc_task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result


_CLASSES = '''\
import unittest

from calc import add


class TestAdd:
    def test_add(self):
        assert add(2, 3) == 5


class TestAddUnit(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)
'''


@pytest.fixture(scope="module")
def classes_task(calc_task):
    """The calc task whose failing tests are methods of classes in a second test module."""
    return calc_task.model_copy(update={
        "instance_id": "calc__classes-1", "test_patch": _new_files({"test_cls.py": _CLASSES}),
        "FAIL_TO_PASS": ("test_cls.py::TestAdd::test_add", "test_cls.py::TestAddUnit::test_add"),
        "PASS_TO_PASS": ("test_calc.py::test_zero",)})


#: A tracer for the lines of test_cls.py's module code: each test class, once defined, has its
#: test rebound to one that passes, before pytest collects it.
_METHODS_REBOUND = """\
import sys


def _passes(self):
    pass


def _lines(frame, event, arg):
    for name in ("TestAdd", "TestAddUnit"):
        cls = frame.f_globals.get(name)
        if isinstance(cls, type) and "test_add" in vars(cls):
            cls.test_add = _passes
    return _lines


def _calls(frame, event, arg):
    if frame.f_globals.get("__name__") == "test_cls" and frame.f_code.co_name == "<module>":
        return _lines
    return None


sys.settrace(_calls)
"""


#: Imported by test_calc.py, collected first: test_cls is a module of the code under test's.
_MODULE_PREFILLED = """\
import os, sys, types, unittest
_m = types.ModuleType("test_cls")
_m.__file__ = os.path.abspath("test_cls.py")
exec("import unittest\\nclass TestAdd:\\n    def test_add(self): pass\\n"
     "class TestAddUnit(unittest.TestCase):\\n    def test_add(self): pass\\n", _m.__dict__)
sys.modules["test_cls"] = _m
"""

#: At the first call of add() (test_calc.py's tests run first), every test item later in the
#: session is pointed at a function that passes: pytest's cached ``item.obj``.
_ITEM_OBJ = """\
import gc
_swapped = []


def _passes(*args):
    pass


def add(a, b):
    if not _swapped:
        for o in gc.get_objects():
            if type(o).__name__ in ("Function", "TestCaseFunction") and "test_cls" in getattr(o, "nodeid", ""):
                o._obj = _passes
                _swapped.append(o)
    return a - b
"""


@pytest.mark.parametrize("attack", [_METHODS_REBOUND, _MODULE_PREFILLED, _ITEM_OBJ],
                         ids=["class-methods-rebound", "sys-modules-prefilled", "item-obj-cache"])
async def test_class_tests_swapped_by_the_code_under_test_score_0(test_images_root, classes_task, attack):
    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(attack))
        await lease.write_file("test_cls.py", _CLASSES.encode())  # the policy's own copy, removed after
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_calc.py test_cls.py; rm test_cls.py",
                               timeout=60)
        print("POLICY'S OWN RUN", res.text[-600:])
        assert "3 passed" in res.text, res.text  # the attack fakes the fix where the policy runs the tests

    result, _, infra = await _graded(test_images_root, classes_task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result


async def test_the_class_tests_score_1_with_the_gold_patch(test_images_root, classes_task):
    result, _, infra = await _graded(test_images_root, classes_task,
                                     _write("calc.py", b"def add(a, b):\n    return a + b\n"))
    assert infra == {}, infra
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result


_INHERITED = '''\
from calc import add


class Base:
    def test_add(self):
        assert add(2, 3) == 5


class TestDerived(Base):
    pass
'''

#: TestDerived, once defined, gets a test_add of its own that passes: its node id names no def
#: of the checked file (the real one is Base.test_add), so no def is watched for it.
_INHERITED_REBOUND = """\
import sys


def _passes(self):
    pass


def _lines(frame, event, arg):
    cls = frame.f_globals.get("TestDerived")
    if isinstance(cls, type) and "test_add" not in vars(cls):
        cls.test_add = _passes
    return _lines


_f = sys._getframe(1)
while _f is not None and _f.f_globals.get("__name__") != "test_inh":
    _f = _f.f_back
_f.f_trace = _lines
sys.settrace(lambda *a: None)
"""


async def test_an_inherited_test_rebound_on_its_class_scores_0(test_images_root, calc_task):
    task = calc_task.model_copy(update={
        "instance_id": "calc__inherited-1", "test_patch": _new_files({"test_inh.py": _INHERITED}),
        "FAIL_TO_PASS": ("test_inh.py::TestDerived::test_add",), "PASS_TO_PASS": ()})
    gold, _, _ = await _graded(test_images_root, task, _write("calc.py", b"def add(a, b):\n    return a + b\n"))
    assert (gold.outcome, gold.reward) == (Outcome.COMPLETED, 1.0), gold

    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_INHERITED_REBOUND))
        await lease.write_file("test_inh.py", _INHERITED.encode())  # the policy's own copy, removed after
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_inh.py; rm test_inh.py", timeout=60)
        print("POLICY'S OWN RUN", res.text[-600:])
        assert "1 passed" in res.text, res.text  # the attack fakes the fix where the policy runs the tests

    result, _, infra = await _graded(test_images_root, task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result


#: Honest code: TestDerived inherits test_add through the first Base (Python binds the base
#: when the class statement runs); a later class Base, with a test_add of its own, replaces
#: that name afterwards. The runner's map, built from the file's last class of each name,
#: points TestDerived.test_add at the later Base.test_add, which never runs for it.
_REDEFINED = '''\
from calc import add


class Common:
    def test_add(self):
        assert add(2, 3) == 5


class Base(Common):
    pass


class TestDerived(Base):
    pass


class Base:
    def test_add(self):
        assert add(1, 1) == 2
'''


async def test_an_inherited_test_through_a_redefined_base_scores_1_with_the_gold_patch(
        test_images_root, calc_task):
    task = calc_task.model_copy(update={
        "instance_id": "calc__redefined-1", "test_patch": _new_files({"test_redef.py": _REDEFINED}),
        "FAIL_TO_PASS": ("test_redef.py::TestDerived::test_add",), "PASS_TO_PASS": ()})
    result, _, infra = await _graded(test_images_root, task,
                                     _write("calc.py", b"def add(a, b):\n    return a + b\n"))
    assert infra == {}, infra
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result


_INHERITED_UNITTEST = '''\
import unittest

from calc import add


class Base(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)


class TestDerived(Base):
    pass
'''

#: TestDerived, once defined, gets a test_add that runs the real Base.test_add, in its own
#: module, on a stand-in self whose assertEqual checks nothing: the watched def returns.
_INHERITED_STUB_SELF = """\
import sys


class _Lenient:
    def assertEqual(self, *args, **kwargs):
        pass


def _lines(frame, event, arg):
    cls = frame.f_globals.get("TestDerived")
    if isinstance(cls, type) and "test_add" not in vars(cls):
        real = cls.__mro__[1].__dict__["test_add"]
        cls.test_add = lambda self: real(_Lenient())
    return _lines


_f = sys._getframe(1)
while _f is not None and _f.f_globals.get("__name__") != "test_inh":
    _f = _f.f_back
_f.f_trace = _lines
sys.settrace(lambda *a: None)
"""


def _inherited_attack(swap: str) -> str:
    """Code under test that runs ``swap`` (with ``cls``, the test module's TestDerived) once,
    the moment TestDerived is defined in the test module (a swap that imports builtins runs
    at import instead, before the test module's classes are built)."""
    return (
        "import sys\n\n_done = []\n\n\n"
        "def _passes(self):\n    pass\n\n\n"
        "def _build(real):\n"
        "    def build(func, name, *bases, **kw):\n"
        "        cls = real(func, name, *bases, **kw)\n"
        "        if name == 'TestDerived':\n"
        "            cls.test_add = _passes\n"
        "        return cls\n"
        "    return build\n\n\n"
        "def _lines(frame, event, arg):\n"
        "    cls = frame.f_globals.get('TestDerived')\n"
        "    if isinstance(cls, type) and not _done:\n"
        "        _done.append(1)\n"
        f"        {'pass' if swap.startswith('import builtins') else swap}\n"
        "    return _lines\n\n\n"
        "_f = sys._getframe(1)\n"
        "while _f is not None and _f.f_globals.get('__name__') != 'test_inh':\n"
        "    _f = _f.f_back\n"
        "_f.f_trace = _lines\nsys.settrace(lambda *a: None)\n"
        + (swap + "\n" if swap.startswith("import builtins") else ""))


@pytest.mark.parametrize("swap", [
    "cls.__mro__[1].test_add = _passes",
    "cls.__bases__ = (type('Other', (), {'test_add': _passes}),)",
    "frame.f_globals['TestDerived'] = type('TestDerived', (), {'test_add': _passes})",
    "import builtins; builtins.__build_class__ = _build(builtins.__build_class__)",
], ids=["base-method-rebound", "bases-replaced", "class-replaced-in-globals", "build-class-hook"])
async def test_an_inherited_test_faked_through_its_base_scores_0(test_images_root, calc_task, swap):
    task = calc_task.model_copy(update={
        "instance_id": "calc__inherited-3", "test_patch": _new_files({"test_inh.py": _INHERITED}),
        "FAIL_TO_PASS": ("test_inh.py::TestDerived::test_add",), "PASS_TO_PASS": ()})

    async def episode(lease) -> None:
        await lease.write_file("calc.py", _buggy_calc_with(_inherited_attack(swap)))
        await lease.write_file("test_inh.py", _INHERITED.encode())  # the policy's own copy, removed after
        res = await lease.exec("python -m pytest -q -p no:cacheprovider test_inh.py; rm test_inh.py", timeout=60)
        print("POLICY'S OWN RUN", res.text[-600:])
        assert "1 passed" in res.text, res.text

    result, _, infra = await _graded(test_images_root, task, episode)
    assert infra == {}, infra
    assert result.outcome in (Outcome.COMPLETED, Outcome.TASK_FAILED) and result.reward == 0.0, result


#: Honest inherited styles: an override by assignment, a nested class, a mixin before an
#: attribute base (unittest.TestCase), and a base two levels up.
_INHERITED_HONEST = '''\
import unittest

from calc import add


class Base:
    def test_add(self):
        assert add(2, 3) == 5


class TestAssigned(Base):
    test_add = Base.test_add


class TestOuter:
    class TestInner(Base):
        pass


class Mixin:
    def test_mixed(self):
        self.assertEqual(add(1, 1), 2)


class TestMixed(Mixin, unittest.TestCase):
    pass


class Middle(Base):
    pass


class TestDeep(Middle):
    pass
'''


async def test_honest_inherited_styles_score_1_with_the_gold_patch(test_images_root, calc_task):
    ids = ("test_inh.py::TestAssigned::test_add", "test_inh.py::TestOuter::TestInner::test_add",
           "test_inh.py::TestMixed::test_mixed", "test_inh.py::TestDeep::test_add")
    task = calc_task.model_copy(update={
        "instance_id": "calc__inherited-4", "test_patch": _new_files({"test_inh.py": _INHERITED_HONEST}),
        "FAIL_TO_PASS": ids, "PASS_TO_PASS": ()})
    result, _, infra = await _graded(test_images_root, task,
                                     _write("calc.py", b"def add(a, b):\n    return a + b\n"))
    assert infra == {}, infra
    assert (result.outcome, result.reward) == (Outcome.COMPLETED, 1.0), result
    none, _, _ = await _graded(test_images_root, task, _write("calc.py", b"def add(a, b):\n    return a - b\n"))
    assert none.reward == 0.0 and "never returned" not in str(none), none


_NESTED = '''\
from calc import add


class Base:
    def test_add(self):
        assert add(2, 3) == 5


class TestOuter:
    class TestDerived(Base):
        pass
'''

_ASSIGNED = '''\
from calc import add


class Base:
    def test_add(self):
        assert add(2, 3) == 5


class TestDerived(Base):
    test_add = Base.test_add
'''

#: Rebinds test_add on every class named TestDerived as it is built (nested ones included).
_REBIND_ON_BUILD = """\
import builtins


def _passes(self):
    pass


def _build(real):
    def build(func, name, *bases, **kw):
        cls = real(func, name, *bases, **kw)
        if name == "TestDerived":
            cls.test_add = _passes
        return cls
    return build


builtins.__build_class__ = _build(builtins.__build_class__)
"""
