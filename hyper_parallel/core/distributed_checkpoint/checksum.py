"""Block checksums of stored bytes (xxh3-64, which runs at memory speed).

A chunk's stored bytes are cut into blocks of ``block_bytes``; each block has
its own digest, so a load that needs part of a chunk verifies only the blocks
it reads.
"""

from __future__ import annotations

import xxhash

from hyper_parallel.core.distributed_checkpoint.metadata import ChunkChecksum

__all__ = ["ALGORITHM", "DEFAULT_BLOCK_BYTES", "digest", "chunk_checksum"]

#: The hash used for every block.
ALGORITHM = "xxh3_64"
#: Default block size: small enough that partial reads verify little extra.
DEFAULT_BLOCK_BYTES = 1 << 20


def digest(data: memoryview | bytes) -> str:
    """Return the lowercase hex xxh3-64 digest of ``data``."""
    return xxhash.xxh3_64_hexdigest(data)


def chunk_checksum(data: memoryview, block_bytes: int = DEFAULT_BLOCK_BYTES) -> ChunkChecksum:
    """Return the block checksums of one chunk's stored bytes (a 1-D byte view)."""
    length = len(data)
    if length == 0:
        digests: tuple[str, ...] = (digest(b""),)
    else:
        digests = tuple(digest(data[start : start + block_bytes]) for start in range(0, length, block_bytes))
    return ChunkChecksum(algorithm=ALGORITHM, block_bytes=block_bytes, digests=digests)
