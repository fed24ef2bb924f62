"""Hydration: bring an OCI image into the local store, once, before rollouts ask for it.

Sources (skopeo transports, Debian package ``skopeo``)::

    docker://REPO[:TAG|@DIGEST]        a registry (pinned: a tag is resolved to its digest first)
    docker-archive:PATH[:REF]          a ``docker save`` / ``podman save`` archive
    oci:PATH[:TAG]                     an OCI image layout directory
    oci-archive:PATH[:TAG]             a tar of an OCI layout
    docker-daemon:REF                  the local Docker store (its socket: ``$DOCKER_HOST``, else
                                       /var/run/docker.sock)
    containers-storage:REF             the local Podman store (needs /var/lib/containers/storage)

A bare path is read as ``oci:`` when it is a directory holding ``index.json``, else as
``docker-archive:``.

Steps: ``skopeo copy`` into a temporary OCI layout; then each layer the store does not hold yet
is unpacked by ``umoci raw unpack`` (Debian package ``umoci``, which applies the OCI rules for
hard links, permissions and xattrs) as a one-layer image, with uids/gids shifted by
:data:`~sandpool.core.images.store.ID_BASE`. umoci applies a layer's whiteouts to what lies
*below* it, and a layer unpacked alone has nothing below, so the whiteouts (``.wh.NAME``,
``.wh..wh..opq``) read from the layer tar are then written in overlayfs's form (a 0/0
character device, ``trusted.overlay.opaque=y``): stacked as overlay lower directories, the
layers give the same tree as a full unpack. Device nodes other than whiteouts are removed
(sandbox overlays are also mounted ``nodev``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import tarfile
import time
from pathlib import Path

from sandpool.core import errors
from sandpool.core.mounts import mount_overlay, umount
from sandpool.core.images.store import ID_BASE, ID_COUNT, ImageStore, LayerRef, OciImage

__all__ = ["hydrate", "normalize_source"]

_WH = ".wh."
_OPAQUE = ".wh..wh..opq"
_LAYER_TYPES = ("tar", "tar+gzip", "tar+zstd")


def normalize_source(source: str) -> tuple[str, str]:
    """Return ``(transport source, default name)`` for ``source``.

    Raises:
        InputError: A bare path that is neither an OCI layout nor a file, or a local store
            (Docker/Podman) that is not present on this machine.
    """
    if "://" not in source and ":" not in source.split("/")[0] and not source.startswith(
            ("docker-archive:", "oci:", "oci-archive:", "docker-daemon:", "containers-storage:")):
        p = Path(source)
        if p.is_dir() and (p / "index.json").is_file():
            source = f"oci:{p.resolve()}"
        elif p.is_file():
            source = f"docker-archive:{p.resolve()}"
        else:
            raise errors.InputError(
                f"image source {source!r} is not an OCI layout directory or an archive file; give "
                "docker://REPO:TAG, docker-archive:PATH, oci:PATH[:TAG], docker-daemon:REF or "
                "containers-storage:REF")
    transport, _, rest = source.partition(":")
    if transport == "docker":
        return source, rest.removeprefix("//")
    if transport == "docker-daemon":
        sock = Path(_docker_host().removeprefix("unix://"))
        if not sock.exists():
            raise errors.InputError(f"no Docker daemon here ({sock} does not exist); export the "
                                    "image with `docker save -o x.tar REF` elsewhere and pass docker-archive:x.tar")
        return source, rest
    if transport == "containers-storage":
        if not Path("/var/lib/containers/storage").is_dir():
            raise errors.InputError("no Podman store here (/var/lib/containers/storage does not exist); "
                                    "export with `podman save -o x.tar REF` and pass docker-archive:x.tar")
        return source, rest
    if transport in ("oci", "oci-archive"):
        path, _, tag = rest.partition(":")
        return source, tag or Path(path).name
    if transport == "docker-archive":
        path, _, ref = rest.partition(":")
        return source, ref or _archive_tag(Path(path)) or Path(path).stem
    raise errors.InputError(f"image source {source!r}: unknown transport {transport!r}")


def _archive_tag(path: Path) -> str | None:
    # A `docker save` archive names its image(s) in manifest.json's RepoTags.
    try:
        with tarfile.open(path) as tf:
            f = tf.extractfile("manifest.json")
            tags = json.load(f)[0].get("RepoTags") or [] if f else []
    except (OSError, KeyError, tarfile.TarError, ValueError, IndexError):
        return None
    return tags[0] if tags else None


def _run(argv: list[str], what: str) -> bytes:
    try:
        res = subprocess.run(argv, capture_output=True)
    except FileNotFoundError:
        raise errors.BackendUnavailable(
            f"{argv[0]} is not installed; install it: apt-get install {argv[0]}") from None
    if res.returncode != 0:
        err = (res.stderr or res.stdout).decode(errors="replace").strip()[-1500:]
        if "no space left" in err.lower():
            raise OSError(28, f"{what}: no space left on device: {err}")
        raise errors.ImageNotFound(f"{what} failed (exit {res.returncode}): {err}")
    return res.stdout


def _docker_host() -> str:
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def _src_flags(source: str, tls_verify: bool) -> list[str]:
    """skopeo's flags for reading ``source``: TLS for a registry; for the Docker daemon, the
    daemon ``DOCKER_HOST`` names (skopeo itself reads only the default socket)."""
    if source.startswith("docker-daemon:"):
        return ["--src-daemon-host", _docker_host()]
    return [] if tls_verify else ["--src-tls-verify=false"]


def _pin(source: str, tls_verify: bool) -> tuple[str, str | None]:
    """Resolve a registry tag to the manifest digest it names now; copy by that digest."""
    if not source.startswith("docker://"):
        return source, None
    ref = source.removeprefix("docker://")
    if "@sha256:" in ref:
        return source, ref.split("@", 1)[1]
    raw = _run(["skopeo", "inspect", "--raw", *([] if tls_verify else ["--tls-verify=false"]), source],
               f"skopeo inspect {source}")
    digest = "sha256:" + hashlib.sha256(raw).hexdigest()
    repo = ref.rsplit(":", 1)[0] if ":" in ref.rsplit("/", 1)[-1] else ref
    return f"docker://{repo}@{digest}", digest


def _blob(layout: Path, digest: str) -> Path:
    algo, _, hexpart = digest.partition(":")
    return layout / "blobs" / algo / hexpart


def _put_blob(layout: Path, obj: dict) -> dict:
    data = json.dumps(obj, separators=(",", ":")).encode()
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    _blob(layout, digest).write_bytes(data)
    return {"digest": digest, "size": len(data)}


def _scan_layer(blob: Path) -> tuple[list[str], list[str], list[str]]:
    """Read a layer tar's member names: (whiteouts, opaque dirs, device nodes)."""
    wh, opaque, devices = [], [], []
    with tarfile.open(blob, "r|*") as tf:
        for m in tf:
            name = m.name.lstrip("./") if m.name not in (".", "./") else ""
            base = os.path.basename(name)
            if base == _OPAQUE:
                opaque.append(os.path.dirname(name))
            elif base.startswith(_WH):
                wh.append(os.path.join(os.path.dirname(name), base[len(_WH):]))
            elif m.ischr() or m.isblk() or m.isfifo():
                devices.append(name)
    return wh, opaque, devices


