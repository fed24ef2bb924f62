"""Image placement: which images go on which nodes, in windows that fit the nodes' image disks.

Taking image hydration off the critical path (the seed's first lever): before rollouts ask
for an image, it is pulled onto the node its sandboxes will run on, and those sandboxes are
steered there by a required node affinity in their pod template. :func:`plan` packs images
onto nodes bounded by each node's image disk and pod slots; when the corpus does not fit,
it cuts the images into windows. With more than one window, each window may use only
``pipeline_fraction`` of every disk, so the next window's images can be pulled (prepulled)
while the current one runs, without evicting images in use.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sandpool.core import errors

__all__ = ["NodeCapacity", "PlacementPlan", "plan"]

GB = 1e9


@dataclass(frozen=True)
class NodeCapacity:
    """What one node offers the plan.

    Attributes:
        name: The node name (``kubernetes.io/hostname``).
        disk_bytes: Image disk (bytes) the plan may fill.
        pods: Pods the node can run at once for this run.
    """

    name: str
    disk_bytes: float
    pods: int


@dataclass
class PlacementPlan:
    """The result of :func:`plan`.

    Attributes:
        windows: One mapping image -> node per window, in order.
        sizes: Image -> bytes.
        nodes: The nodes planned over.
        slots_per_image: Pods each image's rollouts hold at once.
        fraction: Share of each node's disk one window may use.
    """

    windows: list[dict[str, str]]
    sizes: dict[str, float]
    nodes: list[NodeCapacity]
    slots_per_image: int
    fraction: float
    node_of: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.node_of = {img: node for w in self.windows for img, node in w.items()}

    def window_of(self, image: str) -> int:
        """The index of the window holding ``image``."""
        for i, w in enumerate(self.windows):
            if image in w:
                return i
        raise KeyError(image)

    def describe(self) -> str:
        """The plan as text: one line per window and node (images, GB, pods)."""
        total = sum(self.sizes.values()) / GB
        disk = sum(n.disk_bytes for n in self.nodes) / GB
        lines = [
            f"placement: {len(self.sizes)} images ({total:.0f} GB) on {len(self.nodes)} nodes "
            f"({disk:.0f} GB image disk), {len(self.windows)} window(s) using "
            f"{self.fraction:.0%} of each disk, {self.slots_per_image} pod(s) per image"
        ]
        for i, w in enumerate(self.windows):
            per: dict[str, list[str]] = {}
            for img, node in w.items():
                per.setdefault(node, []).append(img)
            used = sum(self.sizes[i_] for i_ in w) / GB
            lines.append(f"  window {i}: {len(w)} images, {used:.0f} GB")
            for node in sorted(per):
                imgs = per[node]
                gb = sum(self.sizes[i_] for i_ in imgs) / GB
                lines.append(
                    f"    {node}: {len(imgs)} images, {gb:.1f} GB, "
                    f"{len(imgs) * self.slots_per_image} pods"
                )
        return "\n".join(lines)

    def as_dict(self) -> dict:
        """The plan as JSON-ready data (for reports)."""
        return {
            "fraction": self.fraction,
            "slots_per_image": self.slots_per_image,
            "nodes": [n.__dict__ for n in self.nodes],
            "windows": self.windows,
            "sizes_gb": {k: round(v / GB, 3) for k, v in self.sizes.items()},
        }


def plan(
    images: Sequence[str],
    sizes: Mapping[str, float],
    nodes: Sequence[NodeCapacity],
    *,
    slots_per_image: int = 1,
    pipeline_fraction: float = 0.5,
) -> PlacementPlan:
    """Place ``images`` on ``nodes``, each on one node, in as few windows as fit.

    Greedy: images in the given order (the order rollouts will run them), each to the node
    with the most free disk that still has ``slots_per_image`` pod slots; an image that fits
    nowhere opens the next window. If everything fits in one window it may use all of each
    disk; otherwise every window uses at most ``pipeline_fraction`` of it.

    Args:
        images: Distinct images in rollout order.
        sizes: Image -> bytes (every image must have one).
        nodes: The nodes and their capacity.
        slots_per_image: Pods one image's rollouts hold at once (1 for reuse lanes).
        pipeline_fraction: Disk share per window when there are several (0 < f <= 1).

    Returns:
        The :class:`PlacementPlan`.

    Raises:
        ConfigError: No nodes, a missing size, or an image larger than any node's window.
    """
    if not nodes:
        raise errors.ConfigError("placement: no schedulable nodes to place images on")
    missing = [i for i in images if i not in sizes]
    if missing:
        raise errors.ConfigError(f"placement: no size for images {missing[:3]}; pass sizes=")
    if not 0 < pipeline_fraction <= 1:
        raise errors.ConfigError(f"pipeline_fraction={pipeline_fraction} must be in (0, 1]")
    images = list(dict.fromkeys(images))
    total_disk = sum(n.disk_bytes for n in nodes)
    total_slots = sum(n.pods for n in nodes)
    fits_once = (sum(sizes[i] for i in images) <= total_disk
                 and len(images) * slots_per_image <= total_slots)
    fraction = 1.0 if fits_once else pipeline_fraction
    windows = _pack(images, sizes, nodes, slots_per_image, fraction)
    if fraction == 1.0 and len(windows) > 1:  # per-node packing did not fit after all
        fraction = pipeline_fraction
        windows = _pack(images, sizes, nodes, slots_per_image, fraction)
    return PlacementPlan(windows, {i: float(sizes[i]) for i in images}, list(nodes),
                         slots_per_image, fraction)


def _pack(images, sizes, nodes, slots, fraction) -> list[dict[str, str]]:
    windows: list[dict[str, str]] = []
    free: dict[str, list[float]] = {}

    def fresh() -> None:
        windows.append({})
        free.clear()
        free.update({n.name: [n.disk_bytes * fraction, n.pods] for n in nodes})

    fresh()
    for img in images:
        size = sizes[img]
        fit = [n for n, (disk, pods) in free.items() if disk >= size and pods >= slots]
        if not fit:
            if windows[-1]:
                fresh()
                fit = [n for n, (disk, pods) in free.items() if disk >= size and pods >= slots]
            if not fit:
                raise errors.ConfigError(
                    f"placement: image {img!r} ({size / GB:.1f} GB, {slots} pods) fits on no "
                    f"node (window disk {max(n.disk_bytes for n in nodes) * fraction / GB:.1f} "
                    "GB); give the nodes more image disk or pipeline_fraction=1"
                )
        node = max(fit, key=lambda n: (free[n][0], free[n][1]))
        free[node][0] -= size
        free[node][1] -= slots
        windows[-1][img] = node
    return windows
