"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter, in vLLM's shape, for operators only.

Served only with --allow-runtime-lora-updating (as vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING), and then only to an
operator's key (`kvserve keys create|update --operator`; an open gateway, which has no keys, lets its one
anonymous caller). The gateway holds no adapter itself: it writes the run-time registry in Redis
(shared.redis_keys.LORA_ADAPTERS, name -> {"path": ...}), which every executor with --enable-lora reads at its
heartbeat, then waits a few seconds for the live LoRA executors to say what they made of it in their
registrations: the name in lora_adapters (served: 200), in lora_refused from this path (400 with their error, and
the entry is taken back so a fixed adapter may be loaded under the name; a refusal of another path, not yet
replaced, is not this load's), or neither in time (504; the entry stays, and
executors serve it when they get to it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable

import redis
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from gateway.api_error import EXECUTOR_HEADER, NO_EXECUTOR, APIError, error_response, invalid_request
from gateway.openai.body import check_content_type, read_body, read_json_body
from gateway.routing.index_reader import ExecutorInfo, IndexReader
from gateway.tenants.tenancy import Caller, Tenancy
from shared import redis_keys
from shared.adapter_names import MAX_RUNTIME_ADAPTERS, check_adapter_name

MAX_PATH_BYTES = 4096  # Linux's PATH_MAX
UPDATE_WAIT_S = 5.0  # the executors read the registry every heartbeat (1 s) and digest the files once
_POLL_S = 0.1
_BODY_TIMEOUT_S = 10.0

# KEYS[1]: the registry. ARGV: name, its entry, the bound. A name held with another entry is not replaced (unload
# it first, as vLLM); the same entry again is a retry of a load that timed out.
_REGISTER = """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if held then
  if held == ARGV[2] then return 'same' end
  return 'other'
end
if redis.call('HLEN', KEYS[1]) >= tonumber(ARGV[3]) then return 'full' end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 'added'
"""
# KEYS[1]: the registry. ARGV: name, the entry to take back only if it is still this one.
_TAKE_BACK = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


def _lora_path(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise invalid_request(
            "lora_path is required: the adapter's PEFT directory, an absolute path", "lora_path"
        )
    if len(value.encode()) > MAX_PATH_BYTES or "\x00" in value or not value.startswith("/"):
        raise invalid_request(
            f"lora_path: {value!r} must be an absolute path of at most {MAX_PATH_BYTES} bytes", "lora_path"
        )
    return value


def _read_fields(body: dict, allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(body) - set(allowed))
    if unknown:
        raise invalid_request(
            f"unknown field(s) {', '.join(unknown)}: expected {', '.join(allowed)}", unknown[0]
        )
    try:
        check_adapter_name(body.get("lora_name"))
    except ValueError as error:
        raise invalid_request(str(error), "lora_name") from None


def _not_answered(verb: str, name: str, waiting: list[str]) -> APIError:
    if not waiting:
        return APIError(
            503, f"no live executor serves LoRA adapters (--enable-lora) to {verb} {name!r}", "server_error"
        )
    return APIError(
        504,
        f"{verb} {name!r}: executor(s) {', '.join(sorted(waiting))} did not answer within {UPDATE_WAIT_S:g} s; "
        "the registry keeps the change and they apply it when they get to it",
        "server_error",
    )


class LoRAUpdates:
    def __init__(
        self, index: IndexReader, tenancy: Tenancy, allowed: bool, wait_s: float = UPDATE_WAIT_S
    ) -> None:
        """allowed: --allow-runtime-lora-updating."""
        self.index = index
        self.tenancy = tenancy
        self.allowed = allowed
        self.wait_s = wait_s
        self._register = index.redis.register_script(_REGISTER)
        self._take_back = index.redis.register_script(_TAKE_BACK)

    async def load(self, request: Request) -> Response:
        return await _answer(self._load(request), "added")

    async def unload(self, request: Request) -> Response:
        return await _answer(self._unload(request), "removed")

    async def _load(self, request: Request) -> str:
        """Register the adapter and wait for the executors; its name."""
        body = await self._body(request)
        _read_fields(body, ("lora_name", "lora_path"))
        name, path = body["lora_name"], _lora_path(body.get("lora_path"))
        entry = json.dumps({"path": path})
        if await self._served_from_start(name):
            outcome = "other"
        else:
            args = [name, entry, MAX_RUNTIME_ADAPTERS]
            outcome = (await self._register(keys=[redis_keys.LORA_ADAPTERS], args=args)).decode()
        if outcome == "other":
            raise invalid_request(
                f"The lora adapter {name!r} has already been loaded; unload it first", "lora_name"
            )
        if outcome == "full":
            raise invalid_request(
                f"{MAX_RUNTIME_ADAPTERS} adapters are loaded at run time, the most there may be; unload one first",
                "lora_name",
            )
        await self._wait(name, served=True, entry=entry, path=path)
        return name

    async def _unload(self, request: Request) -> str:
        """Take the adapter out of the registry and wait for the executors; its name."""
        body = await self._body(request)
        _read_fields(body, ("lora_name",))
        name = body["lora_name"]
        if not await self.index.redis.hdel(redis_keys.LORA_ADAPTERS, name):
            raise APIError(
                404,
                f"The lora adapter {name!r} cannot be found among those loaded at run time",
                "not_found_error",
                "lora_name",
            )
        await self._wait(name, served=False)
        return name

    async def _body(self, request: Request) -> dict:
        """The operator's body, once the caller is known to be one."""
        if not self.allowed:
            raise APIError(
                404,
                f"POST {request.url.path} is not served here: start the gateway with --allow-runtime-lora-updating",
                "not_found_error",
            )
        caller: Caller = await self.tenancy.identify(request.headers)
        if caller.record is not None and not caller.record.operator:
            raise APIError(
                403,
                "this API key may not load or unload LoRA adapters; an operator's key may "
                "(`kvserve keys update KEY_ID --operator`)",
                "permission_error",
            )
        check_content_type(request.headers.get("content-type"))
        return read_json_body(await read_body(request, _BODY_TIMEOUT_S))

    async def _served_from_start(self, name: str) -> bool:
        """Whether a live executor serves the name from its --lora-modules: served, and not from the registry."""
        if await self.index.redis.hexists(redis_keys.LORA_ADAPTERS, name):
            return False
        return any(name in info.lora_adapters for info in await self._lora_executors())

    async def _lora_executors(self) -> list[ExecutorInfo]:
        return [info for info in await self.index.live_executors() if info.lora]

    async def _wait(self, name: str, served: bool, entry: str | None = None, path: str | None = None) -> None:
        """Until every live LoRA executor shows the change (served: the name in its lora_adapters; else not), one
        refuses it from path (400, the entry taken back), or the wait ends (504; 503 when no LoRA executor
        lives)."""
        deadline = time.monotonic() + self.wait_s
        while True:
            executors = await self._lora_executors()
            refusals = {  # of this path: one of another is the name's earlier entry, not yet replaced
                info.executor_id: refusal[1]
                for info in executors
                if (refusal := info.lora_refused.get(name)) is not None and refusal[0] == path
            }
            if served and refusals:
                await self._take_back(keys=[redis_keys.LORA_ADAPTERS], args=[name, entry])
                executor_id, why = sorted(refusals.items())[0]
                raise invalid_request(
                    f"executor {executor_id} refused the lora adapter {name!r}: {why}", "lora_path"
                )
            waiting = [info.executor_id for info in executors if (name in info.lora_adapters) != served]
            if not waiting and (
                executors or not served
            ):  # an unload with no LoRA executor has nothing to wait for
                return
            if time.monotonic() >= deadline:
                raise _not_answered("load" if served else "unload", name, waiting)
            await asyncio.sleep(_POLL_S)


def _registry_unreachable(error: Exception) -> APIError:
    return APIError(503, f"the adapter registry (Redis) is unreachable: {error}", "server_error")


def _success(text: str) -> Response:
    return PlainTextResponse(text, headers={EXECUTOR_HEADER: NO_EXECUTOR})


async def _answer(change: Awaitable[str], done: str) -> Response:
    """vLLM's success text once the change (it returns the adapter's name) is through, else its error."""
    try:
        name = await change
    except APIError as error:
        return error_response(error, "")
    except redis.RedisError as error:
        return error_response(_registry_unreachable(error), "")
    return _success(f"Success: LoRA adapter '{name}' {done} successfully.")
