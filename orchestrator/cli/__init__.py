"""The `treepipe` command line: shared flags and errors, the command registry."""
