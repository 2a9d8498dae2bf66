"""The HTTP load generator: send a workload to an OpenAI-compatible server and time it
client-side."""
