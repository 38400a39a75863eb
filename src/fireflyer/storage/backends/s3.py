"""An S3-compatible object store through boto3 (AWS S3, SeaweedFS, MinIO, Ceph RGW...).

Ranged GETs make record reads O(1) per sample, as on a file system. boto3's own retries
are switched off so the base class's backoff (with the key in the final error) is the
only retry policy; connect and read timeouts bound every call.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fireflyer.fsutil import atomic_write_file
from fireflyer.storage import env
from fireflyer.storage.backends.base import Backend, RetryConfig
from fireflyer.errors import UserError


@dataclass(frozen=True, kw_only=True)
class S3Config:
    """Where the bucket is and how to reach it. Credentials fall back to boto3's usual chain
    (``AWS_ACCESS_KEY_ID`` and friends) when not given."""

    bucket: str
    prefix: str = ""
    endpoint_url: str | None = None
    """e.g. ``http://127.0.0.1:8333`` for a local SeaweedFS; None for AWS itself."""
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 30.0
    max_pool_connections: int = 16

    def __post_init__(self) -> None:
        if not self.bucket or "/" in self.bucket:
            raise UserError(f"bucket must be a bucket name without '/', got {self.bucket!r}")
        if self.prefix.startswith("/"):
            raise UserError(f"prefix must be relative, got {self.prefix!r}")
        if self.connect_timeout <= 0 or self.read_timeout <= 0:
            raise UserError("connect_timeout and read_timeout must be positive seconds")

    @classmethod
    def from_env(cls, *, bucket: str, prefix: str = "", endpoint_url: str | None = None, region: str | None = None,
                 **fields) -> "S3Config":
        """A config whose endpoint and region, where not given, come from ``FIREFLYER_S3_ENDPOINT``
        and ``AWS_DEFAULT_REGION`` (else ``us-east-1``)."""
        return cls(bucket=bucket, prefix=prefix,
                   endpoint_url=endpoint_url if endpoint_url is not None else os.environ.get(env.S3_ENDPOINT),
                   region=region if region is not None else os.environ.get(env.REGION, "us-east-1"), **fields)

    def credentials(self) -> tuple[str | None, str | None]:
        """The access and secret key: this config's, else ``AWS_ACCESS_KEY_ID`` and ``AWS_SECRET_ACCESS_KEY``
        (None: boto3's own chain)."""
        return (self.access_key or os.environ.get(env.ACCESS_KEY), self.secret_key or os.environ.get(env.SECRET_KEY))


class S3Backend(Backend):
    name = "s3"

    def __init__(self, config: S3Config, *, retry: RetryConfig | None = None, create_bucket: bool = False) -> None:
        super().__init__(retry=retry)
        try:
            import boto3
            from botocore.config import Config
        except ImportError:
            raise ImportError("the S3 backend needs boto3: pip install 'fireflyer[s3]'") from None
        self.config = config
        self._prefix = config.prefix.strip("/") + "/" if config.prefix.strip("/") else ""
        access_key, secret_key = config.credentials()
        self._client = boto3.session.Session().client(
            "s3", endpoint_url=config.endpoint_url, region_name=config.region,
            aws_access_key_id=access_key, aws_secret_access_key=secret_key,
            config=Config(connect_timeout=config.connect_timeout, read_timeout=config.read_timeout,
                          retries={"max_attempts": 1, "mode": "standard"},
                          max_pool_connections=config.max_pool_connections,
                          s3={"addressing_style": "path"}))
        if create_bucket:
            self._call("create bucket", config.bucket, self._create_bucket)

    def __repr__(self) -> str:
        return f"S3Backend(bucket={self.config.bucket!r}, prefix={self.config.prefix!r})"

    def _create_bucket(self) -> None:
        try:
            self._client.create_bucket(Bucket=self.config.bucket)
        except self._client.exceptions.BucketAlreadyOwnedByYou:
            pass
        except self._client.exceptions.BucketAlreadyExists:
            pass

    def _k(self, key: str) -> str:
        return self._prefix + key

    # -- error classes -----------------------------------------------------------------
    def _not_found(self, exc: BaseException) -> bool:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return code in ("404", "NoSuchKey", "NotFound", "NoSuchBucket")
        return False

    def _transient(self, exc: BaseException) -> bool:
        from botocore.exceptions import (ClientError, ConnectionClosedError, ConnectTimeoutError,
                                         EndpointConnectionError, ReadTimeoutError)

        if isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError, ConnectionClosedError)):
            return True
        if isinstance(exc, ClientError):
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
            code = str(exc.response.get("Error", {}).get("Code", ""))
            return status >= 500 or status == 429 or code in ("SlowDown", "RequestTimeout", "InternalError")
        return super()._transient(exc)

    # -- hooks -------------------------------------------------------------------------
    def _read(self, key: str) -> bytes:
        return self._client.get_object(Bucket=self.config.bucket, Key=self._k(key))["Body"].read()

    def _read_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            resp = self._client.get_object(Bucket=self.config.bucket, Key=self._k(key),
                                           Range=f"bytes={offset}-{offset + length - 1}")
        except Exception as exc:
            from botocore.exceptions import ClientError

            if isinstance(exc, ClientError) and exc.response.get("Error", {}).get("Code") == "InvalidRange":
                return b""  # past the end, as a short read on a file
            raise
        return resp["Body"].read()

    def _write(self, key: str, data: bytes | memoryview) -> None:
        self._client.put_object(Bucket=self.config.bucket, Key=self._k(key), Body=bytes(data))

    def _upload(self, key: str, path: str) -> None:
        self._client.upload_file(path, self.config.bucket, self._k(key))  # multipart for large files

    def _download(self, key: str, path: str) -> None:
        atomic_write_file(path, lambda tmp: self._client.download_file(self.config.bucket, self._k(key), tmp))

    def _size(self, key: str) -> int:
        return int(self._client.head_object(Bucket=self.config.bucket, Key=self._k(key))["ContentLength"])

    def _list(self, prefix: str) -> list[str]:
        out = []
        pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=self.config.bucket,
                                                                       Prefix=self._k(prefix))
        for page in pages:
            for obj in page.get("Contents", []):
                out.append(obj["Key"][len(self._prefix):])
        return out

    def _delete(self, key: str) -> None:
        self._client.delete_object(Bucket=self.config.bucket, Key=self._k(key))

    def close(self) -> None:
        self._client.close()
