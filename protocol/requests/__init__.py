"""What a request asks for, as every process reads it: its sampling parameters."""
