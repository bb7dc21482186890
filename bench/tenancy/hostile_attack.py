"""Alpha's side of bench/tenancy/hostile_inputs.py: an attack's bodies, each on a connection of its own, sent
from a process of its own and cut at the attack's deadline, and what each answer was."""

from __future__ import annotations

import asyncio
import itertools
import time

import httpx

from bench.tenancy.hostile_bodies import CHAT, Attack
from bench.tenancy.hostile_report import Exchange

ERROR_EVENT = b'data: {"error"'  # how the gateway reports a refusal after a stream began


async def send_body(client: httpx.AsyncClient, raw: bytes, exchange: Exchange) -> None:
    """POST one attacker body and read the whole answer, noting its status and any error event as it comes."""
    headers = {"content-type": "application/json"}
    async with client.stream("POST", CHAT, content=raw, headers=headers) as response:
        exchange.status = response.status_code
        tail = b""
        async for chunk in response.aiter_bytes():  # not parsed: the answer may be ~100 MB of logprobs
            exchange.bytes_received += len(chunk)
            window = tail + chunk
            exchange.error_event |= ERROR_EVENT in window
            tail = window[-len(ERROR_EVENT) :]
    exchange.finished = True


async def run_attack(
    attack: Attack, url: str, alpha_key: str, started: float, deadline: float
) -> list[Exchange]:
    """Every body on its own connection, sent attack.sends times one after the other and again while
    attack.repeat_s lasts, each cut at the deadline."""
    headers = {"authorization": f"Bearer {alpha_key}"} if attack.keyed else {}
    limits = httpx.Limits(max_connections=len(attack.bodies))
    exchanges: list[Exchange] = []
    timeout = httpx.Timeout(deadline - time.monotonic() + 5)  # the deadline below cuts first
    async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as client:

        async def connection(raw: bytes) -> None:
            for sends in itertools.count(1):
                exchange = Exchange()
                exchanges.append(exchange)
                sent = time.monotonic()
                try:
                    await asyncio.wait_for(send_body(client, raw, exchange), max(deadline - sent, 0.001))
                except TimeoutError:
                    pass  # exchange.finished stays False
                except httpx.HTTPError as error:
                    exchange.error = f"{type(error).__name__}: {error}"
                exchange.seconds = time.monotonic() - sent
                now = time.monotonic()
                again = sends < attack.sends or now < started + attack.repeat_s
                if not (again and now < deadline):
                    return

        await asyncio.gather(*(connection(raw) for raw in attack.bodies))
    return exchanges


def attack_in_process(
    attack: Attack, url: str, alpha_key: str, started: float, deadline: float
) -> list[Exchange]:
    """run_attack in a process of its own: a flood's client work (sending gigabytes) would otherwise slow the
    victim's stream in this process's event loop and be counted as the server's doing. time.monotonic is the
    same clock in every process."""
    return asyncio.run(run_attack(attack, url, alpha_key, started, deadline))
