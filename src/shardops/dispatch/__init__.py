"""Dispatch: schema parsing, strategy rows, the registry, cost-based choice, the cache."""
