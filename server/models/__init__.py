"""Model shapes (the zoo), loading through mlx-lm, building seeded-random model directories."""
