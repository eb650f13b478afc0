"""What every process of one pipeline must agree on, as one validated message."""
