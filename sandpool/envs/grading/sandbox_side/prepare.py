"""Grading's preparation step, run inside the sandbox before the tests: ``python -I -S prepare.py job.json``.

This file is not imported by sandpool; the grader copies it into the sandbox. It must run on
every Python a SWE image may carry (>= 3.6): no newer syntax, standard library only.

It never runs a hook, filter or config file the policy could have planted:

* git runs against a private git directory made here (``objects/info/alternates`` points at
  the repo's objects): no repo config, no hooks, no ``info/attributes``, no replace refs, no
  system or global config, so no filter driver or hook exists to run;
* files are restored from blobs read with ``git cat-file --batch``, and every object read
  (commit, trees, blobs) is hashed here and must match its id, so corrupted objects are found;
* ``-I -S``: no ``.pth`` file, ``sitecustomize`` or environment variable affects this script.

Steps: restore the listed paths and every tracked test-configuration file (pytest.ini,
.pytest.ini, setup.cfg, tox.ini, pyproject.toml, conftest.py) from the base commit; delete
such files that the base commit does not have, in the tree and in every parent directory of
the workdir; delete untracked modules at the top of the workdir that shadow the standard
library, pytest or pluggy (the workdir is first on ``sys.path``), and entry-point files
changed since the sandbox started in package metadata under it (pytest loads their
``pytest11`` plugins); check that the test patch applies to the pristine base tree (else the task is
broken), then apply it to the work tree; in a writable Python environment, delete ``.pth``,
``sitecustomize``/``usercustomize`` files and entry-point files changed since the sandbox
started (and conda ``activate.d`` scripts), and report changes to the interpreter, pytest and
pluggy.

Prints one JSON object: ``{"restored": [...], "removed": [...], "neutralised": [...],
"suspicious": [...], "broken": str|null, "policy_error": str|null, "apply_failed": str|null}``.
"""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig

CONFIG_NAMES = ("pytest.ini", ".pytest.ini", "setup.cfg", "tox.ini", "pyproject.toml", "conftest.py")
STARTUP_NAMES = ("sitecustomize.py", "usercustomize.py")
GUARDED_PACKAGES = ("pytest", "_pytest", "pluggy")


class PolicyBrokeGit(Exception):
    pass


class Objects(object):
    """Verified reads of git objects through ``git cat-file --batch``."""

    def __init__(self, git_dir):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_DIR": git_dir,
               "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null", "HOME": git_dir,
               "XDG_CONFIG_HOME": git_dir, "GIT_ATTR_NOSYSTEM": "1",
               "GIT_NO_REPLACE_OBJECTS": "1", "GIT_OPTIONAL_LOCKS": "0", "LC_ALL": "C"}
        self.env = env
        self.proc = subprocess.Popen(git_argv("cat-file", "--batch"), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)

    def read(self, oid, want):
        self.proc.stdin.write((oid + "\n").encode())
        self.proc.stdin.flush()
        header = self.proc.stdout.readline().decode().split()
        if len(header) != 3:
            raise PolicyBrokeGit("object %s is missing from the repository" % oid)
        kind, size = header[1], int(header[2])
        data = self.proc.stdout.read(size)
        self.proc.stdout.read(1)
        real = hashlib.sha1(("%s %d\0" % (kind, size)).encode() + data).hexdigest()
        if real != oid:
            raise PolicyBrokeGit("object %s hashes to %s: the repository's objects were altered" % (oid, real))
        if kind != want:
            raise PolicyBrokeGit("object %s is a %s, expected a %s" % (oid, kind, want))
        return data

    def tree(self, oid, prefix, out):
        data = self.read(oid, "tree")
        i = 0
        while i < len(data):
            sp = data.index(b" ", i)
            nul = data.index(b"\0", sp)
            mode = data[i:sp].decode()
            name = data[sp + 1:nul].decode("utf-8", "surrogateescape")
            child = data[nul + 1:nul + 21].hex()
            i = nul + 21
            path = prefix + name
            if mode == "40000":
                self.tree(child, path + "/", out)
            elif mode != "160000":  # submodules hold no content here
                out[path] = (mode, child)
        return out


def git_argv(*args):
    return ["git", "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false",
            "-c", "core.attributesFile=/dev/null", "-c", "protocol.allow=never"] + list(args)


