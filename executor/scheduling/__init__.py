"""The scheduler and the order requests wait in: who runs each step, by fair share among tenants."""
