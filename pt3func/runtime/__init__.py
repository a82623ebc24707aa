"""Running compiled programs."""