def private_git_dir(workdir, git_dir):
    dot_git = os.path.join(workdir, ".git")
    objects = os.path.join(dot_git, "objects")
    if os.path.islink(dot_git) or not os.path.isdir(objects):
        raise PolicyBrokeGit("restoring test files failed: %s is gone or is not a git directory "
                             "(the policy removed or replaced it)" % dot_git)
    for d in ("objects/info", "refs/heads"):
        os.makedirs(os.path.join(git_dir, d))
    with open(os.path.join(git_dir, "objects/info/alternates"), "w") as f:
        f.write(objects + "\n")
    with open(os.path.join(git_dir, "HEAD"), "w") as f:
        f.write("ref: refs/heads/sandpool\n")
    with open(os.path.join(git_dir, "config"), "w") as f:
        f.write("[core]\n\trepositoryformatversion = 0\n\tbare = false\n")


def remove(path):
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
        return True
    if os.path.isdir(path):
        shutil.rmtree(path)
        return True
    return False


def write_blob(objects, workdir, path, mode, oid):
    full = os.path.join(workdir, path)
    data = objects.read(oid, "blob")
    if os.path.lexists(full) or os.path.isdir(full):
        remove(full)
    parent = os.path.dirname(full)
    if os.path.islink(parent):
        os.unlink(parent)
    if not os.path.isdir(parent):
        os.makedirs(parent)
    if mode == "120000":
        os.symlink(data.decode("utf-8", "surrogateescape"), full)
        return
    with open(full, "wb") as f:
        f.write(data)
    os.chmod(full, 0o755 if mode == "100755" else 0o644)


def shadowing_names():
    """Module names that a file at the top of the workdir must not take over.

    ``python -m pytest`` puts the workdir first on ``sys.path``, so an untracked ``pytest.py``,
    ``pluggy/`` or ``hmac.py`` there is imported instead of the real module, before the
    verdict plugin takes its snapshot of pytest's machinery.
    """
    names = set(sys.builtin_module_names) | set(GUARDED_PACKAGES) | {"py"}
    names |= set(getattr(sys, "stdlib_module_names", ()))
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib"):
        for d in (paths.get(key), os.path.join(paths.get(key) or "", "lib-dynload")):
            if d and os.path.isdir(d):
                names.update(entry.split(".", 1)[0] for entry in os.listdir(d))
    names.difference_update(("site-packages", "__pycache__"))
    return names


