"""Tests of the pure core (``pacing/``): the limiter, the policy, the settings."""
