"""Workloads as data: prompts, seeded arrivals and output lengths, and the runs of each table."""
