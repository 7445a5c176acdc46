"""Serving many requests with one model: the scheduler (continuous batching) and its budgets."""
