"""The data path (paper §VI-B, the 3FS role): record shards addressable at random, a
tiered shard cache with prefetch, and storage backends (local POSIX, S3, 3FS USRBIO).

Nothing here needs torch except :class:`~fireflyer.storage.records.RecordDataset`, which
imports it when used.
"""
