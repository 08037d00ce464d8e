"""Mixture-of-experts training: routing record and replay, load balancing, routing health
(docs/moe.md)."""
