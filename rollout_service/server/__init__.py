"""The inference server process: SGLang's HTTP API (and the OpenAI-compatible one) over
the built-in engine, or the launcher of a real SGLang server."""
