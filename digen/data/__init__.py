"""Data files shipped with digen (the built-in prompt set)."""
