"""Tests of pdcache.server: the unified node's HTTP server, protocol and CLI."""
