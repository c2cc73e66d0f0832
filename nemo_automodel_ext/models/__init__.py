"""Model folders of the plugin, laid out like AutoModel's ``components/models``."""
