"""Small runtime library imported by generated training scripts."""
