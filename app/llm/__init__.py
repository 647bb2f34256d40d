"""Model clients: the LLMClient protocol, the Anthropic adapter and scripted offline models."""
