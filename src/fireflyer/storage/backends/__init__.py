"""Storage backends behind one interface (:class:`Backend`), and :func:`open_backend` for URLs.

* ``/some/dir`` or ``file:///some/dir``: :class:`LocalBackend` (also a 3FS/Lustre/NFS mount)
* ``s3://bucket/prefix``: :class:`S3Backend`; the endpoint comes from ``?endpoint=URL`` or
  ``FIREFLYER_S3_ENDPOINT``, credentials from boto3's usual environment variables
* ``3fs:///mount/dir``: :class:`ThreeFSBackend` (USRBIO; needs 3FS's Python binding)
"""

from __future__ import annotations

import os
from urllib.parse import parse_qs, urlparse

from fireflyer.storage.backends.base import Backend, RetryConfig, check_key
from fireflyer.storage.backends.local import LocalBackend
from fireflyer.errors import UserError

__all__ = ["Backend", "LocalBackend", "RetryConfig", "check_key", "open_backend"]


def open_backend(url: str | os.PathLike | Backend, *, retry: RetryConfig | None = None) -> Backend:
    """A backend from a path or URL (a Backend is returned as it is)."""
    if isinstance(url, Backend):
        return url
    text = os.fspath(url)
    if text.startswith("3fs://"):  # not a valid URL scheme to urlparse (it starts with a digit)
        from fireflyer.storage.backends.threefs import ThreeFSBackend

        return ThreeFSBackend(text[len("3fs://"):], retry=retry)
    parsed = urlparse(text)
    if parsed.scheme in ("", "file"):
        return LocalBackend(parsed.path if parsed.scheme else text, retry=retry)
    if parsed.scheme == "s3":
        from fireflyer.storage.backends.s3 import S3Backend, S3Config

        q = parse_qs(parsed.query)
        return S3Backend(S3Config.from_env(bucket=parsed.netloc, prefix=parsed.path.lstrip("/"),
                                           endpoint_url=q.get("endpoint", [None])[0], region=q.get("region", [None])[0]),
                         retry=retry)
    raise UserError(f"unknown storage URL scheme {parsed.scheme!r} in {text!r}; use a path, file://, s3:// or 3fs://")
