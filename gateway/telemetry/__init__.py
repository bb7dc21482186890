"""What the gateway reports: Prometheus metrics (on their own listener if asked) and each request's trace span."""
