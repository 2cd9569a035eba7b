"""Test helpers shared by the test files (not tests themselves)."""
