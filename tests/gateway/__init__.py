"""The HTTP gateway as real processes, with the official OpenAI, Anthropic and agents clients."""