def _to_overlay_form(root: Path, wh: list[str], opaque: list[str], devices: list[str]) -> None:
    for rel in devices:  # umoci created them as root; a sandbox gets no device of its own
        (root / rel).unlink(missing_ok=True)
    for rel in opaque:
        d = root / rel
        d.mkdir(parents=True, exist_ok=True)
        os.setxattr(d, "trusted.overlay.opaque", b"y", follow_symlinks=False)
    for rel in wh:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        os.mknod(p, 0o600 | stat.S_IFCHR, os.makedev(0, 0))
        os.chown(p, ID_BASE, ID_BASE, follow_symlinks=False)


def _disk_bytes(root: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            st = os.lstat(os.path.join(dirpath, n))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def _unpack_layer(store: ImageStore, layout: Path, config: dict, desc: dict, diff_id: str,
                  work: Path) -> int:
    """Unpack one layer into the store; return its size on disk."""
    media = desc.get("mediaType", "")
    if not media.endswith(_LAYER_TYPES):
        raise errors.ImageNotFound(f"layer {desc['digest']} has media type {media!r}, not a tar layer")
    one_cfg = {**config, "rootfs": {"type": "layers", "diff_ids": [diff_id]}, "history": []}
    manifest = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **_put_blob(layout, one_cfg)},
                "layers": [desc]}
    mdesc = {"mediaType": "application/vnd.oci.image.manifest.v1+json", **_put_blob(layout, manifest),
             "annotations": {"org.opencontainers.image.ref.name": "layer"}}
    (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": [mdesc]}))
    dest = work / f"layer-{diff_id.split(':')[1][:16]}"
    idmap = f"0:{ID_BASE}:{ID_COUNT}"
    _run(["umoci", "raw", "unpack", "--uid-map", idmap, "--gid-map", idmap,
          "--image", f"{layout}:layer", str(dest)], f"umoci unpack of layer {diff_id}")
    _to_overlay_form(dest, *_scan_layer(_blob(layout, desc["digest"])))
    nbytes = _disk_bytes(dest)
    store.commit_layer(diff_id, dest, nbytes)
    return nbytes


def _inspect_rootfs(store: ImageStore, layers: list[LayerRef], workdir: str, user: str,
                    work: Path) -> tuple[str, str | None, int, int]:
    """Mount the stacked layers read-only; return (repo_dir, head, uid, gid)."""
    mnt = work / "inspect"
    mnt.mkdir()
    lowers = [store.layer_path(layer.diff_id) for layer in reversed(layers)]
    if len(lowers) == 1:  # overlay needs two lower layers without an upper
        (work / "empty").mkdir()
        lowers.append(work / "empty")
    mount_overlay(lowers, None, None, mnt, readonly=True)
    try:
        if workdir and (mnt / workdir.lstrip("/") / ".git").exists():
            repo_dir = workdir
        elif (mnt / "testbed").is_dir():  # where SWE-bench, R2E-Gym and SWE-smith put the repo
            repo_dir = "/testbed"
        else:
            repo_dir = workdir or "/"
        head = subprocess.run(
            ["git", "-c", "safe.directory=*", "-C", str(mnt / repo_dir.lstrip("/")), "rev-parse", "-q",
             "--verify", "HEAD"], capture_output=True, text=True).stdout.strip() or None
        uid, gid = _resolve_user(mnt, user)
    finally:
        umount(mnt)
    return repo_dir, head, uid, gid


def _resolve_user(root: Path, user: str) -> tuple[int, int]:
    """``User`` of an image config (``name``, ``uid``, ``uid:gid``, ``name:group``) to ids."""
    if not user:
        return 0, 0
    name, _, group = user.partition(":")

    def lookup(db: str, key: str) -> tuple[int, int] | None:
        try:
            for line in (root / "etc" / db).read_text().splitlines():
                f = line.split(":")
                if len(f) > 3 and f[0] == key:
                    return int(f[2]), int(f[3])
        except OSError:
            pass
        return None

    ent = (int(name), None) if name.isdigit() else lookup("passwd", name)
    if ent is None:
        raise errors.ImageNotFound(f"image config User {user!r}: no such user in the image's /etc/passwd")
    uid, gid = ent[0], ent[1]
    if group:
        g = (int(group), 0) if group.isdigit() else lookup("group", group)
        if g is None:
            raise errors.ImageNotFound(f"image config User {user!r}: no such group in /etc/group")
        gid = g[0]
    elif gid is None:
        gid = uid
    if not (0 <= uid < ID_COUNT and 0 <= gid < ID_COUNT):
        raise errors.ImageNotFound(f"image config User {user!r}: ids must be below {ID_COUNT}")
    return uid, gid


def hydrate(source: str, *, name: str | None = None, store: ImageStore | None = None,
            tls_verify: bool = True) -> OciImage:
    """Hydrate ``source`` into ``store`` and point ``name`` at it; blocking (run in a thread).

    Args:
        source: See the module docstring for the forms.
        name: The name tasks use for it (their ``image`` field); default from the source
            (the registry reference, the archive's tag, or the layout's tag).
        store: Default ``ImageStore()``.
        tls_verify: Verify the registry's TLS certificate (False for a local test registry).

    Returns:
        The hydrated :class:`OciImage` (pinned by manifest digest, with its source recorded).

    Raises:
        InputError: The source is malformed or names a local store that is absent.
        ImageNotFound: skopeo or umoci could not read the image (the message carries theirs).
        OSError: The disk filled up (nothing usable-looking is left behind).
        BackendUnavailable: skopeo or umoci is not installed.
    """
    store = store or ImageStore()
    src, default_name = normalize_source(source)
    name = name or default_name
    with store.locked():
        store.clear_tmp()  # we hold the lock, so anything there belongs to a killed hydration
        work = store.new_tmp("hydrate")
        try:
            pinned, source_digest = _pin(src, tls_verify)
            layout = work / "layout"
            _run(["skopeo", "copy", "--quiet", *_src_flags(pinned, tls_verify), pinned, f"oci:{layout}:img"],
                 f"skopeo copy {pinned}")
            index = json.loads((layout / "index.json").read_text())
            mdesc = index["manifests"][0]
            manifest = json.loads(_blob(layout, mdesc["digest"]).read_bytes())
            config = json.loads(_blob(layout, manifest["config"]["digest"]).read_bytes())
            diff_ids = config["rootfs"]["diff_ids"]
            layers = []
            for desc, diff_id in zip(manifest["layers"], diff_ids, strict=True):
                if store.has_layer(diff_id):
                    nbytes = int(store.layer_path(diff_id).with_suffix(".json").read_text())
                else:
                    nbytes = _unpack_layer(store, layout, config, desc, diff_id, work)
                layers.append(LayerRef(diff_id=diff_id, digest=desc["digest"], size=desc["size"],
                                       unpacked=nbytes))
            cfg = config.get("config") or {}
            repo_dir, head, uid, gid = _inspect_rootfs(store, layers, cfg.get("WorkingDir") or "",
                                                       cfg.get("User") or "", work)
            img = OciImage(name=name, digest=mdesc["digest"], source=pinned, source_digest=source_digest,
                           layers=layers, env=cfg.get("Env") or [], workdir=cfg.get("WorkingDir") or "",
                           user=cfg.get("User") or "", uid=uid, gid=gid,
                           entrypoint=cfg.get("Entrypoint") or [], cmd=cfg.get("Cmd") or [],
                           head=head, repo_dir=repo_dir, hydrated_at=time.time())
            store.commit_image(img, [name])
            return img
        finally:
            shutil.rmtree(work, ignore_errors=True)
