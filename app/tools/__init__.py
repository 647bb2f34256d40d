"""Tools the model can call: definitions, the registry loaded from AGENTS_FILE, and executors."""
