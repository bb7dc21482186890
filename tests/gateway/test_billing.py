import asyncio
from types import SimpleNamespace

from gateway.serving.billing import Billing


class Tenancy:
    def __init__(self) -> None:
        self.released = []

    async def release(self, *args, **kwargs) -> None:
        self.released.append((args, kwargs))


class Metrics:
    def count_usage(self, *args) -> None:
        pass


def test_settling_bills_the_first_choices_cached_tokens_with_where_their_kv_came_from_and_its_adapter():
    tenancy = Tenancy()
    client = SimpleNamespace(owed_kv_block_seconds=lambda request_id: None)
    billing = Billing(tenancy, Metrics(), client, dispatch=None)
    choices = [SimpleNamespace(cached_from={"host": 32, "peer": 16}), SimpleNamespace(cached_from={})]
    flight = SimpleNamespace(
        caller=SimpleNamespace(tenant=SimpleNamespace(name="acme")),
        request=SimpleNamespace(request_id="r1", lora="sql"),
        reserved_tokens=300,
        delivered=SimpleNamespace(generations=choices, kv_block_seconds=2.0),
    )
    asyncio.run(billing.settle(flight, (100, 20, 64)))
    [(args, kwargs)] = tenancy.released
    assert args == (flight.caller, "r1", 300, 100, 20, 64)
    assert kwargs == {"kv_block_seconds": 2.0, "cached_from": {"host": 32, "peer": 16}, "adapter": "sql"}
