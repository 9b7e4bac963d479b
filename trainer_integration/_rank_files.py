"""The files of a sharded save that one rank wrote, taken out of a folder every rank of a
node writes into (Lightning's FSDP and the Hugging Face Trainer save into one path on
every rank): each rank then reports its own files, and ckval stores their union as one
checkpoint, no rank copying another's shard.
"""

from __future__ import annotations

import os
import re
import shutil

# torch.distributed.checkpoint: __<rank>_<n>.distcp; DeepSpeed: [bf16_]zero_pp_rank_<rank>_...
_RANK_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|(?:\w+_)?zero_pp_rank_(\d+)_.*)$")


def file_rank(name: str) -> int | None:
    """The rank a shard file's name says wrote it, or None for a file of no rank's."""
    match = _RANK_FILE.match(name)
    if match is None:
        return None
    return int(match.group(1) if match.group(1) is not None else match.group(2))


def is_sharded(folder: str) -> bool:
    """Whether ``folder`` holds shard files named by rank."""
    return any(file_rank(name) is not None for _, _, names in os.walk(folder) for name in names)


def take_own_files(folder: str, rank: int, target: str) -> int:
    """Links (or copies) into ``target`` the files of ``folder`` that ``rank`` wrote: its
    shards, and on rank 0 every file that no rank's name marks (metadata, configs).
    Returns how many files it took; ``folder`` is left as it is."""
    taken = 0
    for current, _, names in os.walk(folder):
        relative = os.path.relpath(current, folder)
        for name in names:
            owner = file_rank(name)
            if owner != rank and not (owner is None and rank == 0):
                continue
            destination = os.path.normpath(os.path.join(target, relative, name))
            os.makedirs(os.path.dirname(destination), exist_ok=True)
            try:
                os.link(os.path.join(current, name), destination)
            except OSError:  # another filesystem, or no hard links there
                shutil.copy2(os.path.join(current, name), destination)
            taken += 1
    return taken
