"""One server-sent event's bytes, as every streaming response and mid-stream error writes them."""

from __future__ import annotations

import json

# JSON may hold these raw, but line readers that follow str.splitlines (httpx's aiter_lines, so GuideLLM and many
# SDK-less clients) end a line at each: a token's text carrying one cut its event in two. Escaped, the event is one
# line and decodes to the same text.
_LINE_BREAKS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse_data(payload: object) -> str:
    text = json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    if not text.isascii():
        text = text.translate(_LINE_BREAKS)
    return f"data: {text}\n\n"
