"""Session ownership, Idempotency-Key and tenants, through real `agent-runner serve` processes."""
