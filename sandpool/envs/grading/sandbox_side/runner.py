"""The isolated pytest process: ``python -s -S runner.py job.json``.

This file is not imported by sandpool; the grader copies it into a private directory of the
sandbox and starts it with a clean environment (no ``PYTHON*`` variable but the grader's own,
see :mod:`sandpool.envs.grading.diff`). It must run on every Python a SWE image may carry
(>= 3.6): no newer syntax, standard library only.

Nothing from the repo is imported before the verdict machinery:

* ``-S``: ``site`` does not run at start-up, so no ``.pth`` line and no ``sitecustomize``
  (which a ``.pth`` that puts the repo on ``sys.path`` would find in the repo) runs. The
  environment's site directories are then added here, as ``site.main()`` adds them, and the
  image's own ``sitecustomize`` is imported from outside the repo only; ``-s``: no user site;
* with every path in the repo off ``sys.path``, pytest, pluggy, pytest's dependencies and
  the verdict plugin are imported, the per-run key is read from its file and the file
  unlinked (the key is in no environment, argument or file the code under test can read),
  and the report file is opened;
* no bytecode is written, and pytest's cache of rewritten test modules is never read (one
  planted there during the run would replace a test module). The tree's own bytecode is the
  image's: the sandbox is pristine, capture leaves bytecode out of the patch and the patch
  policy refuses it, so Python reads what is there as it always does;
* only then is ``sys.path`` completed: the interpreter's own paths and the site directories
  first, then the harness's ``PYTHONPATH``, then the paths in the repo (a ``.pth``'s), then
  the workdir itself when the harness runs ``python -m pytest``. A module the repo adds
  cannot shadow an installed one.

Once pytest and the plugin are loaded, and before anything of the repo's, it prints
:data:`STARTED` on stdout: the code under test can add output after it but never take it
back, so a run without that line could not start (exit status 3: pytest could not be
imported by the image's Python), which is the image's fault, not the patch's. Otherwise the
exit status is pytest's.

The job (JSON): ``workdir``, ``args`` (pytest's arguments), ``cwd_on_path`` (bool), ``key``
(the key file), ``report`` (the report file), ``hashes`` (``sha256sum`` lines of every test
module, ``conftest.py`` and Python file under the tests' directories, taken before the run), ``plugin`` (the verdict plugin's module name,
in this directory), ``env_file`` (the harness's environment, NUL-separated: its ``PYTHON*``
variables are restored in ``os.environ`` for the tests' own child processes, and its
``PYTHONPATH`` is added to ``sys.path`` as said above), ``assigned`` (``VAR=value`` words
before the harness's pytest command, treated the same way), ``trusted`` (the files that count
as the task's tests, repo-relative, a directory ending in ``/``: the code compiled from them,
checked against its hash, is the only code whose ``pytest.xfail()`` makes an expected failure).
"""

import ast
import hashlib
import importlib
import inspect
import json
import os
import sys

STARTED = "@@sandpool-runner-started"

def in_repo(path, workdir):
    real = os.path.realpath(path or os.getcwd())
    return real == workdir or real.startswith(workdir + os.sep)


def site_paths():
    # What site.main() adds (venv, site-packages and their .pth lines), without the
    # sitecustomize/usercustomize imports it ends with.
    import site
    known = site.removeduppaths()
    if hasattr(site, "venv"):
        known = site.venv(known)
    site.addsitepackages(known)


def harness_python_env(job):
    """The harness's PYTHON* variables (left out of this process's environment) and the
    assignments its command line makes, for the tests' own child processes."""
    out = {}
    try:
        with open(job["env_file"], "rb") as f:
            entries = f.read().split(b"\0")
    except (KeyError, OSError):
        entries = []
    for entry in entries:
        name, sep, value = entry.decode("utf-8", "surrogateescape").partition("=")
        if sep and name.startswith("PYTHON"):
            out[name] = value
    out.update(job.get("assigned") or {})
    return out


