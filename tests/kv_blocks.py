"""What every engine test checks after its requests end: the KV blocks came back."""

from __future__ import annotations


def assert_no_blocks_held(llm) -> None:
    """No KV block in use, nothing running or waiting, and no request or group left in the engine's maps."""
    stats = llm.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0 and stats.waiting == 0
    assert not llm.engine.intake.requests and not llm.engine.intake.groups
