"""What breaks: malformed inputs to every entry point, and training under injected OOMs and kills."""
