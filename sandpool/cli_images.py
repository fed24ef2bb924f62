"""The ``sandpool images`` commands: the OCI images hydrated for local sandboxes.

``list`` (the default), ``pull``, ``rm`` and ``prune``, each a thin caller of
:mod:`sandpool.core.images` (:class:`~sandpool.core.images.ImageStore`,
:func:`~sandpool.core.images.hydrate`). :mod:`sandpool.cli` adds :data:`images_app` to the
``sandpool`` command. A bad argument prints one error line on stderr and exits 2.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.console import Console
from rich.markup import escape

from sandpool.core import errors

console = Console(stderr=True)

images_app = typer.Typer(rich_markup_mode="markdown",
                         help="OCI images hydrated for local sandboxes: list (default), pull, rm, prune.")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


@images_app.callback(invoke_without_command=True)
def images_default(ctx: typer.Context) -> None:
    """List hydrated images with their sizes (the same as 'sandpool images list')."""
    if ctx.invoked_subcommand is None:
        images_list()


@images_app.command("list")
def images_list() -> None:
    """List hydrated images with their sizes, and the bytes on disk against the sum of sizes."""
    from sandpool.core.images import ImageStore

    store = ImageStore()
    for img in store.images():
        print(f"{img.name:<50} {img.digest[:19]}  {len(img.layers):>3} layers  "
              f"{_size(img.size):>10} shipped  {_size(img.unpacked):>10} unpacked  {img.source}")
    u = store.usage()
    print(f"{u.images} images, {u.layers} layers: {_size(u.on_disk)} on disk for "
          f"{_size(u.sum_image_sizes)} of images unpacked ({_size(u.sum_blob_sizes)} shipped)")


@images_app.command("pull")
def images_pull(
    source: Annotated[str, typer.Argument(help="docker://REPO:TAG, docker-archive:PATH, oci:PATH[:TAG], "
                                               "oci-archive:PATH, docker-daemon:REF, containers-storage:REF, or a path.")],
    name: Annotated[str, typer.Option(help="Name tasks use in their `image` field (default: from the source).")] = "",
    tls_verify: Annotated[bool, typer.Option(help="Verify the registry's TLS certificate.")] = True,
) -> None:
    """Hydrate an OCI image into the local store (layers unpacked once, shared), pinned by digest."""
    from sandpool.core.images import hydrate

    try:
        img = hydrate(source, name=name or None, tls_verify=tls_verify)
    except (errors.InputError, errors.FatalError, OSError) as exc:
        console.print(f"[red]error:[/] {escape(str(exc))}", soft_wrap=True)
        raise typer.Exit(2) from None
    print(f"{img.name} -> {img.digest} ({len(img.layers)} layers, {_size(img.size)}, repo {img.repo_dir}, "
          f"HEAD {img.head or '-'})")


@images_app.command("rm")
def images_rm(name: Annotated[str, typer.Argument(help="An image name.")]) -> None:
    """Drop a name; its image and unshared layers are deleted by `sandpool images prune`."""
    from sandpool.core.images import ImageStore

    if not ImageStore().remove(name):
        console.print(f"[red]error:[/] no image named {escape(repr(name))}; see `sandpool images`", soft_wrap=True)
        raise typer.Exit(2)
    print(f"removed {name}")


@images_app.command("prune")
def images_prune() -> None:
    """Delete images no name points at, layers no image uses, and killed hydrations' leftovers."""
    from sandpool.core.images import ImageStore

    r = ImageStore().prune()
    print(f"pruned {r['images']} images, {r['layers']} layers ({_size(r['bytes'])}), "
          f"{r['tmp']} unfinished hydrations")
