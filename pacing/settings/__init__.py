"""The pacing settings: their model, flags, checks, command line and store."""
