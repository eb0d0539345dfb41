"""Small programs built on the library: what the command line runs."""
