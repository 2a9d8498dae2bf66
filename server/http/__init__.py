"""`batchsim serve`: the OpenAI-compatible HTTP server on the engine."""
