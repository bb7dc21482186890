"""What faces the gateways: the ZeroMQ service loop, their authentication, liveness and outbox, and the executor index in Redis."""
