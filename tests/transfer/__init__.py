"""Tests of pdcache.transfer: the P->D KV transfer (rooms, messages, engines, processes)."""
