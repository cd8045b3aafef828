"""Tests of pdcache.prefill_node."""