def verify_test_sources(rewrite, tampered, job, workdir, trusted_code, trusted_files, inherited):
    """Compile each test module and conftest.py from bytes checked against their hashes,
    taken before any of the repo's code ran: code under test that rewrites a later test
    module on disk is found, and pytest compiles what was checked, not a second read.
    What is compiled from the task's test files (``job["trusted"]``: repo-relative files,
    directories ending in ``/``, and any conftest.py), checked, goes into ``trusted_code``;
    the real paths of those files (the ones hashed) go into ``trusted_files``; and, read from
    the same checked source, where each test a class inherits is defined in the file
    (``inherited``: ``(real path, "Derived.test_x") -> "Base.test_x"``, see
    :func:`inherited_defs`).

    Every function these checks call is bound here, before any of the repo's code runs: this
    module is ``__main__``, and its names are the code under test's to rebind."""
    realpath, basename, sep = os.path.realpath, os.path.basename, os.sep
    sha256, b_open, b_str, b_isinstance, b_id, b_any = (
        hashlib.sha256, open, str, isinstance, id, any)
    os_stat, parse, b_compile = os.stat, ast.parse, compile
    code_type = type(verify_test_sources.__code__)
    inherited_defs = _inherited_defs_of()
    trusted = frozenset(job.get("trusted") or ())
    hashes = {}
    try:
        with open(job["hashes"]) as f:
            for line in f:
                digest, _, rel = line.rstrip("\n").partition("  ")
                hashes[realpath(os.path.join(workdir, rel))] = digest
    except (KeyError, OSError):
        return

    def inside(real):
        return real == workdir or real.startswith(workdir + sep)

    def is_trusted(real):
        if not inside(real):
            return False
        rel = real[len(workdir) + 1:].replace(sep, "/")
        return (basename(rel) == "conftest.py" or rel in trusted
                or b_any([t.endswith("/") and rel.startswith(t) for t in trusted]))

    trusted_files.update([real for real in hashes if is_trusted(real)])

    def trust(code):  # the code object and every one nested in it
        todo = [code]
        while todo:
            c = todo.pop()
            trusted_code[b_id(c)] = c
            todo.extend([k for k in c.co_consts if b_isinstance(k, code_type)])

    def is_test(name):
        return name == "conftest.py" or (name.endswith(".py") and (name.startswith("test_")
                                                                   or name.endswith("_test.py")))

    original = rewrite._rewrite_test
    params = list(inspect.signature(original).parameters)
    own = params == ["fn", "config"] and len(inspect.signature(rewrite.rewrite_asserts).parameters) >= 4
    rewrite_asserts = rewrite.rewrite_asserts

    def _rewrite_test(fn, config):
        path = b_str(fn)
        with b_open(path, "rb") as f:
            data = f.read()
        real = realpath(path)
        want = hashes.get(real)
        checked = want is not None and sha256(data).hexdigest() == want
        if want is not None and not checked:
            tampered("test module %s changed on disk during the run" % path)
        elif want is None and inside(real) and is_test(basename(real)):
            tampered("test module %s appeared during the run" % path)
        if not own:
            out = original(fn, config)
        else:
            stat = os_stat(path)
            tree = parse(data, filename=path)
            rewrite_asserts(tree, data, path, config)
            out = stat, b_compile(tree, path, "exec", dont_inherit=True)
        if checked and out is not None and is_trusted(real):
            trust(out[1])
            for qualname, owner in inherited_defs(parse(data, filename=path)).items():
                inherited[(real, qualname)] = owner
        return out

    rewrite._rewrite_test = _rewrite_test
    verify_module_sources(hashes, tampered, is_trusted, trust)


def _inherited_defs_of():
    """Return ``inherited_defs(tree)``, with every name it uses bound now (see above)."""
    ClassDef, Name, defs = ast.ClassDef, ast.Name, (ast.FunctionDef, ast.AsyncFunctionDef)
    assigns, ast_assign = (ast.Assign, ast.AnnAssign, ast.AugAssign), ast.Assign
    b_isinstance, b_set, b_list, b_any = isinstance, set, list, any

    def inherited_defs(tree):
        """``{"Derived.name": "Base.name"}`` for each method a top-level class of ``tree``
        inherits from a top-level class of the same file, where Python's lookup is certain
        from the source: the bases, depth first from the left, reach the defining class
        through classes of the file only, each bound once at top level, by C3 with no base
        that is not such a class before the def (an imported base could define it first)."""
        classes, rebound = {}, b_set()
        for node in tree.body:
            if b_isinstance(node, assigns):  # a top-level name bound otherwise too
                targets = node.targets if b_isinstance(node, ast_assign) else [node.target]
                rebound.update([t.id for t in targets if b_isinstance(t, Name)])
            if b_isinstance(node, ClassDef):
                if node.name in classes:  # which class a base name meant depends on when
                    rebound.add(node.name)
                bases = [b.id if b_isinstance(b, Name) else None for b in node.bases]
                own = b_set([n.name for n in node.body if b_isinstance(n, defs)])
                bound = b_set()  # names the class body binds otherwise (test_x = ...)
                for n in node.body:
                    if b_isinstance(n, assigns):
                        targets = n.targets if b_isinstance(n, ast_assign) else [n.target]
                        bound.update([t.id for t in targets if b_isinstance(t, Name)])
                classes[node.name] = (bases, own - bound, own | bound)
        for name in rebound:  # a name bound twice is opaque: nothing through it is certain
            classes.pop(name, None)

        def lookup_order(name, seen=()):
            # Python's C3 linearization over the file's classes; a base that is not one of
            # them is an opaque entry (None), after which nothing is certain. [None] when the
            # bases cannot be linearized (or name a class in its own ancestry).
            if name is None or name not in classes or name in seen:
                return [None]
            bases = classes[name][0]
            seqs = [lookup_order(b, seen + (name,)) for b in bases] + [b_list(bases)]
            order = [name]
            while True:
                seqs = [q for q in seqs if q]
                if not seqs:
                    return order
                for q in seqs:
                    head = q[0]
                    if head is None or not b_any([head in r[1:] for r in seqs]):
                        break
                else:
                    return order + [None]
                if head is None:
                    return order + [None]
                order.append(head)
                seqs = [r[1:] if r[0] == head else r for r in seqs]

        found = {}
        for name in b_list(classes):
            order = lookup_order(name)
            methods = b_set()
            for c in order:
                if c is not None:
                    methods.update(classes[c][1])
            for method in methods:
                for c in order:
                    if c is None:
                        break  # an opaque base comes first: it may define it
                    if method in classes[c][2]:  # the first class that binds the name
                        if c != name and method in classes[c][1]:  # by a def, not elsewhere
                            found["%s.%s" % (name, method)] = "%s.%s" % (c, method)
                        break
        return found

    return inherited_defs


