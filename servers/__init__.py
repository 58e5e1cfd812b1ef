"""One OpenAI-compatible app (servers.app.create_app) over the engine; the policy is a config choice."""
