"""The offline API, in vLLM's shape: LLM(...).generate(prompts, SamplingParams(...))."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from executor.engine import Engine
from executor.engine_config import EngineConfig
from executor.sampling.sampler import TokenLogprobs
from executor.step_result import EngineStats, StepOutput
from shared.sampling_params import SamplingParams
from shared.stop_strings import CompletionText


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    num_accepted_tokens: int = 0  # speculative decoding: proposals the target accepted for this request
    # SamplingParams(prompt_logprobs=k): one entry per prompt token, the first None (nothing precedes it)
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class _Tracked:
    """One request's output as it grows: each choice's tokens, text, and stop-string state."""

    output: RequestOutput
    params: SamplingParams
    texts: list[CompletionText]  # by choice


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.engine = Engine(EngineConfig(model=model, **engine_args))
        self._ids = itertools.count()
        self._tracked: dict[str, _Tracked] = {}

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora: str | Sequence[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, batched together; outputs in prompt order. lora: the adapter (by its
        --lora-modules name) every prompt runs under, or one per prompt (None: the base model)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"sampling_params: {len(sampling_params)} given for {len(prompts)} prompts")
        loras = [lora] * len(prompts) if lora is None or isinstance(lora, str) else list(lora)
        if len(loras) != len(prompts):
            raise ValueError(f"lora: {len(loras)} given for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params, adapter in zip(prompts, sampling_params, loras, strict=True):
                ids.append(self.add_request(prompt, params, lora=adapter))
        except ValueError:
            for request_id in ids:
                self.abort(request_id)
            raise
        results: dict[str, RequestOutput] = {}
        pending = set(ids)
        while pending:
            for out in self.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
        return [results[i] for i in ids]

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        lora: str | None = None,
    ) -> str:
        request_id = request_id if request_id is not None else str(next(self._ids))
        token_prompt = list(prompt) if not isinstance(prompt, str) else prompt
        if isinstance(params, SamplingParams) and params.structured_outputs is not None:
            # offline, waiting for the grammar costs nothing: a bad one (or one past its deadline, which the
            # cache does not keep) raises its ValueError here, a fault of the compiler its RuntimeError
            error = self.engine.compile_grammar(params.structured_outputs).exception()
            if (
                error is not None
            ):  # a new one each time: the cached one's traceback would grow with every raise
                raise (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error)) from None
        if (
            lora is not None
        ):  # likewise an adapter's weights: a bad one raises its AdapterError (a ValueError) here
            self.engine.load_adapter(lora)
        request = self.engine.add_request(request_id, token_prompt, params, lora=lora)[0]
        output = RequestOutput(
            request_id,
            prompt if isinstance(prompt, str) else None,
            request.prompt_token_ids,
            [CompletionOutput(i, "", []) for i in range(params.n)],
        )
        texts = [
            CompletionText(self.tokenizer, request.prompt_token_ids, params.stop) for _ in range(params.n)
        ]
        self._tracked[request_id] = _Tracked(output, params, texts)
        return request_id

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._tracked.pop(request_id, None)

    def step(self) -> list[RequestOutput]:
        """One engine step; the outputs of the requests it advanced."""
        updated = []
        for step_out in self.engine.step().outputs:
            tracked = self._tracked.get(step_out.request_id)
            if tracked is not None:
                self._apply(tracked, step_out)
                updated.append(tracked.output)
        return updated

    def _apply(self, tracked: _Tracked, step_out: StepOutput) -> None:
        if step_out.error is not None:  # add_request compiled its grammar first, so this is not expected
            raise RuntimeError(f"request {step_out.request_id}: {step_out.error}")
        output, completion = tracked.output, tracked.output.outputs[step_out.index]
        text = tracked.texts[step_out.index]
        output.num_cached_tokens = step_out.num_cached_tokens
        output.num_accepted_tokens = step_out.num_accepted_tokens
        if step_out.prompt_logprobs is not None:
            output.prompt_logprobs = [None, *step_out.prompt_logprobs]
        token_ids, reason = step_out.new_token_ids, step_out.finish_reason
        kept = text.add(token_ids, finished=reason is not None)
        completion.token_ids.extend(token_ids[:kept])
        if tracked.params.logprobs is not None:
            completion.logprobs = completion.logprobs or []
            completion.logprobs.extend(step_out.new_logprobs[:kept])
        completion.text = text.text
        if text.stopped:
            completion.stop_reason = text.stop_reason
            reason = "stop"
            if step_out.finish_reason is None:
                self.engine.abort(output.request_id, step_out.index)
        elif reason == "stop" and token_ids and token_ids[-1] in tracked.params.stop_token_ids:
            completion.stop_reason = token_ids[-1]  # EOS leaves it None, as in vLLM
        if reason is not None:
            completion.finish_reason = reason
        if all(c.finish_reason is not None for c in output.outputs):
            output.finished = True
            self._tracked.pop(output.request_id, None)
