"""Tests of pdcache.decode_node."""
