"""A request's prompt as token ids: the tokenizer, the chat template that renders messages, and the worker threads
that do both for large bodies off the event loop."""