def verify_module_sources(hashes, tampered, is_trusted, trust):
    """The same check for modules pytest does not rewrite (the tests' helpers and data
    modules): their source is checked as Python reads it, and their bytecode never read;
    what is compiled from the task's test files is trusted (``trust``)."""
    from importlib import machinery, util

    realpath, sha256, source_from_cache, b_isinstance, b_str = (
        os.path.realpath, hashlib.sha256, util.source_from_cache, isinstance, str)
    original = machinery.SourceFileLoader.get_data
    to_code = machinery.SourceFileLoader.source_to_code
    verified = set()  # real paths whose source was read and matched its hash

    def get_data(self, path):
        if path.endswith(".pyc"):
            try:
                source = realpath(source_from_cache(path))
            except ValueError:
                source = None
            if source in hashes:  # compile the checked source instead
                raise OSError("no bytecode for %s" % source)
            return original(self, path)
        data = original(self, path)
        real = realpath(path)
        want = hashes.get(real)
        if want is not None and sha256(data).hexdigest() != want:
            tampered("test source %s changed on disk during the run" % path)
        elif want is not None:
            verified.add(real)
        return data

    def source_to_code(self, data, path, *args, **kwargs):
        code = to_code(self, data, path, *args, **kwargs)
        real = realpath(path) if b_isinstance(path, b_str) else None
        if real in verified and is_trusted(real):
            trust(code)
        return code

    machinery.SourceFileLoader.get_data = get_data
    machinery.SourceFileLoader.source_to_code = source_to_code


def main(argv):
    here = os.path.dirname(os.path.abspath(__file__))
    with open(argv[1]) as f:
        job = json.load(f)
    sys.dont_write_bytecode = True
    workdir = os.path.realpath(job["workdir"])
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    site_paths()
    outside = [p for p in sys.path if p and not in_repo(p, workdir)]
    repo = [p for p in sys.path if p and in_repo(p, workdir)]
    sys.path[:] = [here] + outside
    try:
        import sitecustomize  # noqa: F401 - the image's own, never one in the repo
    except ImportError:
        pass
    try:
        import pytest
        verdict = importlib.import_module(job["plugin"])
        from _pytest.assertion import rewrite
    except ImportError as exc:
        sys.stderr.write("sandpool: pytest cannot be imported by %s: %s\n" % (sys.executable, exc))
        return 3
    with open(job["key"], "rb") as f:
        key = f.read()
    os.unlink(job["key"])
    trusted_code, trusted_files, inherited = {}, set(), {}
    plugin, snapshot, tampered = verdict.make(key, job["report"], trusted_code, trusted_files,
                                              inherited)
    del key, verdict
    sys.modules.pop(job["plugin"], None)  # reachable by no name: the plugin holds its state
    # pytest reads a cached rewritten module when its mtime and size match the source: a
    # planted one would replace a test module. Always rewrite from the source instead.
    if hasattr(rewrite, "_read_pyc"):
        rewrite._read_pyc = lambda *args, **kwargs: None
    verify_test_sources(rewrite, tampered, job, workdir, trusted_code, trusted_files, inherited)
    snapshot()
    sys.stdout.write("%s python %s pytest %s\n" % (STARTED, sys.version.split()[0], pytest.__version__))
    sys.stdout.flush()
    python_env = harness_python_env(job)
    extra = [p for p in python_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = ([p for p in outside if p != here] + [p for p in extra if not in_repo(p, workdir)]
                   + repo + [p for p in extra if in_repo(p, workdir)]
                   + ([workdir] if job.get("cwd_on_path") else []))
    for name, value in python_env.items():
        os.environ.setdefault(name, value)
    os.chdir(workdir)
    sys.argv = [os.path.join(os.path.dirname(pytest.__file__), "__main__.py")] + list(job["args"])
    return int(pytest.main(list(job["args"]), plugins=[plugin]))


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    sys.exit(code)
