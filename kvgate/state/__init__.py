"""Shared state: one interface, an in-memory implementation and a Redis one."""
