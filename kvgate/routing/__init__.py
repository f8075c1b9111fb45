"""Routing: which pool a request belongs to, and which replicas of it to try, in order."""
