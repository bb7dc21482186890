"""The KV tiers below the pool, coordinated: what goes down to them and what comes back up, off the step's path.

Down (write-through): every block the pool caches is copied to the host tier and written to the disk tier (each
where it is not yet), by a worker thread. The pool block is pinned (a reference) only until the worker has
gathered its bytes; the tier slots stay pinned, out of their index's lookups, until their copy is complete.
Every block is offered, not only those the pool evicts: an evicted block's memory is rewritten by the very step
that evicts it, and a write-through copy costs a memcpy per block computed, ~1% of computing it.

Up (loads): a request whose chain of block hashes continues past the pool's hits in a tier, or at a peer the
gateway named, is held out of the scheduler while a worker fills freshly allocated pool blocks from the tiers
(then from the peer, over ZeroMQ, in bounded chunks under a deadline). Filled blocks join the pool's prefix cache
pinned, with the request's leading pool hits, until the request starts: the scheduler then finds them as cached,
counts them as such, and no step waits on a copy. A load that fails part-way keeps what arrived in order; the
rest is computed. A block that fails its checks is never served.

Peers read this executor's blocks through block_source(), on the transfer thread, pinning nothing: each copy is
checked against the block's generation afterwards (peer_source.py).

Threads: the engine thread alone touches the pool and the tiers' indexes (BlockPools); workers only move bytes
between slots the engine thread pinned. They report through futures the engine thread polls each step.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import torch

from executor.kv.block_pool import Block
from executor.kv.cache_manager import KVCacheManager
from executor.kv.tiers.admission import ReuseAdmission
from executor.kv.tiers.block_copies import BlockCopies
from executor.kv.tiers.fingerprint import KVFingerprint, tier_owner
from executor.kv.tiers.host_tier import HostTier
from executor.kv.tiers.peer_source import BlockSource
from executor.kv.tiers.tier_counters import TierCounters
from executor.request import Request, RequestStatus
from shared.cache_sources import loaded_tokens

log = logging.getLogger("kvserve.engine.tiers")

# blocks pinned for loads (in flight, or waiting for their request to start) are at most this share of the pool:
# the rest stays for running requests, which must never starve for blocks behind a waiting one
MAX_PINNED_SHARE = 0.5
WORKERS = 2  # one may wait on a peer's network while the other copies


@dataclass(slots=True)
class _Offload:
    blocks: list[Block]  # pool blocks, pinned until gathered
    hashes: list[bytes]
    owners: list  # each block's tier owner (fingerprint.tier_owner)
    targets: list[list[tuple[object, Block]]]  # per block: (tier, slot) it goes to, each slot pinned
    gathered: bool = False  # set by the worker once the pool blocks' bytes are copied out
    future: Future | None = None


@dataclass(slots=True)
class _Load:
    request: Request
    prefix: list[Block]  # the request's leading pool hits, pinned so that no allocation breaks the chain
    blocks: list[Block]  # pool blocks the load fills, in chain order
    hashes: list[bytes]
    sources: list[tuple[object, Block]]  # the local ones: (tier, slot), pinned; the rest come from the peer
    peer: object | None  # shared.protocol.KVPeer
    started: float = field(default_factory=time.monotonic)
    future: Future | None = None
    cancelled: bool = False


class KVTiers:
    def __init__(
        self,
        kv: KVCacheManager,
        kv_cache: torch.Tensor,
        fingerprint: KVFingerprint,
        host: HostTier | None = None,
        disk=None,  # executor.kv.tiers.disk_tier.DiskTier
        puller=None,  # executor.kv.tiers.peer_puller.KVPuller
        pull_timeout: float = 5.0,
        admission: ReuseAdmission | None = None,  # None: recency, every cached block offered (admission.py)
    ) -> None:
        self.kv, self.pool = kv, kv.pool
        self.admission = admission
        if admission is not None:
            kv.prefix_hit = admission.prefix_hit
        self.copies = BlockCopies(kv_cache)
        self.dtype = kv_cache.dtype
        self.block_size = kv.block_size
        self.fingerprint = fingerprint
        self.tiers = [t for t in (host, disk) if t is not None]
        self.host, self.disk, self.puller = host, disk, puller
        self.pull_timeout = pull_timeout
        self._pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="kvserve-kv-tiers")
        self._offloads: list[_Offload] = []
        self._loads: dict[str, _Load] = {}  # by request id: in flight
        self._pinned: dict[str, _Load] = {}  # by request id: loaded, held until their request starts
        self._num_pinned = 0  # pool blocks pinned for loads
        # every pin on a pool block (loads, copies down): a tenant whose blocks are held by pins
        # alone has nothing running, and may evict as a tenant holding none may (KVCacheManager.may_evict_others)
        self._pins: dict[Block, int] = {}
        kv.held_by_pins = self._held_by_pins
        self.block_bytes = self.copies.block_bytes
        self.counters = TierCounters()

    # -- down -------------------------------------------------------------------------------------

    def offload(self, hashes: list[bytes]) -> None:
        """Copy blocks the pool has just cached down to every tier that lacks them (a step's newly cached hashes)."""
        if not self.tiers:
            return
        if self.admission is not None:
            hashes = self.admission.admit(hashes)
        job = _Offload([], [], [], [])
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                continue
            owner = tier_owner(block.owner)
            targets = []
            for tier in self.tiers:
                slot = tier.index.lookup(block_hash)
                if slot is not None:
                    continue  # there already (it came from there, or was offloaded before)
                if tier.index.num_allocatable(owner) < 1:
                    continue  # every slot is pinned by copies in flight
                targets.append((tier, tier.index.allocate(1, owner)[0]))
            if targets:
                job.blocks.append(block)
                job.hashes.append(block_hash)
                job.owners.append(owner)
                job.targets.append(targets)
        if not job.blocks:
            return
        self._pin_blocks(job.blocks)
        job.future = self._pool.submit(self._write_down, job)
        self._offloads.append(job)

    def _write_down(self, job: _Offload) -> None:
        """Worker: gather the blocks' bytes out of the pool, then write each into its tier slots."""
        payloads = self.copies.gather([b.block_id for b in job.blocks])
        job.gathered = True
        for payload, block_hash, owner, targets in zip(
            payloads, job.hashes, job.owners, job.targets, strict=True
        ):
            for tier, slot in targets:
                if tier is self.host:
                    tier.write(slot.block_id, payload)
                else:
                    tier.write(slot.block_id, block_hash, owner, payload)

    def _settle_offloads(self) -> None:
        still = []
        for job in self._offloads:
            if job.gathered and job.blocks:
                self._unpin_blocks(job.blocks)
                job.blocks = []
            if not job.future.done():
                still.append(job)
                continue
            error = job.future.exception()
            if error is not None:
                log.error("copying KV blocks down to the tiers failed: %r", error)
            if job.blocks:  # failed before gathering
                self._unpin_blocks(job.blocks)
            for block_hash, targets in zip(job.hashes, job.targets, strict=True):
                for tier, slot in targets:
                    if error is None:
                        tier.index.cache(slot, block_hash)
                        self.counters.offloaded_bytes[tier.name] += self.block_bytes
                    tier.index.free([slot])
        self._offloads = still

    # -- up ---------------------------------------------------------------------------------------

    def start_load(self, request: Request) -> bool:
        """Start loading the request's blocks that the tiers or its peer hold past the pool's hits; True when it
        is held for that (poll() hands it back), False when there is nothing to load (it goes to the scheduler)."""
        if not self.pool.enable_caching or request.request_id in self._loads:
            return False
        if not self.tiers and (request.kv_peer is None or self.puller is None):
            return False  # nothing could load (an executor without tiers): no walk of the chain for it
        hashes = self.kv.cacheable_hashes(request)
        prefix = []
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            prefix.append(block)
        sources = []
        for block_hash in hashes[len(prefix) :]:
            found = self.find(block_hash)
            if found is None:
                break
            sources.append(found)
        peer = request.kv_peer if self.puller is not None else None
        num_wanted = len(sources)
        if peer is not None and peer.num_blocks > len(prefix) + len(sources):
            num_wanted = min(peer.num_blocks, len(hashes)) - len(prefix)
        else:
            peer = None
        room = self.pool.num_allocatable(request.tenant, self.kv.may_evict_others(request))
        room -= sum(1 for b in prefix if b.ref_count == 0)  # pinning them takes them out of the free blocks
        cap = int(self.pool.num_blocks * MAX_PINNED_SHARE) - self._num_pinned - len(prefix)
        num = min(num_wanted, room, cap)
        if num < 1:
            return False
        sources = sources[:num]
        if len(sources) == num:
            peer = None
        evict_others = self.kv.may_evict_others(request)
        self._pin_blocks(prefix)
        blocks = self.pool.allocate(num, request.tenant, evict_others)
        for block in blocks:
            self._pins[block] = 1
        for tier, slot in sources:
            tier.index.touch([slot])  # pinned for the copy, and a hit: reused blocks outlive one-off ones
        self._num_pinned += len(prefix) + num
        load = _Load(request, prefix, blocks, hashes[len(prefix) : len(prefix) + num], sources, peer)
        load.future = self._pool.submit(self._load_up, load)
        self._loads[request.request_id] = load
        return True

    def _load_up(self, load: _Load) -> int:
        """Worker: fill the load's pool blocks in chain order; how many were filled before the first failure."""
        done = 0
        for (tier, slot), block, block_hash in zip(load.sources, load.blocks, load.hashes, strict=False):
            payload = self.read_slot(tier, slot, block_hash)
            if payload is None:  # a disk file that failed its checks: never served
                break
            self.copies.write(block.block_id, payload)
            done += 1
        if load.peer is not None and done == len(load.sources) and not load.cancelled:
            deadline = time.monotonic() + self.pull_timeout
            blocks = load.blocks[done:]
            done += self.puller.pull(
                load.peer.address,
                load.hashes[done:],
                self.fingerprint.digest(),
                deadline,
                lambda i, payload: self.copies.write(blocks[i].block_id, payload),
            )
        self.copies.done()
        return done

    def _settle_loads(self) -> list[Request]:
        """Loads that finished: their filled blocks join the prefix cache (pinned); the requests, to schedule."""
        ready = []
        for request_id, load in list(self._loads.items()):
            if not load.future.done():
                continue
            del self._loads[request_id]
            error = load.future.exception()
            if error is not None:
                log.error("loading KV blocks for request %s failed: %r", request_id, error)
            done = 0 if error is not None else load.future.result()
            for i, (tier, slot) in enumerate(load.sources):
                if i == done and tier is self.disk and error is None:
                    tier.index.discard(slot)  # its file failed its checks and is gone
                tier.index.free([slot])
            num_local = min(done, len(load.sources))
            for tier, _ in load.sources[:num_local]:
                load.request.cached_from[tier.name] = (
                    load.request.cached_from.get(tier.name, 0) + self.block_size
                )
                self.counters.loaded_bytes[tier.name] += self.block_bytes
            if load.peer is not None:
                counters, pulled = self.counters, done - num_local
                counters.pulls += 1
                counters.pulled_bytes += pulled * self.block_bytes
                counters.pulls_failed += pulled < len(load.blocks) - len(load.sources)
                counters.pull_seconds.append(time.monotonic() - load.started)
                if pulled:
                    load.request.cached_from["peer"] = pulled * self.block_size
            for block, block_hash in zip(load.blocks[:done], load.hashes[:done], strict=True):
                self.pool.cache(block, block_hash)  # a duplicate cached meanwhile keeps this one private
            self._unpin_blocks(load.blocks[done:])
            self._num_pinned -= len(load.blocks) - done
            load.blocks = load.blocks[:done]
            if load.cancelled:
                self._unpin(load)
                continue
            self._pinned[request_id] = load
            ready.append(load.request)
        return ready

    def release_started(self) -> None:
        """After a schedule: the pins of loaded requests that started (they hold their blocks themselves now)."""
        for request_id, load in list(self._pinned.items()):
            if load.request.status is RequestStatus.WAITING:
                continue
            del self._pinned[request_id]
            request = load.request
            if request.status is RequestStatus.RUNNING:
                # what of its loads the scheduler found (all of it, unless release_all let go of the pins)
                request.cached_from = loaded_tokens(request.num_cached_tokens, request.cached_from)
                for source, tokens in request.cached_from.items():
                    self.counters.cached_tokens[source] += tokens
            self._unpin(load)

    def release_all(self) -> bool:
        """Let go of every loaded request's pins (they stay cached, unpinned): when the pins alone keep the
        scheduler from starting anything. Whether there were any."""
        pinned, self._pinned = list(self._pinned.values()), {}
        for load in pinned:
            self._unpin(load)
        return bool(pinned)

    def _unpin(self, load: _Load) -> None:
        self._unpin_blocks(load.blocks + load.prefix)
        self._num_pinned -= len(load.blocks) + len(load.prefix)

    def _pin_blocks(self, blocks: list[Block]) -> None:
        """A reference on each pool block, counted as a pin."""
        self.pool.share(blocks)
        for block in blocks:
            self._pins[block] = self._pins.get(block, 0) + 1

    def _unpin_blocks(self, blocks: list[Block]) -> None:
        for block in blocks:
            if self._pins[block] == 1:
                del self._pins[block]
            else:
                self._pins[block] -= 1
        self.pool.free(blocks)

    def _held_by_pins(self, tenant) -> int:
        """The tenant's pool blocks that pins alone hold (no request references them)."""
        return sum(1 for block, n in self._pins.items() if block.owner == tenant and block.ref_count == n)

    def drop(self, request: Request) -> None:
        """The request ended (aborted) while loading or before it started: let go of what its load holds."""
        load = self._loads.get(request.request_id)
        if load is not None:
            load.cancelled = True  # the worker finishes its copies into blocks still pinned; settled then
            return
        load = self._pinned.pop(request.request_id, None)
        if load is not None:
            self._unpin(load)

    # -- the engine's hooks -------------------------------------------------------------------------

    def poll(self) -> list[Request]:
        """Settle what the workers finished; the requests now loaded."""
        self._settle_offloads()
        return self._settle_loads()

    @property
    def in_flight(self) -> int:
        """Loads, and copies down whose pool blocks are still pinned: a step that can start nothing may be
        waiting for either to give blocks back."""
        return len(self._loads) + sum(1 for job in self._offloads if job.blocks)

    def holds(self, request_id: str) -> bool:
        return request_id in self._loads

    def held_requests(self) -> list[Request]:
        return [load.request for load in self._loads.values()]

    def wait(self, timeout_s: float) -> None:
        """Block until a load or a copy down finishes, or timeout_s (nothing else to do meanwhile)."""
        futures = [load.future for load in self._loads.values()]
        futures += [job.future for job in self._offloads if job.blocks]
        if futures:
            wait(futures, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def drain_events(self) -> dict[str, tuple[list[bytes], list[bytes]]]:
        return {tier.name: tier.index.drain_events() for tier in self.tiers}

    def tier_hashes(self) -> dict[str, list[bytes]]:
        return {tier.name: tier.index.cached_hashes() for tier in self.tiers}

    def stats(self) -> dict[str, int]:
        """EngineStats' tier fields, by name."""
        return self.counters.snapshot(self.tiers, self.disk.rejected if self.disk is not None else 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=False)
        if self.puller is not None:
            self.puller.close()

    # -- serving peers ------------------------------------------------------------------------------

    def block_source(self) -> BlockSource:
        return BlockSource(self)

    def find(self, block_hash: bytes) -> tuple[object, Block] | None:
        """The nearest tier holding the block, and its slot."""
        for tier in self.tiers:
            slot = tier.index.lookup(block_hash)
            if slot is not None:
                return tier, slot
        return None

    def read_slot(self, tier, slot: Block, block_hash: bytes) -> torch.Tensor | None:
        """A pinned slot's payload; None for a disk file that failed its checks (and is gone)."""
        return tier.read(slot.block_id) if tier is self.host else tier.read(slot.block_id, block_hash)
