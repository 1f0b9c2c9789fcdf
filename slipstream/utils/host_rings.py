"""What the same-host shared-memory collectives keep per rank, without torch: ``comm/shm.py``'s sizes, which the
torch-free estimator counts for ranks that train on CPU.

[Note: a ring's resident bytes] Each ring (a process group and each of its lanes, ``comm/lanes.py``) whose ranks
share a host makes one file per rank in ``/dev/shm`` of two halves of ``PIECE_BYTES``, and its reduce-scatter a
scratch row of ``PIECE_BYTES / size`` (``comm/shm.py``). A rank's own file counts in its resident size once touched
(its peers read it with ``preadv``, so it is counted once, in its owner's); a collective of at least two pieces
touches all of it. Measured on gpt2-large at 2 ranks: 16 MiB per rank at ZeRO 1 and 2 (one ring carries the
gradients), 26 at ZeRO 3 (its gather and reduce lanes), 7 at ZeRO 0 (its buckets touched half the file).
"""

from __future__ import annotations

PIECE_BYTES = 8 << 20  # one half of a rank's file: a ZeRO-3 unit's reduce-scatter in two pieces


def ring_bytes(size: int) -> int:
    """Bytes one ring of ``size`` ranks on one host keeps per rank at most: its own file and the scratch row."""
    return 2 * PIECE_BYTES + PIECE_BYTES // size if size > 1 else 0
