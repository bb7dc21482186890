"""Requests waiting for their LoRA adapter's weights, held outside the scheduler's queue while a worker reads
them from disk: a step never waits on an adapter's files, and other requests keep starting meanwhile.

The engine thread alone touches the held requests and the adapters' host-memory index (Adapters.keep); the
worker only reads files into new tensors. One load per adapter is in flight, however many requests wait for it.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from executor.lora.adapter_files import LoRAAdapter
from executor.lora.adapters import Adapters
from executor.request import Request


class AdapterLoads:
    def __init__(self, adapters: Adapters) -> None:
        self.adapters = adapters
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="kvserve-lora-load")
        self._loads: dict[str, Future] = {}  # adapter name -> its load
        self._held: dict[str, Request] = {}  # request id -> request, in arrival order

    def __len__(self) -> int:
        return len(self._held)

    @property
    def requests(self) -> list[Request]:
        return list(self._held.values())

    def holds(self, request_id: str) -> bool:
        return request_id in self._held

    def hold(self, request: Request) -> bool:
        """Whether the request must wait for its adapter (held until take_settled hands it back); one whose
        adapter host memory holds gets its weights now."""
        if request.lora is None or request.adapter is not None:
            return False
        adapter = self.adapters.held(request.lora)
        if adapter is not None:
            _give(request, adapter)
            return False
        name = request.lora.name
        if name not in self._loads:
            self._loads[name] = self._worker.submit(self.adapters.load, request.lora)
        self._held[request.request_id] = request
        return True

    def drop(self, request: Request) -> None:
        self._held.pop(request.request_id, None)

    def take_settled(self, in_use: set[str]) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """Requests whose adapter loaded (their weights given, the adapter kept in host memory), and those whose
        adapter failed to load, with the error."""
        done = {name: f for name, f in self._loads.items() if f.done()}
        for name, future in done.items():
            del self._loads[name]
            if future.exception() is None:
                self.adapters.keep(future.result(), in_use | {name})
        ready, failed = [], []
        for request_id, request in list(self._held.items()):
            future = done.get(request.lora.name)
            if future is None:
                continue
            del self._held[request_id]
            if future.exception() is not None:
                failed.append((request, future.exception()))
            else:
                _give(request, future.result())
                ready.append(request)
        return ready, failed

    def wait(self, timeout_s: float) -> None:
        if self._loads:
            wait(list(self._loads.values()), timeout=timeout_s, return_when=FIRST_COMPLETED)

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


def _give(request: Request, adapter: LoRAAdapter) -> None:
    for choice in [request, *request.forks]:
        choice.adapter = adapter
