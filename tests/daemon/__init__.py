"""The cache daemon as a real process over gRPC: answers, auth, tenants, quotas, pieces,
counters, ownership."""
