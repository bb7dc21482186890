"""Who calls and what they may use: API keys (and their backups and CLI), per-key rate limits, and the tenancy
checks each request passes."""
