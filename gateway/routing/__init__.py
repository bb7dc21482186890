"""Where a request goes and how it gets there: the executor index in Redis, the cost model and router, the backlog
that holds requests while every executor is full, the ZeroMQ client (and the usage aborted requests still owe), an
admitted request's state while it is served (in_flight.py), and the dispatch that reroutes it on loss."""
