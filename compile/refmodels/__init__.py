"""Reference models of each kind with openpilot's exact I/O contract, one module per kind."""
