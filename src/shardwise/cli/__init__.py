"""The ``shardwise`` command line."""
