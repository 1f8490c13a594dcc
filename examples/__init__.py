"""Examples of bringing your own model, data, loss and metric to psrpc (see examples/README.md)."""
