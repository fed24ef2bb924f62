"""What each task image becomes in a pod: its :class:`~._manifests.PodImage` and its PodSpec.

:class:`PodImages` resolves a task's ``image`` through the backend's image map once,
validates it (a container image reference), and builds the one PodSpec every object of the
image carries (template, Sandbox object, plain pod), including the node the placement plan
pinned the image to.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sandpool.core import errors
from sandpool.core.backends.kubernetes import _manifests as m
from sandpool.core.backends.kubernetes._manifests import PodImage

__all__ = ["ImageMap", "PodImages"]

#: Maps a task's ``image`` to what its pod runs: a mapping, or a function (may raise
#: ImageNotFound). None means ``PodImage(image)``: the task image is the container image.
ImageMap = Mapping[str, PodImage] | Callable[[str], PodImage]

# OCI reference: [host[:port]/]path[:tag][@digest], lower-case path components.
_IMAGE_REF = re.compile(
    r"^(?:[a-zA-Z0-9.-]+(?::[0-9]+)?/)?[a-z0-9]+(?:[._-]+[a-z0-9]+)*(?:/[a-z0-9]+(?:[._-]+[a-z0-9]+)*)*"
    r"(?::[\w][\w.-]{0,127})?(?:@sha256:[0-9a-f]{64})?$"
)


class PodImages:
    """Task image -> :class:`PodImage` and PodSpec, for one backend.

    Args:
        image_map: See :data:`ImageMap`; None runs each task image as the container image.
        container: The container's name.
        command: The container's command (it must keep running; exec does the work).
        resources: The container's ``resources``.
        runtime_class: ``runtimeClassName`` of the pods, or None.
        node_selector: ``nodeSelector`` of the pods.
        tolerations: ``tolerations`` of the pods.
        service_port: The port the pods' service listens on (declared in the spec), or None.
        disk_bytes: The pods' writable scratch cap (:func:`._manifests.scratch_volume`), or None.
        entrypoint: The container command that makes the agent pid 1 (:mod:`._entrypoint`),
            or None (``command``); with it every pod's root file system is read-only, its
            repo and ``/tmp`` on the scratch volume.
    """

    def __init__(
        self,
        image_map: ImageMap | None,
        *,
        container: str,
        command: Sequence[str],
        resources: Mapping[str, Any],
        runtime_class: str | None,
        node_selector: Mapping[str, str],
        tolerations: Sequence[Mapping[str, Any]],
        service_port: int | None,
        disk_bytes: int | None = None,
        entrypoint: Sequence[str] | None = None,
    ) -> None:
        self.image_map = image_map
        self.container = container
        self.command = list(command)
        self.resources = dict(resources)
        self.runtime_class = runtime_class
        self.node_selector = dict(node_selector)
        self.tolerations = [dict(t) for t in tolerations]
        self.service_port = service_port
        self.disk_bytes = disk_bytes
        self.entrypoint = list(entrypoint) if entrypoint else None
        self._resolved: dict[str, PodImage] = {}
        self._node_of: dict[str, str] = {}  # image -> node (placement: required affinity)

    def __len__(self) -> int:
        return len(self._resolved)

    def resolve(self, image: str) -> PodImage:
        """Resolve task image ``image`` through the image map and validate it.

        Raises:
            ImageNotFound: Not in the map (or the map raised it), or an invalid image
                reference.
        """
        if image in self._resolved:
            return self._resolved[image]
        if self.image_map is None:
            pi = PodImage(image)
        elif callable(self.image_map):
            pi = self.image_map(image)
        else:
            try:
                pi = self.image_map[image]
            except KeyError:
                raise errors.ImageNotFound(
                    f"image {image!r} is not in the backend's image_map"
                ) from None
        if not _IMAGE_REF.match(pi.image):
            raise errors.ImageNotFound(
                f"image {image!r} maps to {pi.image!r}, which is not a valid container image "
                "reference ([registry/]path[:tag][@sha256:digest], lower-case path)"
            )
        self._resolved[image] = pi
        return pi

    def pin(self, node_of: Mapping[str, str]) -> None:
        """Make the pods of each image of ``node_of`` (image -> node) require that node."""
        self._node_of.update(node_of)

    def spec(self, pi: PodImage, image: str | None = None) -> dict[str, Any]:
        """The PodSpec of ``pi`` (task image ``image``, for its pinned node; None: no pin)."""
        spec = m.pod_spec(
            pi,
            container=self.container,
            command=self.entrypoint or self.command,
            resources=self.resources,
            runtime_class=self.runtime_class,
            node_selector=self.node_selector,
            tolerations=self.tolerations,
            node=self._node_of.get(image) if image is not None else None,
            disk_bytes=self.disk_bytes,
            read_only_root=self.entrypoint is not None,
        )
        if self.entrypoint:  # the agent: one attach, whose end closes its stdin
            spec["containers"][0].update(stdin=True, stdinOnce=True)
        if self.service_port is not None:
            spec["containers"][0]["ports"] = [{"name": "service", "containerPort": self.service_port}]
        return spec