def start_time():
    """Epoch seconds at which the sandbox's first process started."""
    with open("/proc/stat") as f:
        btime = [int(line.split()[1]) for line in f if line.startswith("btime")][0]
    with open("/proc/1/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    return btime + ticks / os.sysconf("SC_CLK_TCK")


def check_environment(out):
    since = start_time() - 1.0
    dirs = set()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        p = sysconfig.get_paths().get(key)
        if p and os.path.isdir(p):
            dirs.add(os.path.realpath(p))
    for extra in (os.path.expanduser("~/.local/lib"), os.path.join(sys.prefix, "etc", "conda")):
        if os.path.isdir(extra):
            dirs.add(os.path.realpath(extra))
    exe = os.path.realpath(sys.executable)
    if os.lstat(exe).st_ctime > since:
        out["suspicious"].append("the interpreter %s changed during the rollout" % exe)
    for top in sorted(dirs):
        if not os.access(top, os.W_OK):
            continue
        for root, subdirs, files in os.walk(top):
            rel = os.path.relpath(root, top).split(os.sep)
            guarded = any(part in GUARDED_PACKAGES for part in rel)
            for name in files:
                path = os.path.join(root, name)
                try:
                    changed = os.lstat(path).st_ctime > since
                except OSError:
                    continue
                if not changed:
                    continue
                if (name.endswith(".pth") or name in STARTUP_NAMES or "activate.d" in rel
                        or (name == "entry_points.txt" and root.endswith((".dist-info", ".egg-info")))):
                    os.unlink(path)
                    out["neutralised"].append(path)
                elif guarded:
                    out["suspicious"].append("%s changed during the rollout" % path)


def main():
    with open(sys.argv[1]) as f:
        job = json.load(f)
    workdir, base, git_dir = job["workdir"], job["base"], job["git_dir"]
    out = {"restored": [], "removed": [], "neutralised": [], "suspicious": [],
           "broken": None, "policy_error": None, "apply_failed": None}
    try:
        private_git_dir(workdir, git_dir)
        objects = Objects(git_dir)
        commit = objects.read(base, "commit").split(b"\n\n", 1)[0].split(b"\n")
        tree_oid = [line.split()[1].decode() for line in commit if line.startswith(b"tree ")][0]
        tracked = objects.tree(tree_oid, "", {})
        missing = [p for p in job.get("required", ()) if p not in tracked]
        if missing:
            out["broken"] = ("test file(s) %s are neither at base commit %s nor added by the "
                             "test patch" % (", ".join(missing), base[:12]))
            sys.stdout.write(json.dumps(out) + "\n")
            return
        for path in job["restore"]:
            if path in tracked:
                write_blob(objects, workdir, path, *tracked[path])
                out["restored"].append(path)
        for path, entry in tracked.items():
            if os.path.basename(path) in CONFIG_NAMES and path not in out["restored"]:
                write_blob(objects, workdir, path, *entry)
                out["restored"].append(path)
        since = start_time() - 1.0 if job.get("check_environment", True) else None
        for root, subdirs, files in os.walk(workdir):
            if root == workdir and ".git" in subdirs:
                subdirs.remove(".git")
            for name in files:
                rel = os.path.relpath(os.path.join(root, name), workdir)
                if name in CONFIG_NAMES:
                    if rel not in tracked:
                        os.unlink(os.path.join(root, name))
                        out["removed"].append(rel)
                elif (since is not None and name == "entry_points.txt" and rel not in tracked
                      and root.endswith((".dist-info", ".egg-info"))
                      and os.lstat(os.path.join(root, name)).st_ctime > since):
                    # The workdir is on sys.path: pytest would load its pytest11 plugins.
                    os.unlink(os.path.join(root, name))
                    out["neutralised"].append(rel)
        tops = set(p.split("/", 1)[0] for p in tracked)
        shadowing = shadowing_names()
        for name in sorted(os.listdir(workdir)):
            path = os.path.join(workdir, name)
            module = name.split(".", 1)[0]
            is_module = os.path.isdir(path) or name.endswith((".py", ".pyc", ".so", ".pyd"))
            if name not in tops and module in shadowing and is_module:
                remove(path)
                out["removed"].append(name)
        parent = os.path.dirname(os.path.realpath(workdir))
        while True:
            for name in CONFIG_NAMES:
                path = os.path.join(parent, name)
                if os.path.lexists(path):
                    try:
                        remove(path)
                        out["removed"].append(path)
                    except OSError as exc:
                        out["suspicious"].append("cannot remove %s: %s" % (path, exc))
            if parent == os.path.dirname(parent):
                break
            parent = os.path.dirname(parent)
        if job.get("test_patch"):
            index_env = dict(objects.env, GIT_INDEX_FILE=os.path.join(git_dir, "index"))
            r = subprocess.Popen(git_argv("read-tree", base), env=index_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            msg = r.communicate()[0].decode("utf-8", "replace")
            if r.returncode != 0:
                raise PolicyBrokeGit("git read-tree of the base commit failed: " + msg[-400:])
            r = subprocess.Popen(git_argv("apply", "--check", "--cached", job["test_patch"]),
                                 env=index_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            msg = r.communicate()[0].decode("utf-8", "replace")
            if r.returncode != 0:
                out["broken"] = "test_patch does not apply to base commit %s: %s" % (base[:12], msg.strip()[-400:])
            else:
                tree_env = dict(objects.env, GIT_WORK_TREE=workdir)
                r = subprocess.Popen(git_argv("apply", "-v", job["test_patch"]), env=tree_env,
                                     cwd=workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
                msg = r.communicate()[0].decode("utf-8", "replace")
                if r.returncode != 0:
                    out["apply_failed"] = msg.strip()[-600:]
        objects.proc.stdin.close()
        objects.proc.wait()
        if job.get("check_environment", True):
            check_environment(out)
    except PolicyBrokeGit as exc:
        out["policy_error"] = str(exc)
    sys.stdout.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
