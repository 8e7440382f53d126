"""The data plane (torch): layers, model families, loading, the model runner."""
