"""Tests of pdcache.server: the unified node's HTTP server around a real engine, and its CLI
(the shared vocabulary's own unit tests: tests/wire)."""
