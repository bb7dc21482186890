"""The completion endpoints, one module each: what a /v1/chat/completions, /v1/completions or /v1/responses body
means and how each is answered. The steps every request goes through whichever endpoint it came to (admission,
routing, streaming, billing) are gateway.serving's."""
