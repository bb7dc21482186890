"""The process around the app: the HTTP server that drains on SIGTERM, the exit deadline that follows, and the
last-resort handler that turns an escaped exception into a 500 in OpenAI's shape."""
