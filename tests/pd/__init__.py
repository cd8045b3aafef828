"""Tests of pdcache.prefill_node and pdcache.decode_node together: real HTTP, real KV transfer."""
