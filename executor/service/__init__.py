"""What faces the gateways: the ZeroMQ service loop, its books per request, and the executor index in Redis."""
