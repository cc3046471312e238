"""OpenAI's Responses API, with stored responses."""
