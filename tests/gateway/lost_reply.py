"""A Redis connection that loses one reply on demand: the command ran, its answer never came, and the gateway's
client (gateway.routing.index_reader.connect) retries it on a fresh connection."""

from __future__ import annotations

import redis
import redis.asyncio as aioredis


class LosesAReply(aioredis.Connection):
    armed = False  # the next reply read is lost, after Redis ran its command

    async def read_response(self, *args, **kwargs):
        response = await super().read_response(*args, **kwargs)
        if LosesAReply.armed:
            LosesAReply.armed = False
            await self.disconnect()
            raise redis.ConnectionError("the reply was lost")
        return response


def losing_replies(client: aioredis.Redis) -> aioredis.Redis:
    """The gateway's client (not yet connected), its connections made to lose a reply whenever LosesAReply.armed
    is set."""
    client.connection_pool.connection_class = LosesAReply
    return client
