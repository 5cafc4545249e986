"""Where bytes live: local paths and gs:// object-store prefixes (paths)."""
