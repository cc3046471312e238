"""The APIs the gateway speaks: per API, an adapter (its requests read into the gateway's
one request), a formatter (its answers, whole and streamed) and its routes."""
