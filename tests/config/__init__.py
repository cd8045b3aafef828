"""Tests of pdcache.config: the topology schema and the node setup."""
