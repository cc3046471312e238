"""What sglang-router calls on the servers behind it, beyond the OpenAI API."""
