"""What the gateway knows of the executors, read fresh from Redis for each request (the gateway keeps none)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.routing import Candidate, leading_run
from shared import redis_keys


@dataclass(slots=True)
class ExecutorInfo:
    executor_id: str
    address: str
    model: str
    block_size: int
    max_model_len: int


class ExecutorDirectory:
    def __init__(self, redis_url: str) -> None:
        self.redis = aioredis.from_url(redis_url)

    async def close(self) -> None:
        await self.redis.aclose()

    async def live_executors(self) -> list[ExecutorInfo]:
        """Registered executors whose heartbeat-bound info hash still exists."""
        ids = sorted(m.decode() for m in await self.redis.smembers(redis_keys.EXECUTORS))
        if not ids:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for executor_id in ids:
                pipe.hgetall(redis_keys.executor_key(executor_id))
            infos = await pipe.execute()
        live = []
        for executor_id, info in zip(ids, infos, strict=True):
            if not info:
                continue  # its heartbeat expired
            info = {k.decode(): v.decode() for k, v in info.items()}
            live.append(
                ExecutorInfo(
                    executor_id,
                    info["address"],
                    info.get("model", ""),
                    int(info["block_size"]),
                    int(info["max_model_len"]),
                )
            )
        return live

    async def is_alive(self, executor_id: str) -> bool:
        return bool(await self.redis.exists(redis_keys.executor_key(executor_id)))

    async def next_round_robin(self) -> int:
        return int(await self.redis.incr(redis_keys.ROUND_ROBIN))

    async def candidates(
        self, executors: Sequence[ExecutorInfo], block_hashes: Sequence[bytes]
    ) -> list[Candidate]:
        """Each executor's cached leading run of the prompt's blocks and its load, in one round trip."""
        hexes = [h.hex() for h in block_hashes]
        async with self.redis.pipeline(transaction=False) as pipe:
            for e in executors:
                if hexes:
                    pipe.smismember(redis_keys.blocks_key(e.executor_id), hexes)
                pipe.hgetall(redis_keys.load_key(e.executor_id))
            replies = iter(await pipe.execute())
        out = []
        for e in executors:
            held = next(replies) if hexes else []
            load = {k.decode(): v.decode() for k, v in next(replies).items()}
            out.append(
                Candidate(
                    e.executor_id,
                    e.address,
                    cached_blocks=leading_run([bool(x) for x in held]),
                    running=int(load.get("running", 0)),
                    waiting=int(load.get("waiting", 0)),
                    kv_usage=float(load.get("kv_usage", 0.0)),
                )
            )
        return out
