"""The steps every completion request goes through, whichever endpoint it came to (gateway.endpoints): admitted
against its caller's key and limits, its body read into a prompt, routed to an executor, the executor's updates
streamed back, its usage billed. pipeline.py runs them in order."""
