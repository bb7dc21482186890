"""EngineBusy, apart from the engine so that the service loop can catch it without importing torch."""


class EngineBusy(Exception):
    """A request refused for now, not for what it is: another executor (or this one, later) can take it."""
