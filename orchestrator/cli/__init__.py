"""The `treepipe` command line: shared flags and exit statuses, the command registry, and
every command's parser and argv-facing handler (the only package that imports argparse;
nothing imports it)."""
