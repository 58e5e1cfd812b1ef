"""Workloads as data: prompts, seeded arrivals and lengths (the seed tables' synthetic ones, or shaped like
production traffic from published statistics or a trace), and the runs of each table."""
