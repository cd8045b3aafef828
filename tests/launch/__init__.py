"""Tests of pdcache.launch: the supervisor and the renderers."""
