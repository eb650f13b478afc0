"""Miss recovery (issue 40): measurements of early-exit correction branches on a replay."""
