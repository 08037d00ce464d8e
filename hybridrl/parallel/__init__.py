"""Distributed and parallel code: process groups, FSDP2, precision, the memory estimator,
weight-sync bucketing and transports."""
