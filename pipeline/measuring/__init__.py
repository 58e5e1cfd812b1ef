"""Timed runs and what is measured around them: the engine against Hugging Face generate, replays, servers under
load, the machine, accuracy and equivalence checks."""
