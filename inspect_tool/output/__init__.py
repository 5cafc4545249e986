"""Safe output: atomic files and directories, destinations that never destroy inputs, locks."""
