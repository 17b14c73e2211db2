"""HTTP surface of the coordinator: OpenAI-compatible API, cluster views, dashboard, metrics."""
