"""Benchmarks: scripts that time on the hardware at hand and save JSON (device, command, date)."""
