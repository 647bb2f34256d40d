"""API models: request bodies and responses."""
