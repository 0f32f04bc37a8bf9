"""The vLLM engine (`engine`) and what runs in or sets up vLLM's own processes
(`worker`)."""
