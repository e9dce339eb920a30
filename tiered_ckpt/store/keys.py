"""Keys relative to a store prefix <-> full S3 keys (pure). A store keeps objects as
``<prefix>/<key>``; everything above it speaks relative keys
(``step_0000001234/rank_00000.safetensors``)."""

from __future__ import annotations

from dataclasses import dataclass

from tiered_ckpt.errors import UploadError
from tiered_ckpt.store.base import validate_key


@dataclass(frozen=True)
class PrefixKeys:
    """The key mapping of one bucket prefix (``prefix`` without leading or trailing ``/``; ``""``
    for the bucket root). Methods raise ``ValueError`` for unusable relative keys
    (:func:`validate_key`)."""

    prefix: str

    def full_key(self, key: str) -> str:
        """``<prefix>/<key>`` for a valid relative ``key``."""
        validate_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def full_prefix(self, prefix: str) -> str:
        """A LIST prefix under the store prefix; ``"step_1/"`` and ``"step_"`` are both fine."""
        if prefix:
            validate_key(prefix[:-1] if prefix.endswith("/") else prefix)
        return f"{self.prefix}/{prefix}" if self.prefix else prefix

    def relative(self, full_key: str) -> str:
        """The relative key of a full key the server returned; ``UploadError`` if it lies
        outside."""
        if not self.prefix:
            return full_key
        head = self.prefix + "/"
        if not full_key.startswith(head):
            raise UploadError(f"server returned key {full_key!r} outside prefix {self.prefix!r}")
        return full_key[len(head) :]


__all__ = ["PrefixKeys"]
