"""What runs a step plan: the MLX executor and its KV pool, the simulator, a fake."""
