"""Tests of pdcache.bench: every benchmark and the replay."""
