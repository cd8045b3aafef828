"""Tests of pdcache.wire: the HTTP vocabulary the servers and the router share (request models,
errors, the agent API's parsers and formatters), without a server."""
