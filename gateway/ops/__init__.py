"""The process: the command line, the server's wiring (the composition root), its routes, the
supervisor and its workers, `slogate check` and the demo."""
