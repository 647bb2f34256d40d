"""agent-runner: durable LLM agents over REST with at-most-once tool execution."""
