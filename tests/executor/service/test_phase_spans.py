from executor.request import Request
from executor.service import phase_spans
from shared.sampling_params import SamplingParams


def test_a_traced_requests_spans_carry_its_cached_tokens_by_source(monkeypatch):
    recorded = {}

    def record_span(name, parent, start_ns, end_ns, attributes, error=None):
        recorded[name] = attributes
        return parent

    monkeypatch.setattr(phase_spans.tracing, "record_span", record_span)
    r = Request("r1", list(range(160)), SamplingParams(max_tokens=4))
    r.num_cached_tokens, r.cached_from = 128, {"host": 16, "disk": 32}
    r.first_scheduled_ns = r.arrival_ns + 1
    phase_spans.record_request_spans(r, object(), "executor-1", "stop")
    by_source = {
        "kvserve.cached_tokens": 128,
        "kvserve.cached_tokens.pool": 80,
        "kvserve.cached_tokens.host": 16,
        "kvserve.cached_tokens.disk": 32,
        "kvserve.cached_tokens.peer": 0,
    }
    assert recorded["executor.request"].items() >= by_source.items()
    assert recorded["executor.prefill"] == {"gen_ai.usage.input_tokens": 160, **by_source}
