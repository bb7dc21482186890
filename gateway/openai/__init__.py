"""The OpenAI protocol: request bodies checked into one plain request, and responses (whole or as server-sent events),
logprobs, tool calls and output text back in its shapes."""
