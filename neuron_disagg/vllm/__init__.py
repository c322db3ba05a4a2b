"""The vLLM side: the connector, its scheduler and worker halves, metrics, `serve`, and the plugin
hook. The only package that imports vllm; importing this package itself imports nothing heavy."""
