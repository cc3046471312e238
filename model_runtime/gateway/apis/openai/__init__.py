"""OpenAI's chat completions and completions."""
