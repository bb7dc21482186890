"""The disk tier: one file per KV block in a directory of its own (--kv-offload-dir), below the host tier.

Its index is a BlockPool over slots (executor/kv/block_pool.py), as many as --kv-offload-disk holds files, so the
same per-tenant shares and scan resistance decide which file a new block replaces. The engine thread alone
touches the index; write() and read() run on the coordinator's workers (offloader.py), on slots the engine thread
has pinned. A file is trusted only as far as its checks (block_files.py): a restarted executor indexes the files
it finds (scan), and anything missing, truncated, corrupt or computed by another model is refused, never served.
One executor per directory: scan() removes what it does not index.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import threading
from pathlib import Path
from typing import BinaryIO

import torch

from executor.kv.block_pool import BlockPool
from executor.kv.tiers.block_files import (
    PREFIX_BYTES,
    SUFFIX,
    TEMP_SUFFIX,
    BlockHeader,
    encode_header,
    file_bytes,
    file_name,
    header_length,
    parse_header,
    payload_ok,
)
from executor.kv.tiers.fingerprint import KVFingerprint
from shared.tenant import Tenant

log = logging.getLogger("kvserve.engine")


class DiskTier:
    name = "disk"

    def __init__(
        self,
        directory: Path,
        capacity_bytes: int,
        fingerprint: KVFingerprint,
        dtype: torch.dtype,
        shares: bool = True,
    ) -> None:
        if str(dtype).removeprefix("torch.") != fingerprint.dtype:
            raise ValueError(f"the disk tier's dtype {dtype} is not its fingerprint's ({fingerprint.dtype})")
        self.payload_bytes = math.prod(fingerprint.block_shape) * dtype.itemsize
        self.file_bytes = file_bytes(self.payload_bytes)
        num_slots = capacity_bytes // self.file_bytes
        if num_slots < 1:
            raise ValueError(
                f"kv_offload_disk: {capacity_bytes} bytes hold no KV block file (one takes {self.file_bytes} bytes)"
            )
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.dtype = dtype
        self._digest = fingerprint.digest()
        # KV reveals what was in prompts: only this user reads the files (a directory made looser is tightened)
        # (folders it makes above it too: kvserve up gives each executor one below the folder it was given)
        for folder in reversed([self.directory, *self.directory.parents]):
            if not folder.exists():
                folder.mkdir(mode=0o700, exist_ok=True)
        if stat.S_IMODE(self.directory.stat().st_mode) & 0o077:
            self.directory.chmod(0o700)
        self.index = BlockPool(num_slots, shares=shares, record_events=True)
        self.rejected = 0
        # the file each slot wrote last, and back: a hash written again from another slot takes its file over,
        # and the slot that held it before must not remove it when it is reused
        self._files: list[str | None] = [None] * num_slots
        self._slot_of: dict[str, int] = {}
        # workers on different slots meet only here: renames, removals and the bookkeeping above
        self._lock = threading.Lock()
        self._scanned = False

    def scan(self) -> int:
        """Index the block files already there, each as a cached idle slot of the owner its header names; remove
        temp files, refused files, and the oldest past capacity. How many it indexed."""
        if self._scanned:
            raise RuntimeError("the disk tier scans its directory once, before any write")
        self._scanned = True
        found: list[tuple[int, str, BlockHeader]] = []
        for entry in os.scandir(self.directory):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.endswith(TEMP_SUFFIX):  # a write a crash cut short
                os.unlink(entry.path)
            elif entry.name.endswith(SUFFIX):
                header, mtime = self._check(entry)
                if header is None:
                    self.rejected += 1
                    os.unlink(entry.path)
                else:
                    found.append((mtime, entry.name, header))
        found.sort(key=lambda f: (f[0], f[1]), reverse=True)
        kept, past_capacity = found[: self.index.num_blocks], found[self.index.num_blocks :]
        for _, name, _ in past_capacity:
            os.unlink(self.directory / name)
        # oldest first, so the index evicts the least recently written first
        for _, name, header in reversed(kept):
            block = self.index.allocate(1, header.owner)[0]
            self.index.cache(block, header.block_hash)
            self.index.free([block])
            self._files[block.block_id], self._slot_of[name] = name, block.block_id
        if found or self.rejected:
            log.info(
                "disk tier %s: %d block files indexed, %d refused, %d past capacity removed",
                self.directory,
                len(kept),
                self.rejected,
                len(past_capacity),
            )
        return len(kept)

    def write(self, slot: int, block_hash: bytes, owner: Tenant, payload: torch.Tensor) -> None:
        """The block's file, whole or not at all (a temp file renamed over); owner is tier_owner(tenant)."""
        if tuple(payload.shape) != self.fingerprint.block_shape or payload.dtype != self.dtype:
            raise ValueError(
                f"a disk tier block is {self.fingerprint.block_shape} {self.dtype}, "
                f"got {tuple(payload.shape)} {payload.dtype}"
            )
        data = payload.detach().cpu().contiguous().view(torch.uint8).reshape(-1).numpy()
        header = encode_header(block_hash, owner, self._digest, memoryview(data))
        name = file_name(block_hash)
        # the slot is pinned to this worker, so its temp name is this write's alone
        temp = self.directory / f"{block_hash.hex()}.{slot}{TEMP_SUFFIX}"
        temp.unlink(missing_ok=True)
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(data)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        with self._lock:
            os.replace(temp, self.directory / name)
            previous = self._files[slot]
            if previous is not None and previous != name:
                (self.directory / previous).unlink(missing_ok=True)
                del self._slot_of[previous]
            other = self._slot_of.get(name)
            if other is not None and other != slot:
                self._files[other] = None
            self._files[slot], self._slot_of[name] = name, slot

    def read(self, slot: int, block_hash: bytes) -> torch.Tensor | None:
        """The block's payload (CPU, block_shape), verified; None, and the file removed, when it is missing,
        truncated, corrupt or foreign."""
        path = self.directory / file_name(block_hash)
        payload, why = None, "truncated, corrupt or foreign"
        try:
            with open(path, "rb") as f:
                header = self._header(f, block_hash)
                if header is not None:
                    payload = bytearray(self.payload_bytes)
                    if f.readinto(payload) != len(payload) or not payload_ok(header, payload):
                        payload = None
        except FileNotFoundError:
            why = "missing"
        except OSError as error:  # unreadable: refused like a corrupt file
            why = f"unreadable ({error})"
        if payload is None:
            self._refuse(path, why)
            return None
        return (
            torch.frombuffer(payload, dtype=torch.uint8)
            .view(self.dtype)
            .reshape(self.fingerprint.block_shape)
        )

    def _check(self, entry: os.DirEntry) -> tuple[BlockHeader | None, int]:
        """A found file's header if it looks valid (named for its hash, this fingerprint's, of the right size),
        and its mtime. The payload is checked when read: a scan reads headers only."""
        try:
            block_hash = bytes.fromhex(entry.name.removesuffix(SUFFIX))
        except ValueError:
            return None, 0
        if file_name(block_hash) != entry.name:
            return None, 0
        try:
            with open(entry.path, "rb") as f:
                return self._header(f, block_hash), os.fstat(f.fileno()).st_mtime_ns
        except OSError:
            return None, 0

    def _header(self, f: BinaryIO, block_hash: bytes) -> BlockHeader | None:
        """The open file's header, when it is this fingerprint's file of block_hash and its size is right."""
        prefix = f.read(PREFIX_BYTES)
        total = header_length(prefix)
        if total is None:
            return None
        header = parse_header(prefix + f.read(total - PREFIX_BYTES), self._digest)
        if (
            header is None
            or header.block_hash != block_hash
            or header.payload_bytes != self.payload_bytes
            or os.fstat(f.fileno()).st_size != header.header_bytes + header.payload_bytes
        ):
            return None
        return header

    def _refuse(self, path: Path, why: str) -> None:
        """A file read() found bad is gone, and no slot names it any more."""
        log.warning("disk tier: block file %s refused: %s", path.name, why)
        with self._lock:
            self.rejected += 1
            path.unlink(missing_ok=True)
            slot = self._slot_of.pop(path.name, None)
            if slot is not None:
                self._files[slot] = None
