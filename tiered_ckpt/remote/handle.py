"""The store a remote call works on: the caller's (left open) or one built from the URL (closed on
exit).

Used by the URL-taking entry points (restore, plan, list, verify) so that each builds at most ONE
client and ONE store per call (:mod:`tiered_ckpt.store.base`, lifecycle step 1).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from tiered_ckpt.store.base import ObjectStore, RemoteNotFoundError

if TYPE_CHECKING:
    from tiered_ckpt.store import TransferSettings


class StoreHandle:
    """``with StoreHandle(url, store=None, s3_client=None, endpoint_url=None, transfer=None) as
    store:``.

    ``store``: an open :class:`~tiered_ckpt.store.base.ObjectStore` to use (not closed here).
    Otherwise an :class:`~tiered_ckpt.store.s3.S3Store` is built for ``remote_url`` over
    ``s3_client`` (an injected botocore client; default: one from boto3's chain, ``endpoint_url`` or
    ``AWS_ENDPOINT_URL``) with the ``transfer`` settings, and a stop event so that an interrupted
    restore (Ctrl-C) cancels its transfers in flight; it is closed on exit. Raises ``ValueError``
    for a bad URL.
    """

    def __init__(
        self,
        remote_url: str,
        *,
        store: ObjectStore | None = None,
        s3_client: Any = None,
        endpoint_url: str | None = None,
        transfer: TransferSettings | None = None,
    ) -> None:
        self.owned = store is None
        #: Set by :meth:`cancel`; only a store built here is wired to it.
        self.stop_event = threading.Event()
        if store is None:
            from tiered_ckpt.store.s3 import S3Store, make_s3_client  # the only path to boto3

            if s3_client is None:
                s3_client = make_s3_client(endpoint_url=endpoint_url)
            store = S3Store.from_url(
                remote_url, client=s3_client, transfer=transfer, stop_event=self.stop_event
            )
        self.store: ObjectStore = store

    def cancel(self) -> None:
        """Stop the transfers in flight of a store built here (retries stop, downloads abort); a
        store the caller passed is left alone (its own stop event is the caller's)."""
        self.stop_event.set()

    def __enter__(self) -> ObjectStore:
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.owned:
            self.store.close()


def object_url(store: ObjectStore, key: str) -> str:
    """``s3://bucket/prefix/key`` of a key relative to the store prefix, for messages."""
    return f"{store.url}/{key}"


def get_or_none(store: ObjectStore, key: str, *, max_bytes: int) -> bytes | None:
    """GET ``key`` (relative to the store prefix), at most ``max_bytes`` (its kind's cap from
    :mod:`tiered_ckpt.remote.limits`); ``None`` when it does not exist (S3 404). Raises
    :class:`~tiered_ckpt.errors.ManifestError` (over the cap),
    :class:`~tiered_ckpt.errors.UploadError` (other failures, after the store's retries)."""
    try:
        return store.get_bytes(key, max_bytes=max_bytes)
    except RemoteNotFoundError:
        return None


__all__ = ["StoreHandle", "get_or_none", "object_url"]
