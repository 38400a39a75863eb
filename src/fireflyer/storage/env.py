"""The environment variables storage reads; :class:`~fireflyer.storage.backends.s3.S3Config` is their one reader.

(``FIREFLYER_WEED``, where the test harness finds SeaweedFS's binary, is the harness's own.)
"""

from __future__ import annotations

S3_ENDPOINT = "FIREFLYER_S3_ENDPOINT"
"""The S3 endpoint of an ``s3://`` URL without ``?endpoint=`` (unset: AWS itself)."""
REGION = "AWS_DEFAULT_REGION"
"""The region of an ``s3://`` URL without ``?region=`` (default ``us-east-1``)."""
ACCESS_KEY = "AWS_ACCESS_KEY_ID"
SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
"""boto3's credentials, where the S3Config gives none."""
