"""Training recipes of the plugin, run with AutoModel's CLI by dotted path."""
