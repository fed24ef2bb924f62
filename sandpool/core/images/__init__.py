"""OCI images as local images: hydration into a shared, content-addressed layer store.

``hydrate(source)`` brings an image in (registry, ``docker save`` archive, OCI layout, local
Docker/Podman store); :class:`ImageStore` lists, resolves and prunes what is there. The local
backend starts sandboxes from them (see ``sandpool.core.backends.local._oci``).
"""

from sandpool.core.images.hydrate import hydrate, normalize_source
from sandpool.core.images.store import ID_BASE, ID_COUNT, ImageStore, LayerRef, OciImage, StoreUsage

__all__ = ["ID_BASE", "ID_COUNT", "ImageStore", "LayerRef", "OciImage", "StoreUsage", "hydrate",
           "normalize_source"]
