"""Fixtures and settings shared by the platform tests (the live platform itself is fireflyer.testing.live_platform)."""
