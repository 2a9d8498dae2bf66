"""What a run leaves: records, metrics summaries, JSON output."""
