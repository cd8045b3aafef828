"""Tests of pdcache.integrations: the SGLang storage plugin."""
