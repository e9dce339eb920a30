"""remote layer."""
